/* The LoRA part of the fused decode step (decode_step.h, models/lora.py):
 * each projection of a row with an adapter adds y += (x @ at) @ bt, the
 * first product (lora_a_rows) in the tail of the phase that finished x, the
 * second (lora_b_cols) in the projection's own column chunks.
 *
 * Layout (tq_lora_mat; lora_layout.py lora_pack makes it). The step reads
 * each adapter of a batch once per step, so at 8-16 adapters a step it
 * streams as many adapter bytes as base weights; row-major matrices made
 * those reads many short streams (one per rank row of bt, N values each),
 * which ran at a quarter of the bandwidth the base weights' one stream
 * gets, and int8 (half float16's bytes) was no faster. So each matrix is
 * stored in the order the kernels read it, one contiguous run:
 * - at [k, r] as ceil(r / TQ_LORA_W) rank groups, each [k][TQ_LORA_W]
 *   (ranks past r zero): a group's products for a row are one pass over it;
 * - bt [r, n] as its diagonal blocks (the whole matrix when nblocks is 0)
 *   one after another, block {n0, n1, c0, c1} as P panels [P][c1 - c0]
 *   [TQ_LORA_W]: panel p holds columns TQ_LORA_W (j0 + p) ... + TQ_LORA_W
 *   of ranks c0 .. c1 (j0 = n0 / TQ_LORA_W, P = ceil(n1 / TQ_LORA_W) - j0;
 *   zeros for columns outside [n0, n1)).
 * and the kernels prefetch ahead in the run they read (LORA_PF_BYTES, or a
 * pass). Measured on a shared 2-vCPU Xeon (AVX-512), one thread, 8 adapters
 * of one row each at SmolLM2-135M's shapes (rank 16, every projection), the
 * adapters' part of a step alone: 9.5 ms float16, 8.7 ms int8 before; 6.4
 * and 2.6 ms after (int8 now ~0.4-0.6x of float16's time, as its bytes say).
 *
 * Results do not depend on the layout, the instruction set, the thread
 * count or the rows beside a row: rank c of x @ at is the sum of four
 * partial sums over k = 0, 1, 2, 3 mod 4, each in order of k, added (p0 +
 * p1) + (p2 + p3) (then times scale[c] for int8); output column j of a row
 * is the sum over the block's ranks in order (one FMA chain from zero),
 * then added to y (as addmm). Each SIMD lane computes exactly that.
 *
 * Paths by tq_set_isa level: 3 AVX-512 (16 lanes; the wide paths below
 * from LORA_WIDE_MIN rows of one adapter), 1-2 AVX2 (8 lanes), 0 or
 * without AVX2 at build time portable C.
 *
 * Rows per pass (issue 34: one adapter on many rows): passes of 4 rows
 * made each vector of at or bt loaded (and for float16 or int8 converted,
 * two uops on the FMA ports) serve 4 FMAs. The A pass takes up to LORA_NRA = 7 rows (4 partial
 * sums a row: 28 accumulators). From LORA_WIDE_MIN rows of one adapter on
 * AVX-512 both products convert their matrix to float32 once a call, then
 * pass it with many rows: A a rank group LORA_KC values of k at a time, 7
 * rows a pass, the partial sums kept between chunks (lora_a_group_wide);
 * B LORA_WP panels at a time, up to 24 rows of one panel a pass, or 6 rows
 * of 4 panels where rows of y share L1 sets (lora_b_cols_wide). lt, the
 * products x @ at, is rank-major for the B passes: rank c of the row at
 * position j of lora_rows is C->lt[c T + j] (an adapter's rows are
 * consecutive positions), so a pass broadcasts its rows' ranks from one
 * pointer. Below LORA_WIDE_MIN rows, B passes take 4 rows (LORA_NR),
 * converting as they load. Measured on the 2-vCPU Xeon (AVX-512), one
 * thread, the kernels alone (tq_lora_apply over a whole rank-16 adapter of
 * the default model, 30 layers, alternating with the 4-row kernels in one
 * process): 64 rows of one adapter float16 7.8 -> 6.2 ms (0.80x), int8
 * 0.84x, float32 0.90x; 32 rows 0.78x, 16 rows 0.84x (float16). */

/* Rows of one adapter a B kernel call of the narrow path takes: each value
 * of bt it loads serves them all. */
#define LORA_NR 4
/* Rows an A kernel call takes (the AVX-512 one keeps 4 partial sums a row in
 * registers: 28 of the 32). */
