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
 * 512-bit vectors; each 16 x 16 block is transposed in registers), then
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

/* Dequantize weight rows n0 .. n0 + nr - 1 (nr <= 16) into columns c0 .. c0 +
 * 15 of the panel P [K][PANEL_N]; columns past nr get zeros. */
INLINE void panel_fill16(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t n0,
                         int64_t nr, int64_t K, float *P, int c0) {
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
    const int64_t nb = K / QK;
    const int qb = KIND_QBYTES(kind), q6 = kind == K_Q6;
    for (int64_t b = 0; b < nb; b++) {
        __m512i lo[16], hi[16]; /* values 0-15 and 16-31 of the block, one weight row each */
        for (int j = 0; j < 16; j++) {
            if (j >= nr) {
                lo[j] = hi[j] = _mm512_setzero_si512();
                continue;
            }
            const int64_t o = (n0 + j) * nb + b;
            const __m256i u = unpack_vnni(kind, wq + o * qb);
            const float d0 = _cvtsh_ss(wd[q6 ? 2 * o : o]), d1 = q6 ? _cvtsh_ss(wd[2 * o + 1]) : d0;
            const float m0 = q6 ? -32.0f * d0 : kind == K_Q8 ? -128.0f * d0 : _cvtsh_ss(wm[o]);
            const float m1 = q6 ? -32.0f * d1 : m0;
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u)));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1)));
            lo[j] = _mm512_castps_si512(_mm512_fmadd_ps(f0, _mm512_set1_ps(d0), _mm512_set1_ps(m0)));
            hi[j] = _mm512_castps_si512(_mm512_fmadd_ps(f1, _mm512_set1_ps(d1), _mm512_set1_ps(m1)));
        }
        transpose16x16(lo);
        transpose16x16(hi);
        float *p = P + b * QK * PANEL_N + c0;
        for (int i = 0; i < 16; i++) {
            _mm512_store_ps(p + i * PANEL_N, _mm512_castsi512_ps(lo[i]));
            _mm512_store_ps(p + (16 + i) * PANEL_N, _mm512_castsi512_ps(hi[i]));
        }
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

static _Thread_local float *panel_buf;
static _Thread_local size_t panel_cap;

/* y = x @ W^T (+ bias) (+ res) for W [N, K] of `kind` (see the top of this
 * file), x float32 [M, K] (row stride ldx); y, res row strides ldy, ldr.
 * buf: a 64-byte aligned panel buffer of K * PANEL_N floats (then one
 * thread runs it all), or NULL (panels split across OpenMP threads, each
 * with a thread-local buffer). Returns 0, or -1 (outputs of the panels
 * concerned not written) when a thread-local buffer cannot be allocated. */
static int panel_gemm(const int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                      const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                      const float *res, int64_t ldr, float *buf) {
    const int64_t panels = (N + PANEL_N - 1) / PANEL_N, nb = K / QK;
    int failed = 0;
#pragma omp parallel for if (!buf && N * M * nb >= par_min) schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
        const size_t bytes = (size_t)K * PANEL_N * sizeof(float);
        if (!buf && bytes > panel_cap) {
            free(panel_buf);
            panel_buf = aligned_alloc(64, bytes);
            panel_cap = panel_buf ? bytes : 0;
        }
        float *const P = buf ? buf : panel_buf;
        if (!P) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
            continue;
        }
        const int64_t n0 = pi * PANEL_N, nc = N - n0 < PANEL_N ? N - n0 : PANEL_N;
        for (int h = 0; h < PANEL_N; h += 16) {
            const int64_t nr = nc - h < 0 ? 0 : nc - h < 16 ? nc - h : 16;
            switch (kind) { /* kind a constant in each instance */
            case K_Q8: panel_fill16(K_Q8, wq, wd, wm, n0 + h, nr, K, P, h); break;
            case K_Q4: panel_fill16(K_Q4, wq, wd, wm, n0 + h, nr, K, P, h); break;
            case K_Q5: panel_fill16(K_Q5, wq, wd, wm, n0 + h, nr, K, P, h); break;
            case K_Q6: panel_fill16(K_Q6, wq, wd, wm, n0 + h, nr, K, P, h); break;
            case 4: panel_fill16(4, wq, wd, wm, n0 + h, nr, K, P, h); break;
            default: panel_fill16(5, wq, wd, wm, n0 + h, nr, K, P, h); break;
            }
        }
        int64_t r0 = 0;
        for (; r0 + PANEL_MR <= M; r0 += PANEL_MR)
            panel_tile(PANEL_MR, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr);
        switch (M - r0) { /* R a constant in each instance */
        case 0: break;
        case 1: panel_tile(1, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 2: panel_tile(2, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 3: panel_tile(3, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 4: panel_tile(4, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 5: panel_tile(5, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 6: panel_tile(6, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 7: panel_tile(7, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 8: panel_tile(8, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 9: panel_tile(9, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        case 10: panel_tile(10, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        default: panel_tile(11, P, K, x, ldx, r0, n0, nc, y, ldy, bias, res, ldr); break;
        }
    }
    return failed ? -1 : 0;
}
