/* 512-bit AVX-512 VNNI kernels of quant_kernels.c: 8-bit activations take two
 * weight blocks per vpdpbusd, up to four activation rows sharing each
 * unpacked weight block (tile_avx512); 16-bit activations go through
 * one16 (each 16-bit value split into two bytes, two blocks per
 * vpdpbusd; see there). From tq_set_panel_rows activation rows, 16-bit
 * products take the float panel GEMM instead (panel_gemm_avx512.h, chosen
 * in tq_linear and the fused step). Included after
 * the _vnni instance of quant_kernels_isa.h (whose helpers it uses), inside
 * the same "#pragma GCC target" region. */


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

INLINE void matmul_kind_avx512(const int kind, const int A16, int64_t n0, int64_t n1, const uint8_t *wq,
                               const uint16_t *wd, const uint16_t *wm, int64_t K, const void *qa, const float *fa,
                               int64_t M, float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    MATMUL_ROWS(tile_avx512)
}

/* ---- 16-bit activations, few activation rows (decode of small batches),
 * every layout.
 *
 * vpdpwssd multiplies 32 16-bit pairs per instruction and needs the weights
 * widened to 16 bits (a cross-lane shuffle per block). Instead each
 * activation a = 256 hi + lo is split once per call into its unsigned low
 * byte and signed high byte, and two vpdpbusd per PAIR of blocks give the
 * exact int32 dot products: w . a = 256 (w . hi) + (w . lo), w taken as the
 * unsigned operand against hi and, since q < 128, as the signed one against
 * lo. Q8's unsigned q + 128 does not fit a signed byte: there the signed
 * value s = q - 128 meets lo as is and hi + 128 (unsigned), and
 * s . hi = s . (hi + 128) - 128 sum(s) is a third vpdpbusd; all in int32,
 * exact, so Q8 needs no minimum term. Per pair of blocks that is 3 (Q4)
 * vector operations to unpack, 3 for the products and 3 for the scaling
 * (the weight scales of 4 blocks converted and spread at once), against ~12
 * per block in tile_avx512. */

/* lo / hi planes of one row of int16 activations (nb blocks, zero-padded to
 * a multiple of 4), in the byte order the weights of `kind` unpack to in
 * one16_weights: per pair of blocks (b, b + 1), Q4: values 0-15 of b, 0-15 of
 * b + 1, 16-31 of b, 16-31 of b + 1 (nibble order); the others: b, then b + 1.
 * Q8's hi bytes are stored + 128 (unsigned). */
INLINE void one16_split(const int kind, const int16_t *a, int64_t nb, uint8_t *lo, uint8_t *hi) {
    const int64_t nb4 = (nb + 3) & ~(int64_t)3;
    for (int64_t b = 0; b < nb4; b += 2) {
        const __m512i v0 = b < nb ? _mm512_loadu_si512((const void *)(a + b * QK)) : _mm512_setzero_si512();
        const __m512i v1 = b + 1 < nb ? _mm512_loadu_si512((const void *)(a + (b + 1) * QK)) : _mm512_setzero_si512();
        __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v0)), _mm512_cvtepi16_epi8(v1), 1);
        __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(v0, 8))),
                                       _mm512_cvtepi16_epi8(_mm512_srai_epi16(v1, 8)), 1);
        if (kind == K_Q4) { /* 128-bit lanes 0, 2, 1, 3 */
            l = _mm512_shuffle_i64x2(l, l, 0xd8);
            h = _mm512_shuffle_i64x2(h, h, 0xd8);
        } else if (kind == K_Q8) {
            h = _mm512_xor_si512(h, _mm512_set1_epi8((char)0x80));
        }
        _mm512_store_si512((void *)(lo + b * QK), l);
        _mm512_store_si512((void *)(hi + b * QK), h);
    }
}

/* The weights of blocks b, b + 1 of one weight row (nvalid of them inside
 * the row, 0-2; the others read as zero) as vpdpbusd operands, lanes as in
 * one16_split: Q4, Q5, Q6 the unsigned values (< 64), Q8 the signed q - 128. */
