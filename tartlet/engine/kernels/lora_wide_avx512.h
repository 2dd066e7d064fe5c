/* The wide AVX-512 paths of the LoRA kernels (lora_kernels.h, which
 * includes this inside its AVX-512 target region): from LORA_WIDE_MIN rows
 * of one adapter, each product converts its matrix to float32 once a call
 * and passes it with many rows, so each vector loaded serves up to
 * LORA_NRA (A) or LORA_NRB (B) FMAs; lora_kernels.h's top says why and what
 * was measured. The arithmetic of every output is the file's top's: these
 * paths compute the same bits as the narrow ones and as portable C. */

/* The wide A path's pass: values k0 .. k0 + kn of the nr <= LORA_NRA rows
 * xr (each already advanced by k0) times the float32 chunk w [kn][16] of a
 * rank group, continuing each row's four partial sums st[i][u] (k0 a
 * multiple of 4, so u = k mod 4 as in lora_a_group_512); pf (or NULL):
 * prefetch pf_step bytes from there on each 4 values of k. */
static inline __attribute__((always_inline)) void lora_a_chunk_512(const float *const *xr, const int nr, const float *w,
                                                                   int64_t kn, float (*st)[4][TQ_LORA_W], const char *pf,
                                                                   int64_t pf_step) {
    const int64_t K4 = kn / 4 * 4;
    __m512 s[LORA_NRA][4];
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 4; u++) s[i][u] = _mm512_load_ps(st[i][u]);
    for (int64_t k = 0; k < K4; k += 4) {
        if (pf) lora_prefetch(pf + k / 4 * pf_step, pf_step);
        for (int u = 0; u < 4; u++) {
            const __m512 b = _mm512_loadu_ps(w + (k + u) * TQ_LORA_W);
            for (int i = 0; i < nr; i++) s[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][k + u]), b, s[i][u]);
        }
    }
    for (int64_t k = K4; k < kn; k++) {
        const __m512 b = _mm512_loadu_ps(w + k * TQ_LORA_W);
        for (int i = 0; i < nr; i++) s[i][k - K4] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][k]), b, s[i][k - K4]);
    }
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 4; u++) _mm512_store_ps(st[i][u], s[i][u]);
}

static void lora_a_chunk_avx512(const float *const *xr, int nr, const float *w, int64_t kn, float (*st)[4][TQ_LORA_W],
                                const char *pf, int64_t pf_step) {
#define A(n, h) lora_a_chunk_512(xr, n, w, kn, st, pf, pf_step)
    LORA_NRA_DT(nr, TQ_LORA_F32, A);
#undef A
}

/* o[i][:W] = rank group ag's products of the nr <= LORA_SB rows xr, as
 * lora_a_group_512 computes them: the group converted to float32 a chunk
 * of LORA_KC values of k at a time (read in place for float32), each chunk
 * passed by the rows in ceil(nr / LORA_NRA) near-equal passes. */
