/* 512-bit AVX-512 VNNI kernels of quant_kernels.c: 8-bit activations take two
 * weight blocks per vpdpbusd, 16-bit activations one block per vpdpwssd; up
 * to four activation rows share each unpacked weight block. From two
 * activation rows, 16-bit activations against one-scale blocks (Q8, Q4, Q5
 * layouts) go through rows16_a16 instead (16 weight rows per register, see
 * there). Included after
 * the _vnni instance of quant_kernels_isa.h (whose helpers it uses), inside
 * the same "#pragma GCC target" region. */

#define INLINE static inline __attribute__((always_inline))
#define KIND_QBYTES(kind) ((kind) == K_Q8 ? 32 : (kind) == K_Q4 ? 16 : (kind) == K_Q5 ? 20 : 24)

/* lanes 0-7 <- element 0, lanes 8-15 <- element 1 (Q6: four elements, four lanes each) */
static const int32_t SPREAD2[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
static const int32_t SPREAD4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* one block of 16-bit activations for R rows, accumulated into acc */
INLINE void block16_avx512(const int kind, const int R, const uint8_t *wq, const uint16_t *d, int64_t nb,
                           const void *qa, const float *fa, int64_t b, __m512 *acc) {
    const __m512i w = _mm512_cvtepu8_epi16(unpack_vnni(kind, wq + b * KIND_QBYTES(kind)));
    if (kind == K_Q6) { /* a weight scale per 16-value half: lanes 0-7 and 8-15 */
        const __m512i spread = _mm512_loadu_si512((const void *)SPREAD2);
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)(d + 2 * b)));
        for (int r = 0; r < R; r++) {
            const int16_t *a = (const int16_t *)qa + (r * nb + b) * QK;
            const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)a));
            const __m128 sc = _mm_mul_ps(dw, _mm_set1_ps(fa[r * FA * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sc)), acc[r]);
        }
    } else {
        const float dw = _cvtsh_ss(d[b]);
        for (int r = 0; r < R; r++) {
            const int16_t *a = (const int16_t *)qa + (r * nb + b) * QK;
            const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)a));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dw * fa[r * FA * nb + b]), acc[r]);
        }
    }
}

INLINE void tile_avx512(const int kind, const int A16, const int R, const uint8_t *wq, const uint16_t *d,
                        const uint16_t *m, int64_t nb, const void *qa, const float *fa, float *out) {
    const int qb = KIND_QBYTES(kind);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    if (A16) {
        /* two accumulator sets (even and odd blocks) halve the fma dependency chain */
        __m512 acc2[4];
        for (int r = 0; r < R; r++) acc2[r] = _mm512_setzero_ps();
        for (; b + 2 <= nb; b += 2) {
            block16_avx512(kind, R, wq, d, nb, qa, fa, b, acc);
            block16_avx512(kind, R, wq, d, nb, qa, fa, b + 1, acc2);
        }
        if (b < nb) block16_avx512(kind, R, wq, d, nb, qa, fa, b++, acc);
        for (int r = 0; r < R; r++) acc[r] = _mm512_add_ps(acc[r], acc2[r]);
    } else {
        const __m512i spread = _mm512_loadu_si512((const void *)(kind == K_Q6 ? SPREAD4 : SPREAD2));
        for (; b + 2 <= nb; b += 2) {
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(unpack_vnni(kind, wq + b * qb)),
                                                 unpack_vnni(kind, wq + (b + 1) * qb), 1);
            /* Q6: d of 4 halves; else d of 2 blocks */
            const __m128 dw = kind == K_Q6 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + 2 * b)))
                                           : _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)(d + b)));
            for (int r = 0; r < R; r++) {
                const int8_t *a = (const int8_t *)qa + (r * nb + b) * QK;
                const float *da = fa + r * FA * nb + b;
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)a));
                const __m128 dd = kind == K_Q6 ? _mm_setr_ps(da[0], da[0], da[1], da[1])
                                               : _mm_castpd_ps(_mm_load_sd((const double *)da));
                const __m512 sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dd)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[r]);
            }
        }
    }
    __m256 tail[4];
    for (int r = 0; r < R; r++) tail[r] = _mm256_setzero_ps();
    if (b < nb) { /* an odd last block of 8-bit activations: one 256-bit product */
        const __m256i w = unpack_vnni(kind, wq + b * qb);
        const float d0 = _cvtsh_ss(d[kind == K_Q6 ? 2 * b : b]), d1 = kind == K_Q6 ? _cvtsh_ss(d[2 * b + 1]) : d0;
        for (int r = 0; r < R; r++) {
            const float da = fa[r * FA * nb + b];
            const __m256i p = dot_vnni(w, _mm256_loadu_si256((const __m256i *)((const int8_t *)qa + (r * nb + b) * QK)));
            tail[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_setr_m128(_mm_set1_ps(d0 * da), _mm_set1_ps(d1 * da)));
        }
    }
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) + hsum_vnni(tail[r]) + min_term_vnni(kind, 0, d, m, fa + r * FA * nb, nb);
}

INLINE void matmul_kind_avx512(const int kind, const int A16, const uint8_t *wq, const uint16_t *wd,
                               const uint16_t *wm, int64_t N, int64_t K, const void *qa, const float *fa, int64_t M,
                               float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    MATMUL_ROWS(tile_avx512)
}