INLINE __m512i one16_weights(const int kind, const uint8_t *w, int64_t b, const int nvalid) {
    if (kind == K_Q8) {
        const uint8_t *q = w + b * 32;
        const __m512i x = nvalid == 2 ? _mm512_loadu_si512((const void *)q)
                                      : _mm512_maskz_loadu_epi8(nvalid ? 0xffffffffu : 0u, q);
        return _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80));
    }
    if (kind == K_Q4) {
        const uint8_t *q = w + b * 16;
        const __m256i x = nvalid == 2 ? _mm256_loadu_si256((const __m256i *)q)
                                      : _mm256_maskz_loadu_epi8(nvalid ? 0xffffu : 0u, q);
        return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 4), 1),
                                _mm512_set1_epi8(0x0f));
    }
    const int qb = KIND_QBYTES(kind);
    const __m256i u0 = nvalid >= 1 ? unpack_vnni(kind, w + b * qb) : _mm256_setzero_si256();
    const __m256i u1 = nvalid >= 2 ? unpack_vnni(kind, w + (b + 1) * qb) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
}

/* 128 sum(s) of Q8's signed weights s of a pair of blocks (lanes as the
 * products; shared by every activation row), zero for the other kinds. */
INLINE __m512i one16_q8sum(const int kind, __m512i wv) {
    if (kind != K_Q8) return _mm512_setzero_si512();
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), wv);
}

/* Exact int32 dot products (as floats) of the weights wv of a pair of
 * blocks (q8sum: one16_q8sum of them) with the split activations lo, hi of
 * the same pair. */
INLINE __m512 one16_dot(const int kind, __m512i wv, __m512i q8sum, const uint8_t *lo, const uint8_t *hi) {
    const __m512i l = _mm512_load_si512((const void *)lo), h = _mm512_load_si512((const void *)hi);
    __m512i ph;
    if (kind == K_Q8) /* s . hi = s . (hi + 128) - 128 sum(s) */
        ph = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), h, wv), q8sum);
    else
        ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, h);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_slli_epi32(ph, 8), l, wv));
}

/* Block-scale lanes of a pair of blocks (b, b + 1) from a vector of the
 * scales of blocks b .. b + 3; the pair (b + 2, b + 3) adds 2. */
static const int32_t ONE16_SPREAD_Q4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};

/* Activation rows that share each unpacked weight block (accumulators in
 * registers: 8 of the 32) */
#define ONE16_MAXM 4

/* Q6: two scales a block, one per 16 values: dw 8 scales of blocks
 * b .. b + 3, da their 4 activation scales -> the 8 products (pairs: 4 lanes
 * each, SPREAD4 and SPREAD4 + 4). Others: 4 scales, 4 products. */
INLINE __m512 one16_scales(const int kind, __m256 dw, __m128 da) {
    if (kind == K_Q6)
        return _mm512_castps256_ps512(
            _mm256_mul_ps(dw, _mm256_permutexvar_ps(_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_castps128_ps256(da))));
    return _mm512_castps128_ps512(_mm_mul_ps(_mm256_castps256_ps128(dw), da));
}

/* The dot products of one weight row (nb blocks at w, scales d, minimums
 * m) with R split activation rows (row r: planes at lo + r * ps, hi + r * ps;
 * fa planes at fa + r * FA * nb) into out [R]. The unpacked weights of
 * each pair of blocks are shared by the R rows. */