#define LORA_NRA 7
/* Rows of one adapter from which its products take the wide paths
 * (AVX-512; fewer than 8 accumulators of a B pass would wait on the FMA
 * latency), the most rows a wide B pass of one panel takes (an accumulator
 * each), and the most ranks of a block the wide B path takes (LORA_WP
 * float32 panels of them on the stack, 32 KB). */
#define LORA_WIDE_MIN 8
#define LORA_NRB 24
#define LORA_WIDE_RB 128
/* The wide B path's other pass shape: up to LORA_WR rows of LORA_WP panels
 * (lora_b_cols_wide says when). */
#define LORA_WR 6
#define LORA_WP 4
/* The wide A path (AVX-512, from LORA_WIDE_MIN rows of one adapter): each
 * rank group converted to float32 LORA_KC values of k at a time (16 KB, in
 * L1 with the rows' x), passed by up to LORA_SB rows (their partial sums
 * kept between chunks, 16 KB). */
#define LORA_KC 256
#define LORA_SB 64
/* Bytes the A kernels prefetch ahead of what they read (into L1; the B
 * kernels prefetch their next pass). */
#define LORA_PF_BYTES 1024
/* Panels of bt the rows of one adapter take together (lora_b_cols): a
 * slice of at most this many panels stays in L1 while each group of
 * LORA_NR rows passes over it. */
#define LORA_SLICE 16

static inline int lora_esz(int dt) { return dt == TQ_LORA_F32 ? 4 : dt == TQ_LORA_F16 ? 2 : 1; }

static inline float lora_val(const void *p, int64_t i, const int dt) {
    return dt == TQ_LORA_F16 ? fp16_to_fp32(((const uint16_t *)p)[i])
           : dt == TQ_LORA_I8 ? (float)((const int8_t *)p)[i] : ((const float *)p)[i];
}

/* Prefetch bytes [p, p + n) into L1, a line at a time. */
static inline void lora_prefetch(const char *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* ------------------------------------------------------------- portable */

/* o[i][j] = (x rows xr[i] [K]) @ group ag [K][W], lane j, for nr rows (the
 * order of the file's top). */
static void lora_a_group_c(const float *const *xr, int nr, const void *ag, int dt, int64_t K, float (*o)[TQ_LORA_W]) {
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < TQ_LORA_W; j++) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t k = 0; k < K; k++) p[k & 3] = fmaf(xr[i][k], lora_val(ag, k * TQ_LORA_W + j, dt), p[k & 3]);
            o[i][j] = (p[0] + p[1]) + (p[2] + p[3]);
        }
}

/* y[rows[i], s:e] += row i's ranks (lt[r ls + i], r < rb) @ block columns
 * s:e (panels from j0, rb ranks each), for nr rows. */
static void lora_b_panels_c(const float *lt, int64_t ls, int nr, const void *bp, int dt, int64_t rb, int64_t j0,
                            float *y, const int64_t *rows, int64_t N, int64_t s, int64_t e) {
    for (int64_t c = s; c < e; c++) {
        const int64_t base = (c / TQ_LORA_W - j0) * rb * TQ_LORA_W + c % TQ_LORA_W;
        for (int i = 0; i < nr; i++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < rb; r++) acc = fmaf(lt[r * ls + i], lora_val(bp, base + r * TQ_LORA_W, dt), acc);
            y[rows[i] * N + c] += acc;
        }
    }
}

/* ----------------------------------------------------------------- AVX2 */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LORA_SIMD 1

