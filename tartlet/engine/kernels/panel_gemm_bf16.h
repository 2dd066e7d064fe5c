/* The panel GEMM of panel_gemm_avx512.h with bfloat16 products (AVX512_BF16
 * vdpbf16ps: 32 multiply-adds per instruction where a float32 FMA does 16;
 * measured on this project's Sapphire Rapids VM, one core, 12 independent
 * chains: 115 G multiply-adds/s against 56 G for float32 FMAs).
 *
 * Same method and panel as the float32 route: a thread dequantizes 32 weight
 * rows into its panel as bfloat16 pairs ([K/2][32] 32-bit lanes, lane j of
 * pair i = (W[j, 2i], W[j, 2i+1]), each the float32 value rounded to
 * nearest even: panel_fill16 writes them so for the block kinds; float16 /
 * bfloat16 weights are filled as float32, then rounded in place by
 * panel_round_bf16), and every activation
 * row, rounded to bfloat16 once per call (panel_x_bf16), passes it in tiles
 * of PANEL_MR rows: per pair of k, two weight loads, one 32-bit broadcast of
 * (x[r, 2i], x[r, 2i+1]) per row and two vdpbf16ps per row.
 *
 * Precision: products of bfloat16 values (8 significant bits each) are exact
 * in float32 and accumulate in float32 (Intel SDM, VDPBF16PS: two products
 * added to the accumulator per lane, round to nearest even, denormal inputs
 * and outputs flushed to zero), so each output equals, within float32
 * summation error, the product of the bfloat16-rounded x and W. Each output
 * is one chain over the pairs in order, from 0.0, then bias and residual:
 * as on the float32 route, a row's result does not depend on M, its tile,
 * its panel or the thread split.
 *
 * Included by panel_gemm_avx512.h before its driver panel_gemm (xb not
 * NULL: this route), inside the "#pragma GCC target" region that lists
 * avx512bf16; run only where the CPU has it (tq_has_bf16). */

/* Round rows of x [M, K] float32 (row stride ldx) to bfloat16 [M, K] (K even;
 * round to nearest even, as vcvtne2ps2bf16). */
static void panel_x_bf16(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * ldx;
        uint16_t *o = xb + r * K;
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t n = K - k < 32 ? K - k : 32;
            const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
            const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, xr + k + 16), _mm512_maskz_loadu_ps(m0, xr + k));
            _mm512_mask_storeu_epi16(o + k, n >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << n) - 1u), (__m512i)v);
        }
    }
}

/* Round the float32 panel P [K][PANEL_N] (K even) in place into bfloat16
 * pairs [K/2][PANEL_N] of 32-bit lanes. Pair i is written to bytes
 * [128 i, 128 i + 128) after rows 2i and 2i + 1 (bytes [256 i, 256 i +
 * 256)) are read: never over a row not yet read. */
INLINE void panel_round_bf16(float *P, int64_t K) {
    uint32_t *P2 = (uint32_t *)P;
    for (int64_t i = 0; i < K / 2; i++) {
        const float *a = P + 2 * i * PANEL_N, *b = a + PANEL_N;
        const __m512i v0 = bf16_pairs(_mm512_load_ps(a), _mm512_load_ps(b));
        const __m512i v1 = bf16_pairs(_mm512_load_ps(a + 16), _mm512_load_ps(b + 16));
        _mm512_store_si512(P2 + i * PANEL_N, v0);
        _mm512_store_si512(P2 + i * PANEL_N + 16, v1);
    }
}

/* y rows r0 .. r0 + R - 1, columns n0 .. n0 + nc - 1 (nc <= 32) from the
 * bfloat16 panel P2 [K/2][PANEL_N] and bfloat16 rows xb [M, K]. */
INLINE void panel_tile_bf16(const int R, const uint32_t *P2, int64_t K, const uint16_t *xb, int64_t r0, int64_t n0,
                            int64_t nc, float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    __m512 acc[PANEL_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *xr = (const uint32_t *)(xb + r0 * K);
    const int64_t K2 = K / 2;
    for (int64_t i = 0; i < K2; i++) {
        const __m512bh w0 = (__m512bh)_mm512_load_si512(P2 + i * PANEL_N);
        const __m512bh w1 = (__m512bh)_mm512_load_si512(P2 + i * PANEL_N + 16);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[r * K2 + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
    }
    panel_store(R, acc, r0, n0, nc, y, ldy, bias, res, ldr);
}
