/* 512-bit AVX-512 VNNI kernels of quant_kernels.c: 8-bit activations take two
 * weight blocks per vpdpbusd, 16-bit activations one block per vpdpwssd; up
 * to four activation rows share each unpacked weight block. Included after
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

static void matmul_avx512(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                          int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                          const float *bias, const float *res, int64_t ldr) {
    DISPATCH_KINDS(matmul_kind_avx512, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr)
}

#undef INLINE
#undef KIND_QBYTES