/* 8 values from p[i] of dtype dt (TQ_LORA_*) */
static inline __attribute__((always_inline)) __m256 lora_load8(const void *p, int64_t i, const int dt) {
    if (dt == TQ_LORA_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dt == TQ_LORA_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    return _mm256_loadu_ps((const float *)p + i);
}

/* lora_a_group_c for one row (two vectors of 8 ranks, four partial sums
 * each); pf: prefetch ahead in ag. */
static inline __attribute__((always_inline)) void lora_a_group_avx2(const float *xr, const void *ag, const int dt,
                                                                    int64_t K, float *o, int pf) {
    const int64_t K4 = K / 4 * 4, step = 4 * TQ_LORA_W * lora_esz(dt);
    __m256 s[2][4];
    for (int v = 0; v < 2; v++)
        for (int u = 0; u < 4; u++) s[v][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K4; k += 4) {
        if (pf) lora_prefetch((const char *)ag + k * TQ_LORA_W * lora_esz(dt) + LORA_PF_BYTES, step);
        for (int u = 0; u < 4; u++) {
            const __m256 xv = _mm256_broadcast_ss(xr + k + u);
            for (int v = 0; v < 2; v++) s[v][u] = _mm256_fmadd_ps(xv, lora_load8(ag, (k + u) * TQ_LORA_W + 8 * v, dt), s[v][u]);
        }
    }
    for (int64_t k = K4; k < K; k++)
        for (int v = 0; v < 2; v++)
            s[v][k - K4] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + k), lora_load8(ag, k * TQ_LORA_W + 8 * v, dt), s[v][k - K4]);
    for (int v = 0; v < 2; v++)
        _mm256_storeu_ps(o + 8 * v, _mm256_add_ps(_mm256_add_ps(s[v][0], s[v][1]), _mm256_add_ps(s[v][2], s[v][3])));
}

/* y[row, 8 columns from c] += a, only columns [s, e) of them */
static inline __attribute__((always_inline)) void lora_add8(float *yr, int64_t c, int64_t s, int64_t e, __m256 a) {
    if (c >= s && c + 8 <= e) {
        _mm256_storeu_ps(yr + c, _mm256_add_ps(_mm256_loadu_ps(yr + c), a));
        return;
    }
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32((int)(c - s)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i m = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(-1)),
                                       _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(e - s)), lane));
    _mm256_maskstore_ps(yr + c, m, _mm256_add_ps(_mm256_maskload_ps(yr + c, m), a));
}

/* np panels from panel j (block panels from j0, rb ranks) for nr rows
 * (row i's rank r at lt[r ls + i]): eight accumulators. pf: prefetch ahead
 * in the block. */
static inline __attribute__((always_inline)) void lora_b_pass_avx2(const float *lt, int64_t ls, const int nr, const int np,
                                                                   const void *bp, const int dt, int64_t rb, int64_t j0,
                                                                   int64_t j, float *y, const int64_t *rows, int64_t N,
                                                                   int64_t s, int64_t e, int pf) {
    const int64_t pw = rb * TQ_LORA_W; /* values of a panel */
    if (pf) lora_prefetch((const char *)bp + ((j - j0 + np) * pw) * lora_esz(dt), np * pw * lora_esz(dt));
    __m256 a[LORA_NR][4][2];
    for (int i = 0; i < nr; i++)
        for (int p = 0; p < np; p++) a[i][p][0] = a[i][p][1] = _mm256_setzero_ps();
    const int64_t off = (j - j0) * pw;
    for (int64_t r = 0; r < rb; r++) {
        __m256 l[LORA_NR];
        for (int i = 0; i < nr; i++) l[i] = _mm256_broadcast_ss(lt + r * ls + i);
        for (int p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                const __m256 b = lora_load8(bp, off + p * pw + r * TQ_LORA_W + 8 * h, dt);
                for (int i = 0; i < nr; i++) a[i][p][h] = _mm256_fmadd_ps(l[i], b, a[i][p][h]);
            }
    }
    for (int i = 0; i < nr; i++)
        for (int p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) lora_add8(y + rows[i] * N, (j + p) * TQ_LORA_W + 8 * h, s, e, a[i][p][h]);
}

/* lora_b_panels_c on AVX2: panels 4 a pass for one row, 2 for two, 1 for more. */
static inline __attribute__((always_inline)) void lora_b_panels_avx2(const float *lt, int64_t ls, const int nr, const void *bp,
                                                                     const int dt, int64_t rb, int64_t j0, float *y,
                                                                     const int64_t *rows, int64_t N, int64_t s,
                                                                     int64_t e, int pf) {
    const int np = nr == 1 ? 4 : nr == 2 ? 2 : 1;
    int64_t j = s / TQ_LORA_W;
    const int64_t je = (e + TQ_LORA_W - 1) / TQ_LORA_W;
    for (; j + np <= je; j += np) lora_b_pass_avx2(lt, ls, nr, np, bp, dt, rb, j0, j, y, rows, N, s, e, pf);
    for (; j < je; j++) lora_b_pass_avx2(lt, ls, nr, 1, bp, dt, rb, j0, j, y, rows, N, s, e, pf);
}

