/* Integer kernel for weights interleaved by 16 rows (kinds K_Q4I, K_Q5I,
 * K_Q6I and K_Q8I, made at load by quant_formats.interleave from kinds Q4,
 * Q5, Q6, Q8):
 * y = x @ W^T (+ bias) (+ res) with x quantized to 16-bit or 8-bit blocks
 * (tq_quantize, bits 16 or 8), for any number of activation rows. Included after
 * quant_kernels_avx512.h, inside the same "#pragma GCC target" region.
 *
 * Layout. Rows come in groups of 16; a group's blocks follow each other
 * (block b of group g at byte (g nb + b) QB of q, QB = 256 for Q4I, 320 for
 * Q5I, 384 for Q6I and 512 for Q8I; its 16 scales, and for Q4I and Q5I 16
 * minimums, at float16 index (g nb + b) 16 of d and m; Q6I's 2 x 16, one
 * per half block, at (g nb + b) 32). A block is 64-byte vectors
 * holding, in lane L (row 16 g + L), 4 consecutive values of that row's
 * block as vpdpbusd wants them: Q4I, four vectors, vector c's lane holds
 * values 8 c + e in its low nibbles and 8 c + 4 + e in its high ones
 * (e = 0..3; one AND and a shift unpack them); Q5I, the same four vectors
 * of the values' low 4 bits, then one whose lane holds the row's 4 bytes
 * of high bits as the Q5 kind stores them (bit t of byte e: bit 4 of value
 * 4 t + e; one shift and one vpternlogd move them into the nibbles' bit
 * 4); Q6I, the same four vectors, then two whose lanes hold the row's 8
 * bytes of high bit pairs as the Q6 kind stores them (bytes 0-3, then 4-7;
 * bits 2k, 2k + 1 of byte j: bits 4, 5 of value 8 k + j; one shift and one
 * vpternlogd per vector); Q8I, eight vectors, vector t's lane holds values
 * 4 t + e as signed bytes (the value q - 128 of the Q8 kind).
 *
 * Method. The 16 rows of a group are the 16 lanes of one accumulator, so no
 * row needs a horizontal sum and the unpacked weights of a block serve every
 * activation row (the layout of llama.cpp's repacked "q4_0_8x8" GEMV/GEMM,
 * here with 16 rows and 16-bit activations). A 16-bit activation
 * a = 256 hi + lo (lo unsigned, hi signed bytes, split once per call) meets
 * the weights in two vpdpbusd per 4 values (the byte split of
 * quant_kernels_avx512.h): Q4I's q (0..15, Q5I's 0..31, Q6I's 0..63) as the unsigned
 * operand against a broadcast of 4 hi bytes and as the signed one against
 * 4 lo bytes; Q8I's
 * signed s against broadcasts of lo and of hi + 128 (unsigned), then
 * s . hi = s . (hi + 128) - 128 sum(s), sum(s) from one more vpdpbusd per 4
 * values shared by every row. 8-bit activations a (signed bytes, as
 * tq_quantize stores them) take one vpdpbusd per 4 values: Q4I's, Q5I's and
 * Q6I's q unsigned against a broadcast of 4 bytes of a; Q8I's q = s + 128
 * (one XOR per weight vector, shared by every row) against a, then
 * s . a = q . a - 128 sum(a), 128 sum(a) per row and block computed once
 * per call with the pass layout (below; once per phase of the fused step).
 * A block's int32 dot product is exact; per output then
 *
 *   acc = fma(dot_b, d_w[b] * d_x[b], acc)  (+ Q4I, Q5I: acc = fma(m_w[b], s_x[b], acc))
 *
 * (Q6I, per half h of the block, its own dot and scale, m = -32 d:
 * acc = fma(d_w[b, h], fma(dot_bh, d_x[b], -32 s_x[b, h]), acc), s_x[b, h]
 * the half's scale times sum, FA's third plane)
 * for b = 0 .. nb - 1 in order (d_x, s_x: the activation block's scale and
 * scale times sum, FA planes; the float conversion of dot_b is exact for
 * Q4I, |dot| < 2^24, and rounds to nearest for Q5I, Q6I and Q8I), then acc +
 * bias, + res.
 * This is the same arithmetic for every output whatever else shares the
 * call, so a row's result does not depend on M, on the row tile it falls in
 * or on the thread split; matmul_il_c (quant_kernels.c) computes the same
 * values bit for bit.
 *
 * Speed (benchmarks/bench_quant_kernels.py: 2-vCPU Zen 4 VM, one thread,
 * weights hot in L2, Q4_1 1536 x 576): 52.5 G multiply-adds/s at one row
 * against 17.5 for the row-at-a-time kernel (one16_row), 83 at 8 rows
 * against ~40-47 for the float32 panel GEMM; see docs/benchmarks.md. With
 * 8-bit activations (2-vCPU Intel Xeon VM, shared, two runs alternating
 * with 16-bit ones): 137-151 at 8 rows and 129-152 at 64, 1.5-2.1x the
 * 16-bit kernel, 4-6x the 8-bit row-at-a-time kernel (tile_avx512); about
 * 1x-1.2x the 16-bit kernel at one row, where unpacking and scaling each
 * block weigh more than its products. */