static void lora_a_group_wide(const float *const *xr, int64_t nr, const void *ag, int dt, int64_t K,
                              float (*o)[TQ_LORA_W]) {
    float w[LORA_KC * TQ_LORA_W] __attribute__((aligned(64)));
    float st[LORA_SB][4][TQ_LORA_W] __attribute__((aligned(64)));
    memset(st, 0, (size_t)nr * sizeof(st[0]));
    const int64_t n_pass = (nr + LORA_NRA - 1) / LORA_NRA, esz = lora_esz(dt);
    for (int64_t k0 = 0; k0 < K; k0 += LORA_KC) {
        const int64_t kn = K - k0 < LORA_KC ? K - k0 : LORA_KC;
        const float *wp = w;
        if (dt == TQ_LORA_F16)
            for (int64_t k = 0; k < kn; k++) _mm512_store_ps(w + k * TQ_LORA_W, lora_load16(ag, (k0 + k) * TQ_LORA_W, TQ_LORA_F16));
        else if (dt == TQ_LORA_I8)
            for (int64_t k = 0; k < kn; k++) _mm512_store_ps(w + k * TQ_LORA_W, lora_load16(ag, (k0 + k) * TQ_LORA_W, TQ_LORA_I8));
        else
            wp = (const float *)ag + k0 * TQ_LORA_W;
        for (int64_t q = 0, i0 = 0; q < n_pass; q++) {
            const int64_t n = (nr - i0 + (n_pass - q) - 1) / (n_pass - q);
            const float *xc[LORA_NRA];
            for (int64_t i = 0; i < n; i++) xc[i] = xr[i0 + i] + k0;
            /* the first pass prefetches the next chunk (the next group's first after the last) */
            lora_a_chunk_avx512(xc, (int)n, wp, kn, st + i0, q ? 0 : (const char *)ag + (k0 + kn) * TQ_LORA_W * esz,
                                4 * TQ_LORA_W * esz);
            i0 += n;
        }
    }
    for (int64_t i = 0; i < nr; i++)
        _mm512_storeu_ps(o[i], _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(st[i][0]), _mm512_load_ps(st[i][1])),
                                             _mm512_add_ps(_mm512_load_ps(st[i][2]), _mm512_load_ps(st[i][3]))));
}

/* The wide B path's pass: np float32 panels w [np][rb][16] (from panel j,
 * pw values apart) for n rows, n np <= LORA_NRB accumulators (np 1: n <=
 * 24; else n <= LORA_WR, np <= LORA_WP), row i's rank r broadcast from
 * lt[r ls + i]: each vector of w loaded serves n FMAs. */