/* The dispatch of a row count and a dtype to constants (so the loops unroll):
 * LORA_NR_DT for 1 .. LORA_NR rows, LORA_NRA_DT for 1 .. LORA_NRA. */
#define LORA_DT(dtype, call, n)                                                                             \
    do {                                                                                                     \
        if ((dtype) == TQ_LORA_F16) call(n, TQ_LORA_F16);                                                    \
        else if ((dtype) == TQ_LORA_I8) call(n, TQ_LORA_I8);                                                 \
        else call(n, TQ_LORA_F32);                                                                           \
    } while (0)
#define LORA_NR_DT(nr, dtype, call)                                                                         \
    do {                                                                                                     \
        switch (nr) {                                                                                        \
        case 1: LORA_DT(dtype, call, 1); break;                                                              \
        case 2: LORA_DT(dtype, call, 2); break;                                                              \
        case 3: LORA_DT(dtype, call, 3); break;                                                              \
        default: LORA_DT(dtype, call, 4); break;                                                             \
        }                                                                                                    \
    } while (0)
#define LORA_NRA_DT(nr, dtype, call)                                                                        \
    do {                                                                                                     \
        switch (nr) {                                                                                        \
        case 1: LORA_DT(dtype, call, 1); break;                                                              \
        case 2: LORA_DT(dtype, call, 2); break;                                                              \
        case 3: LORA_DT(dtype, call, 3); break;                                                              \
        case 4: LORA_DT(dtype, call, 4); break;                                                              \
        case 5: LORA_DT(dtype, call, 5); break;                                                              \
        case 6: LORA_DT(dtype, call, 6); break;                                                              \
        default: LORA_DT(dtype, call, 7); break;                                                             \
        }                                                                                                    \
    } while (0)

/* ------------------------------------------------------------- AVX-512 */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LORA_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")

static inline __attribute__((always_inline)) __m512 lora_load16(const void *p, int64_t i, const int dt) {
    if (dt == TQ_LORA_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    if (dt == TQ_LORA_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    return _mm512_loadu_ps((const float *)p + i);
}

/* lora_a_group_c for nr <= LORA_NRA rows: a vector of 16 ranks, four
 * partial sums, per row (each value of ag loaded serves nr FMAs). */
static inline __attribute__((always_inline)) void lora_a_group_512(const float *const *xr, const int nr, const void *ag,
                                                                   const int dt, int64_t K, float (*o)[TQ_LORA_W], int pf) {
    const int64_t K4 = K / 4 * 4, step = 4 * TQ_LORA_W * lora_esz(dt);
    __m512 s[LORA_NRA][4];
    for (int i = 0; i < nr; i++)
        for (int u = 0; u < 4; u++) s[i][u] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K4; k += 4) {
        if (pf) lora_prefetch((const char *)ag + k * TQ_LORA_W * lora_esz(dt) + LORA_PF_BYTES, step);
        for (int u = 0; u < 4; u++) {
            const __m512 b = lora_load16(ag, (k + u) * TQ_LORA_W, dt);
            for (int i = 0; i < nr; i++) s[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][k + u]), b, s[i][u]);
        }
    }
    for (int64_t k = K4; k < K; k++) {
        const __m512 b = lora_load16(ag, k * TQ_LORA_W, dt);
        for (int i = 0; i < nr; i++) s[i][k - K4] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][k]), b, s[i][k - K4]);
    }
    for (int i = 0; i < nr; i++)
        _mm512_storeu_ps(o[i], _mm512_add_ps(_mm512_add_ps(s[i][0], s[i][1]), _mm512_add_ps(s[i][2], s[i][3])));
}

/* y[row, c + lane] += a for the lanes of mask m (0xffff: all 16) */
static inline __attribute__((always_inline)) void lora_add16(float *yr, __mmask16 m, __m512 a) {
    if (m == 0xffff) _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), a));
    else _mm512_mask_storeu_ps(yr, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), a));
}

