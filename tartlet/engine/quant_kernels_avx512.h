/* 512-bit AVX-512 VNNI kernel of quant_kernels.c: two weight blocks per
 * vpdpbusd, four activation rows per weight row. Included after the _vnni
 * instance of quant_kernels_isa.h (whose 256-bit helpers it uses for an odd
 * last block), inside the same "#pragma GCC target" region. */

#define INLINE static inline __attribute__((always_inline))
#define KIND_QBYTES(kind) ((kind) == K_Q8 ? 32 : (kind) == K_Q4 ? 16 : (kind) == K_Q5 ? 20 : 24)

/* weight scales of blocks b, b+1 as 16 float lanes (8 per block; Q6: 4 per half) */
INLINE __m512 scales2_avx512(const int kind, const uint16_t *d, int64_t b) {
    if (kind == K_Q6) {
        const __m128i h = _mm_cvtsi64_si128(*(const long long *)(d + 2 * b)); /* 4 halves */
        const __m128 f = _mm_cvtph_ps(h);                                       /* d0 d1 d2 d3 */
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
    }
    return _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(d[b])), _mm256_set1_ps(_cvtsh_ss(d[b + 1])), 1);
}

INLINE float min_term_avx512(const int kind, const uint16_t *d, const uint16_t *m, int64_t b, const float *f) {
    if (kind == K_Q6) return -32.0f * (_cvtsh_ss(d[2 * b]) * f[2] + _cvtsh_ss(d[2 * b + 1]) * f[3]);
    if (kind == K_Q8) return -128.0f * _cvtsh_ss(d[b]) * f[1];
    return _cvtsh_ss(m[b]) * f[1];
}

INLINE void tile_avx512(const int kind, const int R, const uint8_t *wq, const uint16_t *d, const uint16_t *m,
                        int64_t nb, const int8_t *qa, const float *fa, float *out) {
    __m512 acc[4];
    float macc[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        macc[r] = 0.0f;
    }
    const int qb = KIND_QBYTES(kind);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(unpack_vnni(kind, wq + b * qb)),
                                             unpack_vnni(kind, wq + (b + 1) * qb), 1);
        const __m512 dv = scales2_avx512(kind, d, b);
        for (int r = 0; r < R; r++) {
            const int8_t *a = qa + (r * nb + b) * QK;
            const float *f = fa + (r * nb + b) * FA;
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)a));
            const __m512 da = _mm512_insertf32x8(_mm512_set1_ps(f[0]), _mm256_set1_ps(f[FA]), 1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, da), acc[r]);
            macc[r] += min_term_avx512(kind, d, m, b, f) + min_term_avx512(kind, d, m, b + 1, f + FA);
        }
    }
    if (b < nb) {
        float tail[4];
        /* one block left: the 256-bit kernel over the last block of each row */
        for (int r = 0; r < R; r++) {
            const int8_t *a = qa + (r * nb + b) * QK;
            const float *f = fa + (r * nb + b) * FA;
            tile_vnni(kind, 1, wq + b * qb, kind == K_Q6 ? d + 2 * b : d + b, m ? m + b : m, 1, a, f, tail);
            macc[r] += tail[0];
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + macc[r];
}

INLINE void matmul_kind_avx512(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                               int64_t K, const int8_t *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                               const float *bias, const float *res, int64_t ldr) {
    const int64_t nb = K / QK, qb = KIND_QBYTES(kind);
#pragma omp parallel for if (N * M * nb >= 4096) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = wq + n * nb * qb;
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        float s[4];
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            tile_avx512(kind, 4, w, d, m, nb, qa + r * nb * QK, fa + r * nb * FA, s);
            for (int i = 0; i < 4; i++) y[(r + i) * ldy + n] = finish(s[i], r + i, n, bias, res, ldr);
        }
        for (; r < M; r++) {
            tile_avx512(kind, 1, w, d, m, nb, qa + r * nb * QK, fa + r * nb * FA, s);
            y[r * ldy + n] = finish(s[0], r, n, bias, res, ldr);
        }
    }
}

static void matmul_avx512(int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                          const int8_t *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                          const float *res, int64_t ldr) {
    switch (kind) {
    case K_Q8: matmul_kind_avx512(K_Q8, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    case K_Q4: matmul_kind_avx512(K_Q4, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    case K_Q5: matmul_kind_avx512(K_Q5, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    default: matmul_kind_avx512(K_Q6, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    }
}

/* 16-bit activations: one block of 32 int16 per zmm, vpdpwssd. */
INLINE void tile16_avx512(const int kind, const int R, const uint8_t *wq, const uint16_t *d, const uint16_t *m,
                          int64_t nb, const int16_t *qa, const float *fa, float *out) {
    __m512 acc[4];
    float macc[4];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        macc[r] = 0.0f;
    }
    const int qb = KIND_QBYTES(kind);
    for (int64_t b = 0; b < nb; b++) {
        const __m512i w = _mm512_cvtepu8_epi16(unpack_vnni(kind, wq + b * qb));
        __m512 dv;
        float mk = 0.0f;
        if (kind == K_Q6) {
            dv = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(d[2 * b])), _mm256_set1_ps(_cvtsh_ss(d[2 * b + 1])), 1);
        } else {
            const float d0 = _cvtsh_ss(d[b]);
            dv = _mm512_set1_ps(d0);
            mk = kind == K_Q8 ? -128.0f * d0 : _cvtsh_ss(m[b]);
        }
        for (int r = 0; r < R; r++) {
            const int16_t *a = qa + (r * nb + b) * QK;
            const float *f = fa + (r * nb + b) * FA;
            const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)a));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, _mm512_set1_ps(f[0])), acc[r]);
            if (kind == K_Q6) macc[r] -= 32.0f * (_cvtsh_ss(d[2 * b]) * f[2] + _cvtsh_ss(d[2 * b + 1]) * f[3]);
            else macc[r] += mk * f[1];
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + macc[r];
}

INLINE void matmul16_kind_avx512(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                                 int64_t K, const int16_t *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                                 const float *bias, const float *res, int64_t ldr) {
    const int64_t nb = K / QK, qb = KIND_QBYTES(kind);
#pragma omp parallel for if (N * M * nb >= 4096) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = wq + n * nb * qb;
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        float s[4];
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            tile16_avx512(kind, 4, w, d, m, nb, qa + r * nb * QK, fa + r * nb * FA, s);
            for (int i = 0; i < 4; i++) y[(r + i) * ldy + n] = finish(s[i], r + i, n, bias, res, ldr);
        }
        for (; r < M; r++) {
            tile16_avx512(kind, 1, w, d, m, nb, qa + r * nb * QK, fa + r * nb * FA, s);
            y[r * ldy + n] = finish(s[0], r, n, bias, res, ldr);
        }
    }
}

static void matmul16_avx512(int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                            const int16_t *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                            const float *res, int64_t ldr) {
    switch (kind) {
    case K_Q8: matmul16_kind_avx512(K_Q8, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    case K_Q4: matmul16_kind_avx512(K_Q4, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    case K_Q5: matmul16_kind_avx512(K_Q5, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    default: matmul16_kind_avx512(K_Q6, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); break;
    }
}

#undef INLINE
#undef KIND_QBYTES
