/* Load-time repacking of quant_kernels.c: GGUF blocks into the kernel kinds
 * (tq_repack_gguf), and a kind's rows interleaved by 16 (tq_interleave).
 *
 * The same bytes as quant_formats.py's numpy functions (_repack/_pack and
 * interleave), which stay as the reference the tests compare these with bit
 * for bit; here each output byte is written once, without numpy's
 * temporaries, and threads split the blocks: Engine.load of a 4.2 GB Q4_K_M
 * took 81 s with numpy's and 16-21 s with these (2 cores; docs/benchmarks.md,
 * "A 7B model", with the other loader changes of that section).
 *
 * GGUF block layouts (ggml-common.h; quant_formats.py's table):
 *   Q8_0  34 B: f16 d, int8 qs[32]
 *   Q4_0  18 B: f16 d, qs[16] (byte j: element j low nibble, j + 16 high)
 *   Q4_1  20 B: f16 d, f16 m, qs[16]
 *   Q5_0  22 B: f16 d, qh[4] (little-endian uint32, bit j: bit 4 of element j), qs[16]
 *   Q5_1  24 B: f16 d, f16 m, qh[4], qs[16]
 *   Q4_K 144 B: f16 d, f16 dmin, scales[12] (8 six-bit scales and minimums,
 *               ggml's get_scale_min_k4), qs[128] (32-byte chunk c: sub-block
 *               2c in the low nibbles, 2c + 1 in the high ones)
 *   Q5_K 176 B: Q4_K's d, dmin, scales, then qh[32] (bit i of byte l: bit 4 of
 *               element l of sub-block i), qs[128]
 *   Q6_K 210 B: ql[128], qh[64], int8 scales[16] (one per 16 values), f16 d
 * Kernel kinds: quant_kernels.c's header comment. */

/* GGUF types tq_repack_gguf reads (quant_kernels.py's REPACK_TYPES). */
enum { G_Q8_0 = 0, G_Q4_0 = 1, G_Q4_1 = 2, G_Q5_0 = 3, G_Q5_1 = 4, G_Q4_K = 5, G_Q5_K = 6, G_Q6_K = 7 };

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* One block of 32 unsigned values v[32] into kind `kind` at q (QBYTES[kind]
 * bytes): Q8 as is; else the low nibbles of v[j] and v[j + 16] in byte j,
 * then Q5's 4 bytes (bit i of byte j: bit 4 of v[4 i + j]) or Q6's 8 (bits
 * 2k, 2k + 1 of byte j: bits 4, 5 of v[8 k + j]). */
static inline void pack_block(int kind, const uint8_t *v, uint8_t *q) {
    if (kind == K_Q8) {
        memcpy(q, v, 32);
        return;
    }
    for (int j = 0; j < 16; j++)
        q[j] = (uint8_t)((v[j] & 0x0F) | (v[j + 16] & 0x0F) << 4);
    if (kind == K_Q5)
        for (int j = 0; j < 4; j++) {
            uint8_t b = 0;
            for (int i = 0; i < 8; i++)
                b |= (uint8_t)(((v[4 * i + j] >> 4) & 1) << i);
            q[16 + j] = b;
        }
    else if (kind == K_Q6)
        for (int j = 0; j < 8; j++) {
            uint8_t b = 0;
            for (int k = 0; k < 4; k++)
                b |= (uint8_t)(((v[8 * k + j] >> 4) & 3) << (2 * k));
            q[16 + j] = b;
        }
}

/* Repack n_blocks GGUF blocks of `type` (G_*) at src into kind Q8 (Q8_0),
 * Q4 (Q4_0, Q4_1, Q4_K), Q5 (Q5_0, Q5_1, Q5_K) or Q6 (Q6_K): per 32 weights
 * QBYTES[kind] bytes at q, float16 scales at d (Q6: two, one per 16
 * weights) and minimums at m (Q4, Q5; NULL for Q8, Q6). K-quant blocks hold
 * 256 weights (8 blocks of 32 out); their sub-block scale d * sc and minimum
 * -dmin * mn are products in float32 (exact) rounded once to float16, to
 * nearest even. Returns 0, or -1 for an unknown type. */