/* The lanes of panel j (columns 16 j ..) within columns [s, e) */
static inline __mmask16 lora_panel_mask(int64_t j, int64_t s, int64_t e) {
    const int64_t c = j * TQ_LORA_W, lo = s > c ? s - c : 0, hi = e < c + TQ_LORA_W ? e - c : TQ_LORA_W;
    return (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* np panels from panel j for nr rows (row i's rank r at lt[r ls + i]; a
 * vector per panel and row). */
static inline __attribute__((always_inline)) void lora_b_pass_512(const float *lt, int64_t ls, const int nr, const int np,
                                                                  const void *bp, const int dt, int64_t rb, int64_t j0,
                                                                  int64_t j, float *y, const int64_t *rows, int64_t N,
                                                                  int64_t s, int64_t e, int pf) {
    const int64_t pw = rb * TQ_LORA_W, off = (j - j0) * pw;
    if (pf) lora_prefetch((const char *)bp + (off + np * pw) * lora_esz(dt), np * pw * lora_esz(dt));
    __m512 a[LORA_NR][8];
    for (int i = 0; i < nr; i++)
        for (int p = 0; p < np; p++) a[i][p] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rb; r++) {
        __m512 l[LORA_NR];
        for (int i = 0; i < nr; i++) l[i] = _mm512_set1_ps(lt[r * ls + i]);
        for (int p = 0; p < np; p++) {
            const __m512 b = lora_load16(bp, off + p * pw + r * TQ_LORA_W, dt);
            for (int i = 0; i < nr; i++) a[i][p] = _mm512_fmadd_ps(l[i], b, a[i][p]);
        }
    }
    for (int p = 0; p < np; p++) {
        const __mmask16 m = lora_panel_mask(j + p, s, e);
        for (int i = 0; i < nr; i++) lora_add16(y + rows[i] * N + (j + p) * TQ_LORA_W, m, a[i][p]);
    }
}

static inline __attribute__((always_inline)) void lora_b_panels_512(const float *lt, int64_t ls, const int nr,
                                                                    const void *bp, const int dt, int64_t rb, int64_t j0,
                                                                    float *y, const int64_t *rows, int64_t N, int64_t s,
                                                                    int64_t e, int pf) {
    const int np = nr == 1 ? 8 : 4;
    int64_t j = s / TQ_LORA_W;
    const int64_t je = (e + TQ_LORA_W - 1) / TQ_LORA_W;
    for (; j + np <= je; j += np) lora_b_pass_512(lt, ls, nr, np, bp, dt, rb, j0, j, y, rows, N, s, e, pf);
    for (; j < je; j++) lora_b_pass_512(lt, ls, nr, 1, bp, dt, rb, j0, j, y, rows, N, s, e, pf);
}

static void lora_a_group_avx512(const float *const *xr, int nr, const void *ag, int dt, int64_t K,
                                float (*o)[TQ_LORA_W], int pf) {
#define A(n, h) lora_a_group_512(xr, n, ag, h, K, o, pf)
    LORA_NRA_DT(nr, dt, A);
#undef A
}

static void lora_b_panels_avx512(const float *lt, int64_t ls, int nr, const void *bp, int dt, int64_t rb, int64_t j0,
                                 float *y, const int64_t *rows, int64_t N, int64_t s, int64_t e, int pf) {
#define B(n, h) lora_b_panels_512(lt, ls, n, bp, h, rb, j0, y, rows, N, s, e, pf)
    LORA_NR_DT(nr, dt, B);
#undef B
}

#include "lora_wide_avx512.h" /* lora_a_group_wide, lora_b_cols_wide */
#pragma GCC pop_options
#endif /* x86 */

static void lora_b_panels_avx2_any(const float *lt, int64_t ls, int nr, const void *bp, int dt, int64_t rb, int64_t j0,
                                   float *y, const int64_t *rows, int64_t N, int64_t s, int64_t e, int pf) {
#define B(n, h) lora_b_panels_avx2(lt, ls, n, bp, h, rb, j0, y, rows, N, s, e, pf)
    LORA_NR_DT(nr, dt, B);
#undef B
}
#endif /* AVX2 */

/* ------------------------------------------------------------- drivers */

/* o[i][:W] = rank group ag's products of the nr rows xr (the path of the ISA in use) */
static void lora_a_group(const float *const *xr, int nr, const void *ag, int dt, int64_t K, float (*o)[TQ_LORA_W],
                         int pf) {
#ifdef LORA_SIMD
    const int level = cur_isa();
#ifdef LORA_AVX512
    if (level >= 3) {
        lora_a_group_avx512(xr, nr, ag, dt, K, o, pf);
        return;
    }
#endif
    if (level >= 1) {
        for (int i = 0; i < nr; i++) {
            if (dt == TQ_LORA_F16) lora_a_group_avx2(xr[i], ag, TQ_LORA_F16, K, o[i], pf && i == 0);
            else if (dt == TQ_LORA_I8) lora_a_group_avx2(xr[i], ag, TQ_LORA_I8, K, o[i], pf && i == 0);
            else lora_a_group_avx2(xr[i], ag, TQ_LORA_F32, K, o[i], pf && i == 0);
        }
        return;
    }
#endif
    (void)pf;
    lora_a_group_c(xr, nr, ag, dt, K, o);
}

/* y[rows[i], s:e] += row i's ranks (lt[r ls + i]) @ the block's columns s:e,
 * for nr <= LORA_NR rows (the path of the ISA in use) */
static void lora_b_panels(const float *lt, int64_t ls, int nr, const void *bp, int dt, int64_t rb, int64_t j0,
                          float *y, const int64_t *rows, int64_t N, int64_t s, int64_t e, int pf) {
#ifdef LORA_SIMD
    const int level = cur_isa();
#ifdef LORA_AVX512
    if (level >= 3) {
        lora_b_panels_avx512(lt, ls, nr, bp, dt, rb, j0, y, rows, N, s, e, pf);
        return;
    }
#endif
    if (level >= 1) {
        lora_b_panels_avx2_any(lt, ls, nr, bp, dt, rb, j0, y, rows, N, s, e, pf);
        return;
    }
#endif
    (void)pf;
    lora_b_panels_c(lt, ls, nr, bp, dt, rb, j0, y, rows, N, s, e);
}

/* The first half of the LoRA update of projection p of layer li, for rows
 * [r0, r1) of its input x [T, K]: rank c of row t = lora_rows[j] at
 * C->lt[c T + j] = (x[t] @ at)[c] (run in the tail of the phase that
 * finished x, before the projection's phase opens): per adapter, per rank
 * group, its rows in ceil(n / LORA_NRA) near-equal passes (the group, read
 * from memory by the first, stays in L1 for the others), or from
 * LORA_WIDE_MIN rows on AVX-512 lora_a_group_wide, up to LORA_SB rows a call. */
static void lora_a_rows(const step_ctx *C, int64_t li, int p, const float *x, int64_t K, int64_t r0, int64_t r1) {
    if (!C->lora) return;
    const tq_lora_batch *lb = C->lora;
    for (int64_t a = 0; a < lb->n_adapters; a++) {
        const tq_lora_mat *m = &lb->adapters[a][4 * li + p];
        if (!m->at || m->r <= 0) continue;
        const int dt = (int)m->dtype;
        int64_t n_in = 0; /* the adapter's rows within [r0, r1) */
        for (int64_t j = C->lora_start[a]; j < C->lora_start[a + 1]; j++) n_in += C->lora_rows[j] >= r0 && C->lora_rows[j] < r1;
        int wide = 0;
#ifdef LORA_AVX512
        wide = n_in >= LORA_WIDE_MIN && cur_isa() >= 3;
#endif
        const int64_t per = wide ? LORA_SB : LORA_NRA, n_pass = (n_in + per - 1) / per;
        for (int64_t g = 0; g * TQ_LORA_W < m->r; g++) {
            const char *ag = (const char *)m->at + g * K * TQ_LORA_W * lora_esz(dt);
            const int64_t c0 = g * TQ_LORA_W, w = m->r - c0 < TQ_LORA_W ? m->r - c0 : TQ_LORA_W;
            int64_t j = C->lora_start[a], left = n_in;
            for (int64_t q = 0; q < n_pass; q++) {
                const int64_t want = (left + (n_pass - q) - 1) / (n_pass - q);
                const float *xr[LORA_SB];
                int64_t pos[LORA_SB];
                int nr = 0;
                for (; nr < want; j++)
                    if (C->lora_rows[j] >= r0 && C->lora_rows[j] < r1) pos[nr] = j, xr[nr] = x + C->lora_rows[j] * K, nr++;
                left -= nr;
                float o[LORA_SB][TQ_LORA_W];
#ifdef LORA_AVX512
                if (wide) lora_a_group_wide(xr, nr, ag, dt, K, o);
                else
#endif
                    lora_a_group(xr, nr, ag, dt, K, o, q == 0);
                for (int i = 0; i < nr; i++) {
                    float *out = C->lt + c0 * C->T + pos[i];
                    for (int64_t c = 0; c < w; c++) out[c * C->T] = dt == TQ_LORA_I8 ? o[i][c] * m->scale[c0 + c] : o[i][c];
                }
            }
        }
    }
}

/* The second half, for output columns [lo, hi) of y [M, N] (the columns a
 * projection chunk just wrote): y[t, lo:hi] += lt[t, :r] @ bt[:, lo:hi],
 * block by block: from LORA_WIDE_MIN rows of the adapter (AVX-512)
 * lora_b_cols_wide, else slices of LORA_SLICE panels, each slice passed by
 * the rows of the adapter LORA_NR at a time. */
static void lora_b_cols(const step_ctx *C, int64_t li, int p, float *y, int64_t N, int64_t lo, int64_t hi) {
    const tq_lora_batch *lb = C->lora;
    for (int64_t a = 0; a < lb->n_adapters; a++) {
        const tq_lora_mat *m = &lb->adapters[a][4 * li + p];
        const int64_t n_rows = C->lora_start[a + 1] - C->lora_start[a];
        if (!m->at || m->r <= 0 || n_rows <= 0) continue;
        const int dt = (int)m->dtype;
        const int64_t dense[4] = {0, N, 0, m->r}, nb = m->nblocks > 0 ? m->nblocks : 1;
        const char *bp = (const char *)m->bt;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t *bl = m->nblocks > 0 ? m->blocks[b] : dense;
            const int64_t rb = bl[3] - bl[2], j0 = bl[0] / TQ_LORA_W, P = (bl[1] + TQ_LORA_W - 1) / TQ_LORA_W - j0;
            const int64_t s = bl[0] > lo ? bl[0] : lo, e = bl[1] < hi ? bl[1] : hi;
            const int64_t *rows = C->lora_rows + C->lora_start[a];
            const float *lt = C->lt + bl[2] * C->T + C->lora_start[a]; /* rank bl[2] of the adapter's first row */
#ifdef LORA_AVX512
            if (s < e && rb > 0 && n_rows >= LORA_WIDE_MIN && rb <= LORA_WIDE_RB && cur_isa() >= 3) {
                lora_b_cols_wide(lt, C->T, n_rows, bp, dt, rb, j0, y, rows, N, s, e);
                bp += P * rb * TQ_LORA_W * lora_esz(dt);
                continue;
            }
#endif
            for (int64_t cs = s; cs < e && rb > 0;) {
                const int64_t ce0 = (cs / TQ_LORA_W + LORA_SLICE) * TQ_LORA_W, ce = ce0 < e ? ce0 : e;
                for (int64_t i = 0; i < n_rows; i += LORA_NR) {
                    const int nr = (int)(n_rows - i < LORA_NR ? n_rows - i : LORA_NR);
                    lora_b_panels(lt + i, C->T, nr, bp, dt, rb, j0, y, rows + i, N, cs, ce, i == 0);
                }
                cs = ce;
            }
            bp += P * rb * TQ_LORA_W * lora_esz(dt);
        }
    }
}

