/* Float GEMM over quantized weights for many activation rows (prefill, large
 * decode batches): y = x @ W^T (+ bias) (+ res), x float32, W in any layout of
 * quant_kernels.c (block kinds 0-3) or float16 / bfloat16 (kinds 4, 5).
 * Included after quant_kernels_avx512.h (uses unpack_vnni),
 * inside the same "#pragma GCC target" region.
 *
 * Method (the packed-panel GEMM of BLIS / GotoBLAS, Goto & van de Geijn,
 * "Anatomy of high-performance matrix multiplication", ACM TOMS 2008, with
 * the packing step doubling as dequantization): the outputs are cut into
 * panels of PANEL_N = 32 weight rows. A thread dequantizes a panel into a
 * float32 buffer laid out k-major ([K][32]: the 32 weights of step k are two
 * 512-bit vectors; the transposes are done in registers, on the quantized
 * bytes for the block kinds, see panel_fill16), then
 * runs every activation row against it in tiles of PANEL_MR rows: per k, two
 * vector loads of weights, one broadcast of x[r, k] per row and two FMAs per
 * row (24 accumulators in registers). The panel (K * 128 bytes) stays in L2
 * while all M rows pass, so each weight is dequantized once per call, and no
 * float copy of W is kept or written to memory: the previous route
 * dequantized 16 MiB tiles and called PyTorch's GEMM, twice the CPU time at
 * 64 rows, mostly in writing and re-reading the tiles (see docs/benchmarks.md).
 *
 * Each output is one FMA chain over k = 0 .. K-1 in order, from 0.0, then
 * the bias and the residual are added: its value does not depend on M, on
 * which rows share its tile, on the panel it falls in or on the thread
 * split, so a row's result is the same in every batch that takes this
 * route. The weights are the values tq_dequantize gives (d * q + m by one
 * FMA, as dequantize_avx2). */

#define PANEL_N 32
#define PANEL_MR 12

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

/* Two float32 vectors a, b (16 columns at steps k and k + 1) as bfloat16
 * pairs: lane j = (a[j], b[j]), each rounded to nearest even. Only where the
 * CPU has AVX512_BF16. */