#define IL_ROWS 16
/* activation rows one pass over a group's blocks serves (accumulators in registers) */
#define IL_MR 8
/* rows of a wide pass (il_wide: 8-bit activations against Q4I and Q8I, whose unpacking is
 * cheap, and against Q5I and Q6I beyond their row tiles (IL_TILE_MAX)): 16 accumulators in
 * registers, so each unpacked block serves twice the rows. Measured paired against passes of
 * IL_MR (bench_quant_kernels.py --against, 4096 x 4096, one thread, Xeon VM): Q4_K 0.91-0.97x
 * the time and Q8_0 0.87-0.96x at 16-256 rows, Q5_K 0.84-0.86x and Q6_K 0.89-0.91x at
 * 129-512; Q6_K in place of its row tile 0.94-1.06x at 16-64 rows, so the tiles stay; with
 * 16-bit activations (four chains a row) 0.95-1.03x, so they keep IL_MR. Only full wide
 * passes take them (one instance more per kind): the rows left run in passes of IL_MR, since
 * an instance per row count 1-16 made the kernel library's gcc -O3 compile 50 s -> 133 s. */
#define IL_MR_WIDE 16
#define il_wide(kind, A8, M) ((A8) && ((kind) == K_Q4I || (kind) == K_Q8I || (M) > IL_TILE_MAX))
/* bytes of values prefetched ahead: on a 2-vCPU Zen 4 VM two threads
 * streaming 55 MB of Q4I reached 25.9 GB/s without, 34.7 with 2 KiB ahead,
 * 37.0 with 4 KiB */
#define IL_PF 4096

/* Prefetch for a weight stream read once (one pass: decode batches of up
 * to IL_MR rows, IL_MR_WIDE for il_wide kinds) or again by later passes. Read once: Q8I lines are
 * prefetched into L2 (PREFETCHT1), the other kinds' non-temporally
 * (PREFETCHNTA), both measured in one process alternating
 * (docs/benchmarks.md). With NTA the default model's 30 MB Q8I LM head
 * streamed at ~24 GB/s in the batch-1 step, with T1 at ~32 (1.27 -> 0.93
 * ms, the step 0.91x the time; its Q4I phases unchanged; a 7B model all in
 * Q8_0: the step 0.79x), most likely because a prefetch that fills L1
 * holds one of the core's few L1 miss buffers until its line arrives, and
 * Q8I, with the most bytes per multiply-add, needs the most lines in
 * flight. T1 on every kind made the 7B Q4_K_M model's step (Q4I, Q6I)
 * 1.046-1.048x slower. NTA had replaced T0 so that a step would stop
 * evicting the Python between steps from L2. Read again (prefill, larger
 * decode batches), T0 keeps the lines in L1 for the next tile. Those were
 * measurements on a Zen 4 VM; on an Intel Xeon VM (family 6 model 207) T0
 * for every stream ran the batch-1 step in 0.77x the time (default model)
 * and 0.69x (7B Q4_K_M), and single 1-8-row calls on 7B-sized weights in
 * 0.54-0.81x, so il_stream_nta (quant_kernels.c) is 0 there: the loader
 * picks by CPU vendor (quant_kernels.stream_prefetch_nta). */