/* The kernels above alone, for one adapter's update of one projection (tests
 * give them shapes and column ranges the model's projections do not have):
 * y[t, lo:hi] += (x[t] @ at) @ bt[:, lo:hi] for the T rows of x [T, K], y
 * [T, N], with m's matrices as tq_decode_layers takes them. Returns 0, or -1
 * when the scratch cannot be allocated. */
int tq_lora_apply(const tq_lora_mat *m, const float *x, int64_t T, int64_t K, float *y, int64_t N, int64_t lo,
                  int64_t hi) {
    if (T <= 0 || !m->at || m->r <= 0) return 0;
    float *lt = malloc((size_t)(T * m->r) * sizeof(float));
    int64_t *rows = malloc((size_t)(T + 2) * sizeof(int64_t)), zero = 0;
    if (!lt || !rows) {
        free(lt), free(rows);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) rows[t] = t;
    int64_t *start = rows + T; /* one adapter: its rows 0 .. T */
    start[0] = 0, start[1] = T;
    const tq_lora_mat *adapters[1] = {m};
    const tq_lora_batch lb = {1, adapters, &zero};
    step_ctx C;
    memset(&C, 0, sizeof(C));
    C.T = T, C.lora = &lb, C.lt = lt, C.r_max = m->r, C.lora_rows = rows, C.lora_start = start;
    lora_a_rows(&C, 0, 0, x, K, 0, T);
    lora_b_cols(&C, 0, 0, y, N, lo, hi);
    free(lt), free(rows);
    return 0;
}