INLINE void one16_row(const int kind, const int R, const uint8_t *w, const uint16_t *d, const uint16_t *m, int64_t nb,
                      const uint8_t *lo, const uint8_t *hi, int64_t ps, const float *fa, float *out) {
    const int q6 = kind == K_Q6; /* scales a block: 1 + q6 */
    const __m512i sp0 = _mm512_loadu_si512(
                      (const void *)(q6 ? SPREAD4 : kind == K_Q4 ? ONE16_SPREAD_Q4 : SPREAD2)),
                  sp1 = _mm512_add_epi32(sp0, _mm512_set1_epi32(q6 ? 4 : 2));
    __m512 acc0[ONE16_MAXM], acc1[ONE16_MAXM];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const __m256 dw = q6 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 2 * b)))
                             : _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + b))));
        const __m512i w0 = one16_weights(kind, w, b, 2), w1 = one16_weights(kind, w, b + 2, 2);
        const __m512i c0 = one16_q8sum(kind, w0), c1 = one16_q8sum(kind, w1);
        for (int r = 0; r < R; r++) {
            const __m512 s = one16_scales(kind, dw, _mm_loadu_ps(fa + r * FA * nb + b));
            const uint8_t *l = lo + r * ps + b * QK, *h = hi + r * ps + b * QK;
            acc0[r] = _mm512_fmadd_ps(one16_dot(kind, w0, c0, l, h), _mm512_permutexvar_ps(sp0, s), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(one16_dot(kind, w1, c1, l + 2 * QK, h + 2 * QK), _mm512_permutexvar_ps(sp1, s),
                                      acc1[r]);
        }
    }
    if (b < nb) { /* 1-3 last blocks: the padding reads as zero weights, scales and activations */
        const int t = (int)(nb - b);
        const __mmask8 mk = (__mmask8)((1u << t) - 1u), mkd = (__mmask8)((1u << (t << q6)) - 1u);
        const __m256 dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mkd, d + (b << q6)));
        const __m512i w0 = one16_weights(kind, w, b, t < 2 ? t : 2), w1 = one16_weights(kind, w, b + 2, t > 2 ? t - 2 : 0);
        const __m512i c0 = one16_q8sum(kind, w0), c1 = one16_q8sum(kind, w1);
        for (int r = 0; r < R; r++) {
            const __m512 s = one16_scales(kind, dw, _mm_maskz_loadu_ps(mk, fa + r * FA * nb + b));
            const uint8_t *l = lo + r * ps + b * QK, *h = hi + r * ps + b * QK;
            acc0[r] = _mm512_fmadd_ps(one16_dot(kind, w0, c0, l, h), _mm512_permutexvar_ps(sp0, s), acc0[r]);
            if (t > 2)
                acc1[r] = _mm512_fmadd_ps(one16_dot(kind, w1, c1, l + 2 * QK, h + 2 * QK), _mm512_permutexvar_ps(sp1, s),
                                          acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        out[r] = kind == K_Q8 ? sum : sum + min_term_vnni(kind, 0, d, m, fa + r * FA * nb, nb);
    }
}

/* Weight rows prefetched ahead: at one activation row a weight row is read
 * once and is only 0.3-1 KiB, too short for the hardware prefetchers to run
 * ahead. Batch-1 decode step of the default model, 2 threads, alternating
 * in one process: no prefetch 15.1 ms, 2 rows ahead 12.3, 4 rows 10.1 / 8.0,
 * 8 rows 8.6 (two runs, the machine getting quieter). */
#define ONE16_PF 4
static _Thread_local uint8_t *planes_buf;
static _Thread_local size_t planes_cap;
/* What planes_buf holds when il_matmul_avx512 may reuse it (see planes_tag):
 * qa [M, K] and its FA planes in the pass layout (interleaved_avx512.h),
 * whose bytes, meta fields and passes depend on bits, Q8I (q8), Q6I (q6) and
 * wide passes (il_wide), made under tag; tag 0: nothing reusable. */
static _Thread_local struct {
    uint64_t tag;
    const void *qa;
    int64_t M, K;
    int q8, q6, bits, wide;
} planes_have;

/* This thread's buffer for the byte planes of split 16-bit activations
 * (one16) or the pass layout of activations (il_matmul_avx512), at least
 * `bytes` long, 64-byte aligned; NULL when it cannot be allocated. */
static uint8_t *activation_planes(size_t bytes) {
    planes_have.tag = 0; /* the caller overwrites it */
    if (bytes > planes_cap) {
        free(planes_buf);
        planes_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        planes_cap = planes_buf ? bytes : 0;
    }
    return planes_buf;
}