static inline __attribute__((always_inline)) void lora_b_wide_512(const float *lt, int64_t ls, const int n, const int np,
                                                                  const float *w, int64_t pw, int64_t rb, float *y,
                                                                  const int64_t *rows, int64_t N, int64_t j, int64_t s,
                                                                  int64_t e) {
    __m512 a[LORA_NRB]; /* row i, panel p: a[i np + p] */
#pragma GCC unroll 24
    for (int q = 0; q < n * np; q++) a[q] = _mm512_setzero_ps();
    if (rb <= 0) __builtin_unreachable(); /* (lora_b_cols): a[] stays in registers only */
    for (int64_t r = 0; r < rb; r++) {
        const float *l = lt + r * ls;
        if (np == 1) {
            const __m512 b = _mm512_loadu_ps(w + r * TQ_LORA_W);
#pragma GCC unroll 24
            for (int i = 0; i < n; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(l[i]), b, a[i]);
        } else {
            __m512 lv[LORA_WR];
            for (int i = 0; i < n; i++) lv[i] = _mm512_set1_ps(l[i]);
            for (int p = 0; p < np; p++) {
                const __m512 b = _mm512_loadu_ps(w + p * pw + r * TQ_LORA_W);
                for (int i = 0; i < n; i++) a[i * np + p] = _mm512_fmadd_ps(lv[i], b, a[i * np + p]);
            }
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < np; p++) {
        const __mmask16 m = lora_panel_mask(j + p, s, e);
#pragma GCC unroll 24
        for (int i = 0; i < n; i++) lora_add16(y + rows[i] * N + (j + p) * TQ_LORA_W, m, a[i * np + p]);
    }
}

#define LORA_W1(n)                                                                                           \
    case n: lora_b_wide_512(lt, ls, n, 1, w, pw, rb, y, rows, N, j, s, e); break;
#define LORA_WN(n)                                                                                           \
    case n:                                                                                                  \
        if (np == 2) lora_b_wide_512(lt, ls, n, 2, w, pw, rb, y, rows, N, j, s, e);                          \
        else if (np == 3) lora_b_wide_512(lt, ls, n, 3, w, pw, rb, y, rows, N, j, s, e);                     \
        else lora_b_wide_512(lt, ls, n, LORA_WP, w, pw, rb, y, rows, N, j, s, e);                            \
        break;
/* lora_b_wide_512 for n rows (1 .. 24 with np 1, else 1 .. LORA_WR) and np panels (1 .. LORA_WP) */
static void lora_b_wide_avx512(const float *lt, int64_t ls, int n, int np, const float *w, int64_t pw, int64_t rb,
                               float *y, const int64_t *rows, int64_t N, int64_t j, int64_t s, int64_t e) {
    if (np == 1) {
        switch (n) {
            LORA_W1(1) LORA_W1(2) LORA_W1(3) LORA_W1(4) LORA_W1(5) LORA_W1(6) LORA_W1(7) LORA_W1(8)
            LORA_W1(9) LORA_W1(10) LORA_W1(11) LORA_W1(12) LORA_W1(13) LORA_W1(14) LORA_W1(15) LORA_W1(16)
            LORA_W1(17) LORA_W1(18) LORA_W1(19) LORA_W1(20) LORA_W1(21) LORA_W1(22) LORA_W1(23)
        default: lora_b_wide_512(lt, ls, LORA_NRB, 1, w, pw, rb, y, rows, N, j, s, e); break;
        }
        return;
    }
    switch (n) {
        LORA_WN(1) LORA_WN(2) LORA_WN(3) LORA_WN(4) LORA_WN(5)
    default: LORA_WN(LORA_WR)
    }
}
#undef LORA_W1
#undef LORA_WN

/* lora_b_panels for nr >= LORA_WIDE_MIN rows of one adapter and rb <=
 * LORA_WIDE_RB ranks: a group of panels at a time, converted to float32
 * once (read in place for float32) and passed by the rows in near-equal
 * groups (the same values as the narrow path: every lane is the chain of
 * the file's top). The passes take one panel and up to LORA_NRB rows, or,
 * where rows of y fall in few L1 sets (N * 4 bytes a multiple of 1024:
 * fewer than 8 offsets in a 4 KB page, as gate/up's 3072 floats), LORA_WP
 * panels and up to LORA_WR rows: 24 rows of one panel a pass (24 lines of
 * one set) ran there 1.3x slower than 6 rows of 4 panels (measured at 64
 * rows: N 3072 1.3x, 1536 1.1x; elsewhere one panel a pass is 1.1x faster). */
static void lora_b_cols_wide(const float *lt, int64_t ls, int64_t nr, const void *bp, int dt, int64_t rb, int64_t j0,
                             float *y, const int64_t *rows, int64_t N, int64_t s, int64_t e) {
    float w[LORA_WP * LORA_WIDE_RB * TQ_LORA_W] __attribute__((aligned(64)));
    const int tall = N * (int64_t)sizeof(float) % 1024 == 0;
    const int64_t gp = tall ? LORA_WP : 1, per = tall ? LORA_WR : LORA_NRB; /* panels, rows a pass */
    const int64_t pw = rb * TQ_LORA_W, nb = (nr + per - 1) / per, esz = lora_esz(dt);
    const int64_t je = (e + TQ_LORA_W - 1) / TQ_LORA_W;
    for (int64_t j = s / TQ_LORA_W; j < je; j += gp) {
        const int64_t np = je - j < gp ? je - j : gp, off = (j - j0) * pw;
        if (j + np < je) lora_prefetch((const char *)bp + (off + np * pw) * esz, gp * pw * esz);
        const float *wp = w;
        if (dt == TQ_LORA_F16)
            for (int64_t r = 0; r < np * rb; r++) _mm512_store_ps(w + r * TQ_LORA_W, lora_load16(bp, off + r * TQ_LORA_W, TQ_LORA_F16));
        else if (dt == TQ_LORA_I8)
            for (int64_t r = 0; r < np * rb; r++) _mm512_store_ps(w + r * TQ_LORA_W, lora_load16(bp, off + r * TQ_LORA_W, TQ_LORA_I8));
        else
            wp = (const float *)bp + off;
        for (int64_t b = 0, i0 = 0; b < nb; b++) {
            const int64_t n = (nr - i0 + (nb - b) - 1) / (nb - b);
            lora_b_wide_avx512(lt + i0, ls, (int)n, (int)np, wp, pw, rb, y, rows + i0, N, j, s, e);
            i0 += n;
        }
    }
}