INLINE __m512i bf16_pairs(__m512 a, __m512 b) {
    /* cvtne2ps puts a in words 0-15 and b in 16-31; interleave them */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* Dequantize weight rows n0 .. n0 + nr - 1 (nr <= 16) into columns c0 .. c0 +
 * 15 of the panel P [K][PANEL_N]; columns past nr get zeros. bf16 (block
 * kinds only; a constant at each call): write them as bfloat16 pairs
 * [K/2][PANEL_N] of 32-bit lanes instead (panel_gemm_bf16.h's layout), the
 * same values panel_round_bf16 makes of the float32 panel. */
INLINE void panel_fill16(const int kind, const int bf16, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                         int64_t n0, int64_t nr, int64_t K, float *P, int c0) {
    if (kind >= 4) { /* float16 / bfloat16 rows [N, K] */
        const uint16_t *w = (const uint16_t *)wq;
        for (int64_t k = 0; k < K; k += 16) {
            const int kn = K - k < 16 ? (int)(K - k) : 16; /* K need not be a multiple of 16 here */
            __m512i t[16];
            for (int j = 0; j < 16; j++) {
                if (j >= nr) {
                    t[j] = _mm512_setzero_si512();
                    continue;
                }
                const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << kn) - 1u), w + (n0 + j) * K + k);
                t[j] = kind == 5 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)
                                 : _mm512_castps_si512(_mm512_cvtph_ps(h));
            }
            transpose16x16(t);
            for (int i = 0; i < kn; i++) _mm512_store_ps(P + (k + i) * PANEL_N + c0, _mm512_castsi512_ps(t[i]));
        }
        return;
    }
    /* Block kinds: the 32 quantized values of each of the 16 rows stay bytes
     * through the transpose (a 16 x 8 transpose of 32-bit groups of four
     * values, 24 permutes per block where floats took 128), then each k
     * takes its byte out of every group by a shift and a mask, converts it
     * and applies the per-row scale and minimum as one FMA: the same
     * d * q + m as tq_dequantize. The scales of 16 blocks are transposed
     * once (float, 16 x 16) so each block finds its per-row scales as one
     * vector. */
    const int64_t nb = K / QK;
    const int qb = KIND_QBYTES(kind), ns = kind == K_Q6 ? 2 : 1; /* scales per block */
    const int64_t gn = 16 / ns;                                   /* blocks per scale group */
    /* stage 1 of the transpose: from rows 4p..4p+3 (two per input vector),
     * groups t = 0..3 (idx_lo) or 4..7 (idx_hi), laid out [t][row] */
    const __m512i idx_lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i idx_hi = _mm512_add_epi32(idx_lo, _mm512_set1_epi32(4));
    const __m512i low8 = _mm512_set1_epi32(0xff);
    for (int64_t g = 0; g < nb; g += gn) {
        const int64_t gb = nb - g < gn ? nb - g : gn;
        const __mmask16 sm = gb * ns >= 16 ? 0xffff : (__mmask16)((1u << (gb * ns)) - 1u);
        __m512i D[16], Mn[16]; /* after the transposes: D[s] lane j = scale s of the group, row j */
        for (int j = 0; j < 16; j++) {
            D[j] = Mn[j] = _mm512_setzero_si512();
            if (j >= nr) continue;
            const int64_t o = ((n0 + j) * nb + g) * ns;
            D[j] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, wd + o)));
            if (kind == K_Q4 || kind == K_Q5)
                Mn[j] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, wm + (n0 + j) * nb + g)));
        }
        transpose16x16(D);
        if (kind == K_Q4 || kind == K_Q5) transpose16x16(Mn);
        for (int64_t bb = 0; bb < gb; bb++) {
            const int64_t b = g + bb;
            __m512i Z[8], A[8], C[8], T[8];
            for (int i = 0; i < 8; i++) {
                const int64_t j = 2 * i;
                const __m256i u0 = j < nr ? unpack_vnni(kind, wq + ((n0 + j) * nb + b) * qb) : _mm256_setzero_si256();
                const __m256i u1 = j + 1 < nr ? unpack_vnni(kind, wq + ((n0 + j + 1) * nb + b) * qb)
                                              : _mm256_setzero_si256();
                Z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
            }
            for (int p = 0; p < 4; p++) { /* A[p]: groups 0-3 of rows 4p..4p+3; A[4 + p]: groups 4-7 */
                A[p] = _mm512_permutex2var_epi32(Z[2 * p], idx_lo, Z[2 * p + 1]);
                A[4 + p] = _mm512_permutex2var_epi32(Z[2 * p], idx_hi, Z[2 * p + 1]);
            }
            for (int h = 0; h < 8; h += 4) /* C[h + q]: groups 2q', 2q'+1 of rows 0-7 (q < 2) or 8-15 */
                for (int q = 0; q < 2; q++) {
                    C[h + q] = _mm512_shuffle_i32x4(A[h], A[h + 1], q ? 0xee : 0x44);
                    C[h + 2 + q] = _mm512_shuffle_i32x4(A[h + 2], A[h + 3], q ? 0xee : 0x44);
                }
            for (int q = 0; q < 4; q++) { /* T[t] lane j: values 4t..4t+3 of row j */
                const int h = (q >> 1) * 4, c = q & 1;
                T[2 * q] = _mm512_shuffle_i32x4(C[h + c], C[h + 2 + c], 0x88);
                T[2 * q + 1] = _mm512_shuffle_i32x4(C[h + c], C[h + 2 + c], 0xdd);
            }
            const __m512 d0 = _mm512_castsi512_ps(D[bb * ns]), d1 = _mm512_castsi512_ps(D[bb * ns + ns - 1]);
            const __m512 m0 = kind == K_Q8   ? _mm512_mul_ps(d0, _mm512_set1_ps(-128.0f))
                              : kind == K_Q6 ? _mm512_mul_ps(d0, _mm512_set1_ps(-32.0f))
                                             : _mm512_castsi512_ps(Mn[bb]);
            const __m512 m1 = kind == K_Q6 ? _mm512_mul_ps(d1, _mm512_set1_ps(-32.0f)) : m0;
            float *p = P + b * QK * PANEL_N + c0;
            uint32_t *p2 = (uint32_t *)P + b * (QK / 2) * PANEL_N + c0;
            for (int t = 0; t < 8; t++) {
                const __m512 d = t < 4 ? d0 : d1, m = t < 4 ? m0 : m1;
                const __m512i v[4] = {_mm512_and_si512(T[t], low8),
                                      _mm512_and_si512(_mm512_srli_epi32(T[t], 8), low8),
                                      _mm512_and_si512(_mm512_srli_epi32(T[t], 16), low8),
                                      _mm512_srli_epi32(T[t], 24)};
                __m512 w[4];
                for (int s = 0; s < 4; s++) w[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[s]), d, m);
                if (bf16) { /* k = 4t .. 4t + 3: pairs 2t and 2t + 1 of the block */
                    _mm512_store_si512(p2 + (2 * t) * PANEL_N, bf16_pairs(w[0], w[1]));
                    _mm512_store_si512(p2 + (2 * t + 1) * PANEL_N, bf16_pairs(w[2], w[3]));
                } else {
                    for (int s = 0; s < 4; s++) _mm512_store_ps(p + (4 * t + s) * PANEL_N, w[s]);
                }
            }
        }
    }
}