#define IL_PREFETCH(p, once, kind)                                             \
    do {                                                                       \
        if (!(once) || !il_stream_nta) _mm_prefetch((const char *)(p), _MM_HINT_T0); \
        else if ((kind) == K_Q8I) _mm_prefetch((const char *)(p), _MM_HINT_T1); \
        else _mm_prefetch((const char *)(p), _MM_HINT_NTA);                    \
    } while (0)

/* Bytes of a block of 16 rows. */
#define IL_QB(kind) ((kind) == K_Q4I ? 256 : (kind) == K_Q5I ? 320 : (kind) == K_Q6I ? 384 : 512)
/* Whether the kind has stored minimums (Q6I's are -32 d, Q8I has none). */
#define IL_HAS_MIN(kind) ((kind) == K_Q4I || (kind) == K_Q5I)

/* The pass layout of the activations (made once a call, or once a phase of the fused step, by
 * il_matmul_avx512): rows in passes (il_pass: of IL_MR_WIDE or IL_MR rows), a pass's blocks
 * one after the other, and in block b of a pass of R rows its rows' values one
 * after the other: 8-bit, row r's QK signed bytes at b R IL_VB + r QK; 16-bit, its low bytes
 * there and its high bytes (+ 128 for Q8I) R QK further on. Beside them, per pass, block and
 * row, IL_NF(kind) float meta fields, field j of row r at b IL_NF R + j R + r: d_x (the
 * block's scale), then s_x (Q4I, Q5I: scale times sum), Q8I at 8 bits 128 sum(a) as int32,
 * Q6I the halves' -32 s_x in two fields. So the R rows of a pass read their values and
 * scales at fixed offsets from two pointers that step by a constant a block, one stream each.
 * With rows K bytes apart and the scales in each row's FA planes (before 2026-12-02) GCC kept
 * a pointer per row and stream, and reloaded 15 of them a block from the stack and from
 * vector registers (8-row Q4I pass, 8-bit). Paired against that (bench_quant_kernels.py
 * --against, 4096 x 4096, one thread): 0.89-0.93x the time at 8-256 rows for Q4_K and Q8_0,
 * 8- and 16-bit, 0.90-0.98x for Q5I's and Q6I's row tiles, 0.91-1.0x at one row. */
#define IL_VB(A8) ((A8) ? QK : 2 * QK)
#define IL_NF(kind) ((kind) == K_Q6I ? 3 : 2)

/* The pass holding row r of M in the pass layout: returns its row count and sets *r0 to its
 * first row. Wide kinds (il_wide, `wide`) take passes of IL_MR_WIDE rows while that many are
 * left, then every kind passes of IL_MR (the last: the rows left). A pass of R rows at r0
 * starts r0 nb IL_VB bytes into the values and r0 nb IL_NF fields into the meta. */
INLINE int64_t il_pass(const int wide, const int64_t M, const int64_t r, int64_t *r0) {
    const int64_t f = wide ? M - M % IL_MR_WIDE : 0; /* rows in full wide passes */
    if (r < f) {
        *r0 = r - r % IL_MR_WIDE;
        return IL_MR_WIDE;
    }
    *r0 = r - (r - f) % IL_MR;
    return M - *r0 < IL_MR ? M - *r0 : IL_MR;
}