/* Weight rows n0 .. n1 - 1 of y = x @ W^T for M activation rows split into
 * the byte planes lo, hi (row stride ps) by one16_split. */
INLINE void one16_rows(const int kind, int64_t n0, int64_t n1, const uint8_t *wq, const uint16_t *wd,
                       const uint16_t *wm, int64_t N, int64_t K, const uint8_t *lo, const uint8_t *hi, int64_t ps,
                       const float *fa, int64_t M, float *y, int64_t ldy, const float *bias, const float *res,
                       int64_t ldr) {
    const int64_t nb = K / QK, qb = KIND_QBYTES(kind);
    for (int64_t n = n0; n < n1; n++) {
        float s[ONE16_MAXM];
        const uint8_t *w = wq + n * nb * qb;
        if (n + ONE16_PF < N) {
            const char *pw = (const char *)(w + ONE16_PF * nb * qb);
            for (int64_t o = 0; o < nb * qb; o += 64) _mm_prefetch(pw + o, _MM_HINT_T0);
            _mm_prefetch((const char *)(wd + (n + ONE16_PF) * nb * (kind == K_Q6 ? 2 : 1)), _MM_HINT_T0);
            if (wm) _mm_prefetch((const char *)(wm + (n + ONE16_PF) * nb), _MM_HINT_T0);
        }
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        for (int64_t r0 = 0; r0 < M; r0 += ONE16_MAXM) {
            const int64_t R = M - r0 < ONE16_MAXM ? M - r0 : ONE16_MAXM;
            const uint8_t *l = lo + r0 * ps, *h = hi + r0 * ps;
            const float *f = fa + r0 * FA * nb;
            switch (R) { /* R a constant in each instance */
            case 1: one16_row(kind, 1, w, d, m, nb, l, h, ps, f, s); break;
            case 2: one16_row(kind, 2, w, d, m, nb, l, h, ps, f, s); break;
            case 3: one16_row(kind, 3, w, d, m, nb, l, h, ps, f, s); break;
            default: one16_row(kind, 4, w, d, m, nb, l, h, ps, f, s); break;
            }
            for (int64_t r = 0; r < R; r++) y[(r0 + r) * ldy + n] = finish(s[r], r0 + r, n, bias, res, ldr);
        }
    }
}

/* y = x @ W^T for M activation rows (the engine sends it fewer than
 * tq_set_panel_rows) and W of a row-layout block kind; returns 0, or -1
 * (nothing done) when the activation planes cannot be allocated. */
static int one16(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                 const int16_t *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                 const float *res, int64_t ldr) {
    const int64_t nb = K / QK, ps = ((nb + 3) & ~(int64_t)3) * QK;
    uint8_t *const lo = activation_planes((size_t)(2 * M * ps));
    if (!lo) return -1;
    uint8_t *const hi = lo + M * ps;
    for (int64_t r = 0; r < M; r++) one16_split(kind, qa + r * K, nb, lo + r * ps, hi + r * ps);
#define ONE16_ROWS(KIND) one16_rows(KIND, n0, n1, wq, wd, wm, N, K, lo, hi, ps, fa, M, y, ldy, bias, res, ldr)
    PAR_RANGE(N, N * M * nb >= par_min, switch (kind) {
        case K_Q8: ONE16_ROWS(K_Q8); break;
        case K_Q4: ONE16_ROWS(K_Q4); break;
        case K_Q5: ONE16_ROWS(K_Q5); break;
        default: ONE16_ROWS(K_Q6); break;
    });
#undef ONE16_ROWS
    return 0;
}

static void matmul_avx512(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                          int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                          const float *bias, const float *res, int64_t ldr) {
    if (bits == 16) {
        const int16_t *a = (const int16_t *)qa;
        if (one16(kind, wq, wd, wm, N, K, a, fa, M, y, ldy, bias, res, ldr) == 0) return;
    }
    PAR_RANGE(N, N * M * (K / QK) >= par_min,
              DISPATCH_KINDS(matmul_kind_avx512, n0, n1, wq, wd, wm, K, qa, fa, M, y, ldy, bias, res, ldr));
}