int tq_repack_gguf(int type, const uint8_t *src, int64_t n_blocks, uint8_t *q, uint16_t *d, uint16_t *m) {
    static const int SIZE[8] = {34, 18, 20, 22, 24, 144, 176, 210};
    if (type < 0 || type > G_Q6_K) return -1;
    const int kind = type == G_Q8_0 ? K_Q8 : type == G_Q6_K ? K_Q6 : (type == G_Q5_0 || type == G_Q5_1 || type == G_Q5_K) ? K_Q5 : K_Q4;
    const int size = SIZE[type], per = type >= G_Q4_K ? 8 : 1, qb = QBYTES[kind]; /* blocks of 32 per GGUF block */
#pragma omp parallel for if (n_blocks * size >= (1 << 20)) schedule(static)
    for (int64_t i = 0; i < n_blocks; i++) {
        const uint8_t *b = src + i * size;
        uint8_t v[32];
        const int64_t o = i * per; /* first output block */
        if (type <= G_Q5_1) {
            const uint16_t hd = rd16(b);
            const float df = half_to_float(hd);
            const uint8_t *qs = b + size - 16;
            if (type == G_Q8_0) {
                for (int j = 0; j < 32; j++) v[j] = b[2 + j] ^ 0x80;
            } else {
                for (int j = 0; j < 16; j++) {
                    v[j] = qs[j] & 0x0F;
                    v[j + 16] = qs[j] >> 4;
                }
            }
            if (type == G_Q5_0 || type == G_Q5_1) {
                const uint8_t *qh = b + (type == G_Q5_0 ? 2 : 4);
                const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
                for (int j = 0; j < 32; j++) v[j] |= (uint8_t)(((h >> j) & 1) << 4);
            }
            pack_block(kind, v, q + o * qb);
            d[o] = hd;
            if (type == G_Q4_0) m[o] = float_to_half(-8.0f * df);
            else if (type == G_Q5_0) m[o] = float_to_half(-16.0f * df);
            else if (type == G_Q4_1 || type == G_Q5_1) m[o] = rd16(b + 2);
            continue;
        }
        if (type == G_Q6_K) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float df = half_to_float(rd16(b + 208));
            for (int s = 0; s < 8; s++) { /* element e = 32 s + l = 128 h + 32 k + l */
                const int h = s >> 2, k = s & 3;
                for (int l = 0; l < 32; l++) {
                    const uint8_t lo = (ql[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0x0F;
                    const uint8_t hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    v[l] = (uint8_t)(lo | hi << 4);
                }
                pack_block(K_Q6, v, q + (o + s) * qb);
            }
            for (int j = 0; j < 16; j++) d[o * 2 + j] = float_to_half(df * (float)sc[j]);
            continue;
        }
        /* Q4_K, Q5_K */
        const float df = half_to_float(rd16(b)), dmin = half_to_float(rd16(b + 2));
        const uint8_t *s12 = b + 4, *qh = b + 16, *qs = b + (type == G_Q5_K ? 48 : 16);
        for (int s = 0; s < 8; s++) {
            uint8_t sc, mn; /* ggml's get_scale_min_k4 */
            if (s < 4) {
                sc = s12[s] & 63;
                mn = s12[s + 4] & 63;
            } else {
                sc = (uint8_t)((s12[s + 4] & 0x0F) | (s12[s - 4] >> 6) << 4);
                mn = (uint8_t)((s12[s + 4] >> 4) | (s12[s] >> 6) << 4);
            }
            const uint8_t *c = qs + 32 * (s >> 1);
            const int shift = 4 * (s & 1);
            for (int l = 0; l < 32; l++) {
                v[l] = (c[l] >> shift) & 0x0F;
                if (type == G_Q5_K) v[l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
            }
            pack_block(kind, v, q + (o + s) * qb);
            d[o + s] = float_to_half(df * (float)sc);
            m[o + s] = float_to_half(-dmin * (float)mn);
        }
    }
    return 0;
}

/* Interleave a kind-`kind` matrix (Q8, Q4, Q5 or Q6) of n rows (a multiple
 * of 16) and nb blocks a row into its interleaved kind (Q8I, Q4I, Q5I, Q6I;
 * quant_formats.interleave documents the layout): values q [n, nb QB] into
 * qo, the ns scales a block d [n, nb ns] into dout and minimums m (or NULL)
 * into mout, [g, nb, ns, 16] per group of 16 rows. */
void tq_interleave(int kind, int64_t n, int64_t nb, const uint8_t *q, const uint16_t *d, const uint16_t *m, uint8_t *qo,
                   uint16_t *dout, uint16_t *mout) {
    const int qb = QBYTES[kind], ns = NSCALES(kind);
    const int64_t g_n = n / 16;
#pragma omp parallel for if (n * nb >= 4096) schedule(static)
    for (int64_t g = 0; g < g_n; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = qo + (g * nb + b) * 16 * qb;
            for (int L = 0; L < 16; L++) {
                const int64_t row = 16 * g + L;
                const uint8_t *s = q + (row * nb + b) * qb;
                if (kind == K_Q8) { /* vector t: values 4 t + e as signed bytes */
                    for (int t = 0; t < 8; t++)
                        for (int e = 0; e < 4; e++) o[t * 64 + L * 4 + e] = s[4 * t + e] ^ 0x80;
                } else { /* vector c: low nibbles values 8 c + e, high nibbles 8 c + 4 + e */
                    uint8_t v[32];
                    for (int j = 0; j < 16; j++) {
                        v[j] = s[j] & 0x0F;
                        v[j + 16] = s[j] >> 4;
                    }
                    for (int c = 0; c < 4; c++)
                        for (int e = 0; e < 4; e++) o[c * 64 + L * 4 + e] = (uint8_t)(v[8 * c + e] | v[8 * c + 4 + e] << 4);
                    for (int h = 0; h < (qb - 16) / 4; h++) /* then Q5's 4, Q6's 8 bytes of high bits, 4 a vector */
                        for (int e = 0; e < 4; e++) o[256 + h * 64 + L * 4 + e] = s[16 + 4 * h + e];
                }
                for (int si = 0; si < ns; si++) {
                    const int64_t at = ((g * nb + b) * ns + si) * 16 + L;
                    dout[at] = d[row * nb * ns + b * ns + si];
                    if (m) mout[at] = m[row * nb * ns + b * ns + si];
                }
            }
        }
}