/* Block b's 16 x 32 values of a group as 8 vectors, w[t] = values 4t..4t+3 of each row. */
INLINE void il_unpack(const int kind, const uint8_t *q, __m512i w[8]) {
    if (kind == K_Q8I) {
        /* the empty asm keeps each vector in a register: GCC would otherwise fold
         * the load into every vpdpbusd that reads it (3 loads of 64 bytes per
         * vector at one activation row, 1.15-1.5x slower there) */
        for (int t = 0; t < 8; t++) {
            w[t] = _mm512_loadu_si512((const void *)(q + 64 * t));
            __asm__("" : "+v"(w[t]));
        }
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * c));
        w[2 * c] = _mm512_and_si512(v, m4);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if (kind == K_Q5I) { /* bit t of each lane byte e -> bit 4 of w[t]'s byte e (value 4 t + e) */
        const __m512i hb = _mm512_loadu_si512((const void *)(q + 256)), b4 = _mm512_set1_epi8(0x10);
        for (int t = 0; t < 8; t++) {
            /* 16-bit shifts: what crosses from the neighbouring byte lands outside bit 4 */
            const __m512i s = t < 4 ? _mm512_slli_epi16(hb, 4 - t) : t > 4 ? _mm512_srli_epi16(hb, t - 4) : hb;
            w[t] = _mm512_ternarylogic_epi32(s, b4, w[t], 0xEA); /* (s & b4) | w[t] */
        }
    } else if (kind == K_Q6I) { /* bits 2k, 2k + 1 of byte e of vector t % 2 (k = t / 2) -> bits 4, 5 of w[t]'s byte e */
        const __m512i hb[2] = {_mm512_loadu_si512((const void *)(q + 256)), _mm512_loadu_si512((const void *)(q + 320))};
        const __m512i b45 = _mm512_set1_epi8(0x30);
        for (int t = 0; t < 8; t++) {
            const int k = t / 2;
            const __m512i v = hb[t & 1];
            const __m512i s = k < 2 ? _mm512_slli_epi16(v, 4 - 2 * k) : k > 2 ? _mm512_srli_epi16(v, 2) : v;
            w[t] = _mm512_ternarylogic_epi32(s, b45, w[t], 0xEA); /* (s & b45) | w[t] */
        }
    }
}

/* A block's contribution to one activation row's accumulator (the header's
 * formula). Q6I, per half (dot0, dot1; c0, c1: the halves' -32 s_x, from the
 * pass's meta fields): acc + d_w (d_x dot - 32 s_x) twice. The other kinds (dot: the
 * block's int32 dot product; sx: the activation block's scale times sum,
 * used for Q4I and Q5I only): acc + dot d_w d_x (+ m_w s_x). */
INLINE __m512 il_acc_q6(__m512 acc, __m512 dw, __m512 dw1, __m512i dot0, __m512i dot1, float dx, float c0, float c1) {
    acc = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_set1_ps(dx), _mm512_set1_ps(c0)), acc);
    return _mm512_fmadd_ps(dw1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_set1_ps(dx), _mm512_set1_ps(c1)), acc);
}

INLINE __m512 il_acc(const int kind, __m512 acc, __m512i dot, __m512 dw, __m512 mw, float dx, float sx) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc);
    if (IL_HAS_MIN(kind)) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc);
    return acc;
}

/* One activation row against block w (il_unpack's vectors; Q8I's XORed at 8 bits): the int32
 * dot products, Q6I's per half in d[0], d[1], the other kinds' whole block in d[0] (Q8I's
 * before its correction). 8-bit (A8): a = l's signed bytes, one vpdpbusd per 4 values, q
 * unsigned against 4 broadcast bytes of a, in two chains, values 0-15 and 16-31: the rows of
 * a pass give the ports enough independent chains, and each chain saved saves an add
 * (measured paired: one chain, Q4I, 1.04-1.15x the time; four 0.97-1.06x). 16-bit: a = 256 h
 * + l, four chains, values 0-15 (h0, l0) and 16-31 (h1, l1); Q4I, Q5I, Q6I: h against q
 * unsigned, l unsigned against q signed; Q8I: l and h + 128 unsigned against s signed. Two
 * chains for the kinds other than Q6I (two adds fewer) ran 1.10-1.15x the time at 16 and 64
 * rows (paired, bench_quant_kernels --against, Q4_1 and Q8_0). */
INLINE void il_dots(const int kind, const int A8, const __m512i w[8], const int32_t *l, const int32_t *h,
                    __m512i d[2]) {
    if (A8) {
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(l[0]));
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(l[4]));
        for (int t = 1; t < 4; t++) {
            d0 = _mm512_dpbusd_epi32(d0, w[t], _mm512_set1_epi32(l[t]));
            d1 = _mm512_dpbusd_epi32(d1, w[t + 4], _mm512_set1_epi32(l[t + 4]));
        }
        d[0] = kind == K_Q6I ? d0 : _mm512_add_epi32(d0, d1), d[1] = d1;
        return;
    }
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int t = 0; t < 4; t++) {
        if (kind != K_Q8I) {
            h0 = _mm512_dpbusd_epi32(h0, w[t], _mm512_set1_epi32(h[t]));
            h1 = _mm512_dpbusd_epi32(h1, w[t + 4], _mm512_set1_epi32(h[t + 4]));
        } else {
            h0 = _mm512_dpbusd_epi32(h0, _mm512_set1_epi32(h[t]), w[t]);
            h1 = _mm512_dpbusd_epi32(h1, _mm512_set1_epi32(h[t + 4]), w[t + 4]);
        }
        l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(l[t]), w[t]);
        l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(l[t + 4]), w[t + 4]);
    }
    if (kind == K_Q6I) {
        d[0] = _mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0), d[1] = _mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1);
    } else {
        d[0] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
    }
}