/* ---- 16-bit activations, one scale per block (Q8, Q4, Q5 layouts): 16
 * weight rows at a time, one output row per lane.
 *
 * The tile kernel above puts a block's 16 pairs of one weight row in the
 * lanes: every (block, activation row) then pays an int -> float
 * conversion, a scalar scale and an FMA for 32 products, and the sum over
 * lanes comes at the end. Here a block of 16 weight rows is unpacked and
 * transposed (lane j = row j, register k = pair k), so one vpdpwssd per
 * pair multiplies 16 rows by a broadcast activation pair, and the
 * conversion and scaling are paid once per 16 rows; the unpack and
 * transpose are shared by every activation row. Each output's arithmetic
 * (block by block: int dot, times d_w * d_a, plus the minimum term) does not
 * depend on M, on which rows share its group or on the thread split, so a
 * row's result is the same in every batch. */

/* Transpose 16 x 16 32-bit elements: r[i] lane j <- r[j] lane i. */
INLINE void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* acc [16] += p * (d_w * d_a) + m_w * (d_a sum(a)) for block b of one
 * activation row (its fa planes f, see FA). */
INLINE void rows16_add(float *acc, __m512i p, __m512 dv, __m512 mv, const float *f, int64_t nb, int64_t b) {
    __m512 t = _mm512_load_ps(acc);
    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, _mm512_set1_ps(f[b])), t);
    _mm512_store_ps(acc, _mm512_fmadd_ps(mv, _mm512_set1_ps(f[nb + b]), t));
}

#define ROWS16_M 32
/* Fewer activation rows than this take the tile kernel: with one row the
 * unpack and transpose of 16 weight rows cost more than they save. */
#define ROWS16_MIN 2 /* activation rows per pass over a group's blocks (accumulators in L1) */

/* Outputs n0 .. n0 + nr - 1 (nr <= 16) of y for all M activation rows. */
INLINE void rows16_a16(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t n0,
                       int64_t nr, int64_t nb, int64_t K, const int16_t *qa, const float *fa, int64_t M, float *y,
                       int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    const int qb = KIND_QBYTES(kind);
    float ds[16], ms[16];
    __attribute__((aligned(64))) float acc[ROWS16_M * 16];
    for (int64_t r0 = 0; r0 < M; r0 += ROWS16_M) {
        const int64_t mr = M - r0 < ROWS16_M ? M - r0 : ROWS16_M;
        for (int64_t i = 0; i < mr * 16; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
        for (int64_t b = 0; b < nb; b++) {
            __m512i w[16];
            for (int j = 0; j < 16; j++) {
                if (j < nr) {
                    const int64_t o = (n0 + j) * nb + b;
                    w[j] = _mm512_cvtepu8_epi16(unpack_vnni(kind, wq + o * qb));
                    ds[j] = _cvtsh_ss(wd[o]);
                    ms[j] = kind == K_Q8 ? -128.0f * ds[j] : _cvtsh_ss(wm[o]);
                } else {
                    w[j] = _mm512_setzero_si512();
                    ds[j] = ms[j] = 0.0f;
                }
            }
            transpose16x16(w);
            const __m512 dv = _mm512_loadu_ps(ds), mv = _mm512_loadu_ps(ms);
            /* int32 sums are exact, so splitting them into independent
             * chains (vpdpwssd has a 5-cycle latency) changes no result */
            int64_t r = 0;
            for (; r + 4 <= mr; r += 4) {
                const int32_t *a = (const int32_t *)(qa + (r0 + r) * K + b * QK); /* 16 pairs a row */
                const int64_t ka = K / 2; /* pairs per activation row */
                __m512i p[4][2];
                for (int i = 0; i < 4; i++) p[i][0] = p[i][1] = _mm512_setzero_si512();
                for (int k = 0; k < 16; k++)
                    for (int i = 0; i < 4; i++)
                        p[i][k & 1] = _mm512_dpwssd_epi32(p[i][k & 1], w[k], _mm512_set1_epi32(a[i * ka + k]));
                for (int i = 0; i < 4; i++)
                    rows16_add(acc + (r + i) * 16, _mm512_add_epi32(p[i][0], p[i][1]), dv, mv,
                               fa + (r0 + r + i) * FA * nb, nb, b);
            }
            for (; r < mr; r++) {
                const int32_t *a = (const int32_t *)(qa + (r0 + r) * K + b * QK);
                __m512i p[4];
                for (int i = 0; i < 4; i++) p[i] = _mm512_setzero_si512();
                for (int k = 0; k < 16; k++) p[k & 3] = _mm512_dpwssd_epi32(p[k & 3], w[k], _mm512_set1_epi32(a[k]));
                rows16_add(acc + r * 16, _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3])),
                           dv, mv, fa + (r0 + r) * FA * nb, nb, b);
            }
        }
        for (int64_t r = 0; r < mr; r++)
            for (int64_t j = 0; j < nr; j++)
                y[(r0 + r) * ldy + n0 + j] = finish(acc[r * 16 + j], r0 + r, n0 + j, bias, res, ldr);
    }
}

INLINE void matmul16_kind_avx512(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                                 int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                                 const float *bias, const float *res, int64_t ldr) {
    const int64_t nb = K / QK, groups = (N + 15) / 16;
#pragma omp parallel for if (N * M * nb >= par_min) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        rows16_a16(kind, wq, wd, wm, g * 16, N - g * 16 < 16 ? N - g * 16 : 16, nb, K, (const int16_t *)qa, fa, M, y,
                   ldy, bias, res, ldr);
}

static void matmul_avx512(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                          int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                          const float *bias, const float *res, int64_t ldr) {
    if (bits == 16 && kind != K_Q6 && M >= ROWS16_MIN) {
        switch (kind) {
        case K_Q8: matmul16_kind_avx512(K_Q8, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); return;
        case K_Q4: matmul16_kind_avx512(K_Q4, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); return;
        default: matmul16_kind_avx512(K_Q5, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr); return;
        }
    }
    DISPATCH_KINDS(matmul_kind_avx512, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr)
}

#undef INLINE
#undef KIND_QBYTES