/* Write a tile's accumulators acc [R][2] (columns n0 .. n0 + nc - 1, nc <=
 * 32) to rows r0 .. r0 + R - 1 of y, adding bias and res where given. */
INLINE void panel_store(const int R, __m512 acc[][2], int64_t r0, int64_t n0, int64_t nc, float *y, int64_t ldy,
                        const float *bias, const float *res, int64_t ldr) {
    const __mmask16 m0 = nc >= 16 ? 0xffff : (__mmask16)((1u << nc) - 1u),
                    m1 = nc >= 32 ? 0xffff : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1u);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 v0 = _mm512_add_ps(acc[r][0], b0), v1 = _mm512_add_ps(acc[r][1], b1);
        if (res) {
            const float *rr = res + (r0 + r) * ldr + n0;
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, rr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, rr + 16));
        }
        float *yr = y + (r0 + r) * ldy + n0;
        _mm512_mask_storeu_ps(yr, m0, v0);
        _mm512_mask_storeu_ps(yr + 16, m1, v1);
    }
}

/* y rows r0 .. r0 + R - 1, columns n0 .. n0 + nc - 1 (nc <= 32) from panel P. */
INLINE void panel_tile(const int R, const float *P, int64_t K, const float *x, int64_t ldx, int64_t r0, int64_t n0,
                       int64_t nc, float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    __m512 acc[PANEL_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *xr = x + r0 * ldx;
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_load_ps(P + k * PANEL_N), w1 = _mm512_load_ps(P + k * PANEL_N + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(xr[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    panel_store(R, acc, r0, n0, nc, y, ldy, bias, res, ldr);
}

static _Thread_local float *panel_buf;
static _Thread_local size_t panel_cap;

/* This thread's panel buffer of at least K * PANEL_N floats, or NULL when it cannot be allocated. */
static float *panel_thread_buf(int64_t K) {
    const size_t bytes = (size_t)K * PANEL_N * sizeof(float);
    if (bytes > panel_cap) {
        free(panel_buf);
        panel_buf = aligned_alloc(64, bytes);
        panel_cap = panel_buf ? bytes : 0;
    }
    return panel_buf;
}

/* Dequantize weight rows n0 .. n0 + nc - 1 (nc <= PANEL_N) of W into the
 * panel P [K][PANEL_N]; bf16 (block kinds only): as bfloat16 pairs (see
 * panel_fill16). */
static void panel_fill(const int kind, const int bf16, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                       int64_t n0, int64_t nc, int64_t K, float *P) {
    for (int h = 0; h < PANEL_N; h += 16) {
        const int64_t nr = nc - h < 0 ? 0 : nc - h < 16 ? nc - h : 16;
        switch (kind * 2 + (bf16 && kind < 4)) { /* kind and bf16 constants in each instance */
        case 2 * K_Q8: panel_fill16(K_Q8, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q4: panel_fill16(K_Q4, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q5: panel_fill16(K_Q5, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q6: panel_fill16(K_Q6, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q8 + 1: panel_fill16(K_Q8, 1, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q4 + 1: panel_fill16(K_Q4, 1, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q5 + 1: panel_fill16(K_Q5, 1, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 2 * K_Q6 + 1: panel_fill16(K_Q6, 1, wq, wd, wm, n0 + h, nr, K, P, h); break;
        case 8: panel_fill16(4, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        default: panel_fill16(5, 0, wq, wd, wm, n0 + h, nr, K, P, h); break;
        }
    }
}

#include "panel_gemm_bf16.h" /* the bfloat16 route: panel_x_bf16, panel_round_bf16, panel_tile_bf16 */

/* Rows r0 .. r0 + R - 1 against the panel: float32 products from x, or
 * bfloat16 ones from xb (P then holds bfloat16 pairs). */
INLINE void panel_pass(const int R, const float *P, int64_t K, const float *x, int64_t ldx, const uint16_t *xb,
                       int64_t r0, int64_t n0, int64_t nc, float *y, int64_t ldy, const float *bias, const float *res,
                       int64_t ldr) {
    if (xb)
        panel_tile_bf16(R, (const uint32_t *)P, K, xb, r0, n0, nc, y, ldy, bias, res, ldr);
    else
        panel_tile(R, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr);
}

/* y = x @ W^T (+ bias) (+ res) for W [N, K] of `kind` (see the top of this
 * file), x float32 [M, K] (row stride ldx); y, res row strides ldy, ldr.
 * xb: NULL, or the same rows rounded to bfloat16 [M, K] (panel_x_bf16; K
 * even; the CPU has AVX512_BF16): bfloat16 products (panel_gemm_bf16.h).
 * buf: a 64-byte aligned panel buffer of K * PANEL_N floats (then one
 * thread runs it all), or NULL (panels split across OpenMP threads, each
 * with a thread-local buffer). Returns 0, or -1 (outputs of the panels
 * concerned not written) when a thread-local buffer cannot be allocated. */
static int panel_gemm(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                      const float *x, int64_t ldx, const uint16_t *xb, int64_t M, float *y, int64_t ldy,
                      const float *bias, const float *res, int64_t ldr, float *buf) {
    const int64_t panels = (N + PANEL_N - 1) / PANEL_N, nb = K / QK;
    int failed = 0;
#pragma omp parallel for if (!buf && N * M * nb >= par_min) schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
        float *const P = buf ? buf : panel_thread_buf(K);
        if (!P) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
            continue;
        }
        const int64_t n0 = pi * PANEL_N, nc = N - n0 < PANEL_N ? N - n0 : PANEL_N;
        panel_fill(kind, xb != 0, wq, wd, wm, n0, nc, K, P); /* block kinds: bfloat16 pairs at once */
        if (xb && kind >= 4) panel_round_bf16(P, K);
        int64_t r0 = 0;
        for (; r0 + PANEL_MR <= M; r0 += PANEL_MR)
            panel_pass(PANEL_MR, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr);
        switch (M - r0) { /* R a constant in each instance */
        case 0: break;
        case 1: panel_pass(1, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 2: panel_pass(2, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 3: panel_pass(3, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 4: panel_pass(4, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 5: panel_pass(5, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 6: panel_pass(6, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 7: panel_pass(7, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 8: panel_pass(8, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 9: panel_pass(9, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 10: panel_pass(10, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        default: panel_pass(11, P, K, x, ldx, xb, r0, n0, nc, y, ldy, bias, res, ldr); break;
        }
    }
    return failed ? -1 : 0;
}