/* Row r of a pass of R rows (pass layout: block b's values ab, its meta fields mb) against
 * block w (il_unpack's; scales dw, Q6I's second half's dw1, minimums mw; corr: 16-bit Q8I's
 * shared correction): acc plus the block's contribution (il_acc, il_acc_q6). */
INLINE __m512 il_row(const int kind, const int A8, const int R, const int r, const __m512i w[8], const uint8_t *ab,
                     const float *mb, __m512 dw, __m512 dw1, __m512 mw, __m512i corr, __m512 acc) {
    __m512i d[2];
    il_dots(kind, A8, w, (const int32_t *)(ab + r * QK), A8 ? 0 : (const int32_t *)(ab + (R + r) * QK), d);
    const float dx = mb[r];
    if (kind == K_Q6I) /* per half, m = -32 d */
        return il_acc_q6(acc, dw, dw1, d[0], d[1], dx, mb[R + r], mb[2 * R + r]);
    __m512i dot = d[0];
    if (kind == K_Q8I) /* 8-bit: - 128 sum(a) of this row's block; 16-bit: the shared correction */
        dot = _mm512_sub_epi32(dot, A8 ? _mm512_set1_epi32(((const int32_t *)mb)[R + r]) : corr);
    return il_acc(kind, acc, dot, dw, mw, dx, IL_HAS_MIN(kind) ? mb[R + r] : 0.0f);
}

/* One group (16 weight rows: values wq, scales wd, minimums wm (Q4I, Q5I),
 * nb blocks; once: no later row tile reads them, see IL_PREFETCH) times the
 * R activation rows of one pass in the pass layout (il_matmul_avx512: values
 * a, meta fields mt) into y [R, 16] (row stride ldy), bias [16] and res
 * [R, 16] (row stride ldr) added when not NULL. */
INLINE void il_group(const int kind, const int A8, const int R, const int once, const uint8_t *wq, const uint16_t *wd,
                     const uint16_t *wm, int64_t nb, const uint8_t *a, const float *mt, float *y, int64_t ldy,
                     const float *bias, const float *res, int64_t ldr) {
    const int qb = IL_QB(kind), ns = NSCALES(kind), vb = IL_VB(A8), nf = IL_NF(kind);
    __m512 acc[IL_MR_WIDE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = wq + b * qb;
        for (int o = 0; o < qb; o += 64) IL_PREFETCH(q + IL_PF + o, once, kind);
        IL_PREFETCH(wd + (b + IL_PF / qb) * 16 * ns, once, kind);
        if (IL_HAS_MIN(kind)) IL_PREFETCH(wm + (b + IL_PF / qb) * 16, once, kind);
        __m512i w[8];
        il_unpack(kind, q, w);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + b * 16 * ns)));
        __m512 mw = _mm512_setzero_ps(), dw1 = _mm512_setzero_ps();
        __m512i corr = _mm512_setzero_si512();
        if (IL_HAS_MIN(kind)) {
            mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + b * 16)));
        } else if (kind == K_Q6I) { /* the second half's scales */
            dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + b * 32 + 16)));
        } else if (A8) { /* Q8I, 8-bit: the unsigned q = s + 128 against a, then - 128 sum(a) per row */
            for (int t = 0; t < 8; t++) w[t] = _mm512_xor_si512(w[t], _mm512_set1_epi8((char)0x80));
        } else { /* Q8I: 32768 sum(s), 256 times the 128 sum(s) that hi + 128 adds */
            const __m512i ones = _mm512_set1_epi8(1);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[0]);
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[1]);
            for (int t = 2; t < 8; t += 2) {
                s0 = _mm512_dpbusd_epi32(s0, ones, w[t]);
                s1 = _mm512_dpbusd_epi32(s1, ones, w[t + 1]);
            }
            corr = _mm512_slli_epi32(_mm512_add_epi32(s0, s1), 15);
        }
        const uint8_t *ab = a + b * R * vb; /* the pass's block b: row r's values at ab + r QK */
        const float *mb = mt + b * nf * R;   /* its meta: field j of row r at mb[j R + r] */
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = il_row(kind, A8, R, r, w, ab, mb, dw, dw1, mw, corr, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        __m512 v = acc[r];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        if (res) v = _mm512_add_ps(v, _mm512_loadu_ps(res + r * ldr));
        _mm512_storeu_ps(y + r * ldy, v);
    }
}

/* One pass of P rows (pass layout: values a, meta mt) against block b (il_unpack's w, scales
 * dw, dw1, minimums mw) into il_group_tile's accumulators acc [P, 16]. */
INLINE void il_tile_pass(const int kind, const int A8, const int P, const __m512i w[8], __m512 dw, __m512 dw1,
                         __m512 mw, int64_t b, const uint8_t *a, const float *mt, float *acc) {
    const uint8_t *ab = a + b * P * IL_VB(A8);
    const float *mb = mt + b * IL_NF(kind) * P;
#pragma GCC unroll 2
    for (int r = 0; r < P; r++)
        _mm512_store_ps(acc + 16 * r, il_row(kind, A8, P, r, w, ab, mb, dw, dw1, mw, _mm512_setzero_si512(),
                                             _mm512_load_ps(acc + 16 * r)));
}

/* Activation rows one unpacked block serves in il_group_tile (accumulators in an L1 tile), and
 * the most rows of a call that takes it. Measured (paired, Q5I and Q6I, 8- and 16-bit
 * activations, 512 x 4096 and 4096 x 4096): 32-row tiles beat 64-row ones at 32-128 rows, and
 * at 200-512 rows (prefill) tiles of either size ran up to 1.2x il_group's time, whose passes
 * of IL_MR rows read 8 activation streams, not 32 or 64. */
#define IL_MT 32
#define IL_TILE_MAX 128

/* il_group for R <= IL_MT rows (calls of IL_MR + 1 .. IL_TILE_MAX rows, Q5I and Q6I; 8-bit
 * activations, A8, or 16-bit ones): each block of the group is unpacked once for all R rows,
 * which run one after the other with their accumulators in acc [R, 16] (stack, L1) instead
 * of registers; the arithmetic and its order per output are il_group's. il_group unpacks
 * each block once per pass of IL_MR rows, and Q5I's and Q6I's unpacking (high bits: a shift
 * and a vpternlogd per vector) is dear. Weights are prefetched into L1 (IL_PREFETCH, T0) whatever
 * the row count: non-temporal prefetches, right for a batch-1 stream, made 16-32-row calls on
 * weights streamed from memory 1.1-1.3x slower. Measured in one process, paired calls
 * alternating with il_group's (bench_quant_kernels.py --against): 0.82-0.93x the time with
 * 8-bit activations, 0.93-1.01x with 16-bit ones (four chains a row), at 16-128 rows; Q4I and Q8I, whose
 * unpacking is cheap, ran 0.95-1.03x at 16-64 rows and up to 1.3x at 128-512, so they keep
 * il_group (docs/benchmarks.md, "Paired comparisons"). */
INLINE void il_group_tile(const int kind, const int A8, const int R, const uint8_t *wq, const uint16_t *wd,
                          const uint16_t *wm, int64_t nb, const uint8_t *a, const float *mt, float *y, int64_t ldy,
                          const float *bias, const float *res, int64_t ldr) {
    const int qb = IL_QB(kind), ns = NSCALES(kind), vb = IL_VB(A8), nf = IL_NF(kind);
    float acc[IL_MT * 16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) _mm512_store_ps(acc + 16 * r, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = wq + b * qb;
        for (int o = 0; o < qb; o += 64) IL_PREFETCH(q + IL_PF + o, 0, kind);
        IL_PREFETCH(wd + (b + IL_PF / qb) * 16 * ns, 0, kind);
        if (IL_HAS_MIN(kind)) IL_PREFETCH(wm + (b + IL_PF / qb) * 16, 0, kind);
        __m512i w[8];
        il_unpack(kind, q, w);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + b * 16 * ns)));
        __m512 mw = _mm512_setzero_ps(), dw1 = _mm512_setzero_ps();
        if (kind == K_Q5I) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + b * 16)));
        else dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + b * 32 + 16)));
        for (int r0 = 0; r0 < R; r0 += IL_MR) { /* the tile's passes: full ones with constant offsets */
            const int P = R - r0 < IL_MR ? R - r0 : IL_MR;
            const uint8_t *pa = a + r0 * nb * vb;
            const float *pm = mt + r0 * nb * nf;
            if (P == IL_MR) il_tile_pass(kind, A8, IL_MR, w, dw, dw1, mw, b, pa, pm, acc + 16 * r0);
            else il_tile_pass(kind, A8, P, w, dw, dw1, mw, b, pa, pm, acc + 16 * r0);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_load_ps(acc + 16 * r);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        if (res) v = _mm512_add_ps(v, _mm512_loadu_ps(res + r * ldr));
        _mm512_storeu_ps(y + r * ldy, v);
    }
}

/* Groups g0 .. g1 - 1 (16 weight rows each) of W [N, K] of an interleaved
 * kind times M activation rows in the pass layout (values a, meta fields mt)
 * into y (row stride ldy), bias and res (row stride ldr) added when not NULL. */
INLINE void il_groups(const int kind, const int A8, int64_t g0, int64_t g1, const uint8_t *wq, const uint16_t *wd,
                      const uint16_t *wm, int64_t nb, const uint8_t *a, const float *mt, int64_t M, float *y,
                      int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    const int64_t vs = nb * IL_VB(A8), ms = nb * IL_NF(kind); /* a row's share of the values, meta */
    const int wide = il_wide(kind, A8, M);
    int64_t first;
    const int once = il_pass(wide, M, 0, &first) == M; /* one pass: each weight is read once */
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n = g * IL_ROWS;
        const uint8_t *q = wq + n * nb * (IL_QB(kind) / IL_ROWS);
        const uint16_t *d = wd + n * nb * NSCALES(kind), *m = wm ? wm + n * nb : 0;
        const float *bb = bias ? bias + n : 0;
        if (M > IL_MR && M <= IL_TILE_MAX && (kind == K_Q5I || kind == K_Q6I)) { /* unpacked once per IL_MT rows */
            for (int64_t r0 = 0; r0 < M; r0 += IL_MT) {
                const int R = (int)(M - r0 < IL_MT ? M - r0 : IL_MT);
                il_group_tile(kind, A8, R, q, d, m, nb, a + r0 * vs, mt + r0 * ms, y + r0 * ldy + n, ldy, bb,
                              res ? res + r0 * ldr + n : 0, ldr);
            }
            continue;
        }
        for (int64_t r0 = 0, P; r0 < M; r0 += P) { /* the pass layout's passes */
            P = il_pass(wide, M, r0, &first);
            const uint8_t *pa = a + r0 * vs;
            const float *pm = mt + r0 * ms, *rr = res ? res + r0 * ldr + n : 0;
            float *o = y + r0 * ldy + n;
#define IL_GROUP(R) il_group(kind, A8, R, once, q, d, m, nb, pa, pm, o, ldy, bb, rr, ldr)
            if (wide && P == IL_MR_WIDE) { /* wide is a constant: no instance for the other kinds */
                IL_GROUP(IL_MR_WIDE);
                continue;
            }
            switch (P) { /* R a constant in each instance */
            case 1: IL_GROUP(1); break;
            case 2: IL_GROUP(2); break;
            case 3: IL_GROUP(3); break;
            case 4: IL_GROUP(4); break;
            case 5: IL_GROUP(5); break;
            case 6: IL_GROUP(6); break;
            case 7: IL_GROUP(7); break;
            default: IL_GROUP(8); break;
            }
#undef IL_GROUP
        }
    }
}

/* y = x @ W^T (+ bias) (+ res) for W of an interleaved kind ([N, K], N a
 * multiple of 16) and M rows of activations qa [M, K] quantized to `bits`
 * (8: int8, 16: int16) with their FA planes fa; returns 0, or -1 (nothing
 * done) when the pass layout's buffer cannot be allocated. */
static int il_matmul_avx512(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                            int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy,
                            const float *bias, const float *res, int64_t ldr) {
    const int64_t nb = K / QK;
    const int q8 = kind == K_Q8I, q6 = kind == K_Q6I, a8 = bits == 8;
    const int vb = IL_VB(a8), nf = IL_NF(kind);
    /* what this thread made earlier in the same phase of the fused step (planes_tag) */
    const int wide = il_wide(kind, a8, M);
    const int reuse = planes_tag && planes_have.tag == planes_tag && planes_have.qa == qa && planes_have.M == M &&
                      planes_have.K == K && planes_have.q8 == q8 && planes_have.q6 == q6 && planes_have.bits == bits &&
                      planes_have.wide == wide;
    /* The pass layout (IL_VB above): values, then the meta fields; one 8-bit row is already in it. */
    const int copy = !a8 || M > 1;
    const size_t vbytes = (size_t)(copy ? M * nb * vb : 0), mbytes = (size_t)(4 * nf * M * nb);
    uint8_t *const buf = reuse ? planes_buf : activation_planes(vbytes + mbytes);
    if (!buf) return -1;
    const uint8_t *const a = copy ? buf : (const uint8_t *)qa;
    float *const mt = (float *)(buf + vbytes);
    /* a = 256 hi + lo (16-bit): low bytes as they are, high bytes by an arithmetic shift (+ 128 for Q8I) */
    const __m256i flip = _mm256_set1_epi8(q8 ? (char)0x80 : 0);
    for (int64_t r = 0; r < M && !reuse; r++) {
        int64_t r0;
        const int64_t R = il_pass(wide, M, r, &r0); /* its pass */
        uint8_t *const pv = buf + r0 * nb * vb + (r - r0) * QK;
        float *const pm = mt + r0 * nb * nf + (r - r0);
        const float *const f = fa + r * FA * nb;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *const v = pv + b * R * vb;
            float *const m = pm + b * nf * R;
            if (!a8) {
                const __m512i x = _mm512_loadu_si512((const void *)((const int16_t *)qa + r * K + b * QK));
                _mm256_store_si256((__m256i *)v, _mm512_cvtepi16_epi8(x));
                _mm256_store_si256((__m256i *)(v + R * QK),
                                   _mm256_xor_si256(_mm512_cvtepi16_epi8(_mm512_srai_epi16(x, 8)), flip));
            } else if (copy) {
                memcpy(v, (const int8_t *)qa + r * K + b * QK, QK);
            }
            m[0] = f[b];
            if (q6) { /* exact: a power of two */
                m[R] = -32.0f * f[2 * nb + 2 * b], m[2 * R] = -32.0f * f[2 * nb + 2 * b + 1];
            } else if (q8 && a8) { /* q = s + 128 meets a, and s . a = q . a - 128 sum(a) */
                const int8_t *x = (const int8_t *)qa + r * K + b * QK;
                int32_t sum = 0;
                for (int j = 0; j < QK; j++) sum += x[j];
                ((int32_t *)m)[R] = 128 * sum;
            } else {
                m[R] = f[nb + b];
            }
        }
    }
    if (!reuse) {
        planes_have.tag = planes_tag, planes_have.qa = qa, planes_have.M = M, planes_have.K = K, planes_have.q8 = q8;
        planes_have.q6 = q6, planes_have.bits = bits, planes_have.wide = wide;
    }
#define IL_GROUPS(KIND, A8) il_groups(KIND, A8, n0, n1, wq, wd, wm, nb, a, mt, M, y, ldy, bias, res, ldr)
    PAR_RANGE(N / IL_ROWS, N * M * nb >= par_min, switch (kind + 16 * a8) {
        case K_Q8I: IL_GROUPS(K_Q8I, 0); break;
        case K_Q5I: IL_GROUPS(K_Q5I, 0); break;
        case K_Q6I: IL_GROUPS(K_Q6I, 0); break;
        case K_Q4I: IL_GROUPS(K_Q4I, 0); break;
        case 16 + K_Q8I: IL_GROUPS(K_Q8I, 1); break;
        case 16 + K_Q5I: IL_GROUPS(K_Q5I, 1); break;
        case 16 + K_Q6I: IL_GROUPS(K_Q6I, 1); break;
        default: IL_GROUPS(K_Q4I, 1); break;
    });
#undef IL_GROUPS
    return 0;
}
