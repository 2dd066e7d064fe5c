/* Quantized matrix multiplication on the CPU: y = x @ W^T (+ bias) (+ residual)
 * with W kept in 4/5/6/8-bit blocks. Loaded by tartlet/engine/kernels/quant_kernels.py,
 * which compiles this file once per machine.
 *
 * Method (llama.cpp's, ggml-cpu/quants.c): each row of x is quantized on the
 * fly to blocks of 32 signed 8-bit values with one float scale
 * (d = max|x| / 127, q = round(x / d), round half to even); each weight block
 * of 32 is unpacked to unsigned 8-bit values q in [0, 2^bits) with
 * "value = d_w * q + m_w" (m_w: the block's minimum, or -8 d, -16 d, -32 d,
 * -128 d for the symmetric formats). Then
 *
 *   sum_j (d_w q_j + m_w)(d_x a_j) = d_w d_x sum_j q_j a_j + m_w (d_x sum_j a_j),
 *
 * an integer dot product per block plus one multiply-add with the block sum of
 * the activations, which is precomputed at quantization time.
 *
 * Weight layouts (repacked at load from GGUF blocks by quant_formats.py), per
 * row of K weights, K / 32 blocks, `q` bytes per block (struct of arrays:
 * bytes, scales and minimums live in three separate arrays):
 *
 *   kind 0, Q8: 32 bytes, q = signed value + 128; one f16 d;    m = -128 d
 *   kind 1, Q4: 16 bytes, byte j = q[j] | q[j + 16] << 4; f16 d and f16 m
 *   kind 2, Q5: Q4's 16 bytes + 4 bytes of high bits: bit i of byte j is bit 4
 *               of q[4 i + j]; f16 d and f16 m
 *   kind 3, Q6: Q4's 16 bytes + 8 bytes of high bit pairs: bits 2k, 2k+1 of
 *               byte j are bits 4, 5 of q[8 k + j]; two f16 d (one per 16
 *               values); m = -32 d
 *   kind 6, Q4 interleaved by 16 rows (Q4's values, scales and minimums
 *               regrouped for interleaved_avx512.h, which documents the
 *               layout; N a multiple of 16)
 *   kind 7, Q8 interleaved by 16 rows: the signed values q - 128 and the
 *               scales regrouped likewise; no minimums
 *   kind 8, Q5 interleaved by 16 rows: Q4I's layout of the low 4 bits, then
 *               per block one vector of the 16 rows' high-bit bytes
 *   kind 9, Q6 interleaved by 16 rows: Q4I's layout of the low 4 bits, then
 *               per block two vectors of the rows' high bit pairs; two
 *               scales per block, no minimums
 * Kinds 4 and 5 are float16 and bfloat16 rows (tq_matmul_half).
 *
 * The high-bit orders are chosen so one broadcast and one variable shift
 * spread them over a 32-byte vector (quant_kernels_isa.h).
 *
 * Instruction sets, chosen at run time by CPU features (tq_set_isa can force
 * a lower one, for tests): 0 portable C, 1 AVX2 + FMA + F16C (vpmaddubsw),
 * 2 AVX-512 VNNI (vpdpbusd on 256-bit vectors, AVX512VL), 3 AVX-512 VNNI on
 * 512-bit vectors (two blocks per instruction). Rows of W are split across
 * OpenMP threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "float_kernels.h"

#define QK 32
enum { K_Q8 = 0, K_Q4 = 1, K_Q5 = 2, K_Q6 = 3, K_F16 = 4, K_BF16 = 5, K_Q4I = 6, K_Q8I = 7, K_Q5I = 8, K_Q6I = 9 };
/* bytes of values per block and row (kinds 4, 5 have no blocks) */
static const int QBYTES[10] = {32, 16, 20, 24, 0, 0, 16, 32, 20, 24};
/* float16 scales per block and row */
#define NSCALES(kind) ((kind) == K_Q6 || (kind) == K_Q6I ? 2 : 1)
/* the same as a constant expression, and the inlining the SIMD headers rely on */
#define KIND_QBYTES(kind) ((kind) == K_Q8 ? 32 : (kind) == K_Q4 ? 16 : (kind) == K_Q5 ? 20 : 24)
#define IS_HALF(kind) ((kind) == K_F16 || (kind) == K_BF16)
#define IS_IL(kind) ((kind) == K_Q4I || (kind) == K_Q8I || (kind) == K_Q5I || (kind) == K_Q6I)
#define INLINE static inline __attribute__((always_inline))

/* Per row of quantized activations, 4 * K/32 floats: d[b] (the block's
 * scale), s[b] = d * sum(a) over the block, then s01[2 b + h] = d * sum(a)
 * over half h of it (16 values). Kept as planes so the minimum terms of a
 * whole row are one dot product (min_term). */
#define FA 4

/* Products of fewer block-rows (N * M * K/32) than this run on the calling
 * thread alone: waking the other threads costs more (tq_set_par_min).
 * Measured on a 2-vCPU VM, SmolLM2-135M Q4_1 (layer matrices of 18-55 k
 * block-rows at one row, the 49152 x 576 head 885 k): batch-1 TPOT 25.5 ms
 * with 4096, 22.4 ms with 100000 (only the head split), 25.5 ms single
 * threaded; at 16 rows splitting everything is 1.3x faster than not. */
static int64_t par_min = 100000;

/* Set that threshold; returns the previous one. */
int64_t tq_set_par_min(int64_t n) {
    const int64_t old = par_min;
    par_min = n;
    return old;
}

/* How the interleaved kernel prefetches weights a call reads once (IL_PREFETCH: calls of up to
 * IL_MR rows): 1, non-temporally (Q8I into L2); 0, into L1 like weights read again
 * (tq_set_stream_prefetch; the default is below IL_PREFETCH). */
static int il_stream_nta = 1;

/* Set that policy; returns the previous one. */
int tq_set_stream_prefetch(int nta) {
    const int old = il_stream_nta;
    il_stream_nta = nta != 0;
    return old;
}

/* Run the statement after `split` for a range [n0, n1) of [0, N) (it names
 * n0 and n1): all of it on this thread when `split` is false or the caller
 * runs inside an OpenMP region already (a chunk of the fused step: a nested
 * region would cost a team set-up for nothing), else one contiguous share
 * per thread of a new region. Kernels put their dispatch on the weight
 * kind inside the statement, so each instance sees its kind as a constant:
 * GCC outlines an OpenMP region before it inlines, so a region inside an
 * inline function that takes the kind as an argument runs one generic loop
 * (the kind tested per block, accumulators kept in memory). */
#define PAR_RANGE(N, split, ...)                                                          \
    do {                                                                                  \
        const int64_t n_all_ = (N);                                                       \
        if (!(split) || omp_get_level() > 0) {                                            \
            const int64_t n0 = 0, n1 = n_all_;                                            \
            __VA_ARGS__;                                                                  \
        } else {                                                                          \
            _Pragma("omp parallel")                                                       \
            {                                                                             \
                const int64_t t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();    \
                const int64_t n0 = n_all_ * t_ / nt_, n1 = n_all_ * (t_ + 1) / nt_;       \
                __VA_ARGS__;                                                              \
            }                                                                             \
        }                                                                                 \
    } while (0)

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float finish(float sum, int64_t r, int64_t n, const float *bias, const float *res, int64_t ldr) {
    if (bias) sum += bias[n];
    if (res) sum += res[r * ldr + n];
    return sum;
}

/* ------------------------------------------------------------ portable C */

static void unpack_c(int kind, const uint8_t *q, uint8_t *v) {
    if (kind == K_Q8) {
        memcpy(v, q, QK);
        return;
    }
    for (int j = 0; j < 16; j++) {
        v[j] = q[j] & 0x0f;
        v[j + 16] = q[j] >> 4;
    }
    if (kind == K_Q5)
        for (int e = 0; e < QK; e++) v[e] |= ((q[16 + (e & 3)] >> (e >> 2)) & 1) << 4;
    else if (kind == K_Q6)
        for (int e = 0; e < QK; e++) v[e] |= ((q[16 + (e & 7)] >> (2 * (e >> 3))) & 3) << 4;
}

/* scale per half block and minimum per half block of block b */
static inline void params_c(int kind, const uint16_t *d, const uint16_t *m, int64_t b, float ds[2], float ms[2]) {
    if (kind == K_Q6) {
        ds[0] = fp16_to_fp32(d[2 * b]);
        ds[1] = fp16_to_fp32(d[2 * b + 1]);
        ms[0] = -32.0f * ds[0];
        ms[1] = -32.0f * ds[1];
        return;
    }
    ds[0] = ds[1] = fp16_to_fp32(d[b]);
    ms[0] = ms[1] = kind == K_Q8 ? -128.0f * ds[0] : fp16_to_fp32(m[b]);
}

/* qa: int8 (bits 8, scale max|x| / 127) or int16 (bits 16, max|x| / 32767);
 * blocks b0 .. b1 - 1 of one row of nb blocks (x, qa, fa at the row's start) */
static void quantize_blocks_c(int bits, const float *x, int64_t nb, int64_t b0, int64_t b1, void *qa, float *fa) {
    const float qmax = bits == 8 ? 127.0f : 32767.0f;
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / qmax, id = amax > 0.0f ? qmax / amax : 0.0f;
        int s[2] = {0, 0};
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(xb[j] * id);
            if (bits == 8) ((int8_t *)qa)[b * QK + j] = (int8_t)q;
            else ((int16_t *)qa)[b * QK + j] = (int16_t)q;
            s[j >= 16] += q;
        }
        fa[b] = d;
        fa[nb + b] = d * (float)(s[0] + s[1]);
        fa[2 * nb + 2 * b] = d * (float)s[0];
        fa[2 * nb + 2 * b + 1] = d * (float)s[1];
    }
}

static void matmul_c(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                     const void *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                     const float *res, int64_t ldr) {
    const int64_t nb = K / QK, qb = QBYTES[kind];
#pragma omp parallel for if (N * M * nb >= par_min) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        for (int64_t r = 0; r < M; r++) {
            const float *f = fa + r * FA * nb;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t v[QK];
                float ds[2], ms[2];
                unpack_c(kind, wq + (n * nb + b) * qb, v);
                params_c(kind, d, m, b, ds, ms);
                int32_t s0 = 0, s1 = 0;
                for (int j = 0; j < QK; j++) {
                    const int32_t a = bits == 8 ? ((const int8_t *)qa)[(r * nb + b) * QK + j]
                                                : ((const int16_t *)qa)[(r * nb + b) * QK + j];
                    if (j < 16) s0 += (int32_t)v[j] * a;
                    else s1 += (int32_t)v[j] * a;
                }
                sum += f[b] * (ds[0] * (float)s0 + ds[1] * (float)s1) + ms[0] * f[2 * nb + 2 * b] +
                       ms[1] * f[2 * nb + 2 * b + 1];
            }
            y[r * ldy + n] = finish(sum, r, n, bias, res, ldr);
        }
    }
}

/* Kinds K_Q4I, K_Q5I, K_Q6I, K_Q8I (interleaved_avx512.h's layout): value
 * j of block b of row n (Q4I: q, 0..15; Q5I: 0..31; Q6I: 0..63; Q8I: the
 * signed q - 128), and the index of that block's scale (Q6I: of half h's)
 * and minimum in d and m. */
static inline int il_value(int kind, const uint8_t *wq, int64_t nb, int64_t n, int64_t b, int j) {
    const int t = j >> 2, lane = (int)(n % 16) * 4 + (j & 3);
    if (kind == K_Q8I) return ((const int8_t *)wq)[((n / 16) * nb + b) * 512 + t * 64 + lane];
    const uint8_t *blk = wq + ((n / 16) * nb + b) * (kind == K_Q4I ? 256 : kind == K_Q5I ? 320 : 384);
    const int low = (blk[(t >> 1) * 64 + lane] >> ((t & 1) * 4)) & 0x0f;
    if (kind == K_Q5I) return low | ((blk[256 + lane] >> t) & 1) << 4;
    if (kind == K_Q6I) return low | ((blk[256 + (t & 1) * 64 + lane] >> (t >> 1) * 2) & 3) << 4;
    return low;
}

static inline int64_t il_param(int kind, int64_t nb, int64_t n, int64_t b, int h) {
    return kind == K_Q6I ? ((n / 16) * nb + b) * 32 + h * 16 + n % 16 : ((n / 16) * nb + b) * 16 + n % 16;
}

/* The products of interleaved_avx512.h in portable C, the same arithmetic
 * (bit for bit equal results), for 8-bit or 16-bit activations. */
static void matmul_il_c(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                        const void *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                        const float *res, int64_t ldr) {
    const int64_t nb = K / QK;
#pragma omp parallel for if (N * M * nb >= par_min) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            const float *f = fa + r * FA * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot[2] = {0, 0}; /* Q6I: per half block */
                for (int j = 0; j < QK; j++) {
                    const int64_t i = (r * nb + b) * QK + j;
                    dot[kind == K_Q6I && j >= 16] +=
                        il_value(kind, wq, nb, n, b, j) * (bits == 8 ? ((const int8_t *)qa)[i] : ((const int16_t *)qa)[i]);
                }
                if (kind == K_Q6I) { /* d_w (d_x dot - 32 s_x) per half: m = -32 d */
                    for (int h = 0; h < 2; h++)
                        acc = fmaf(fp16_to_fp32(wd[il_param(kind, nb, n, b, h)]),
                                   fmaf((float)dot[h], f[b], -32.0f * f[2 * nb + 2 * b + h]), acc);
                    continue;
                }
                const int64_t pi = il_param(kind, nb, n, b, 0);
                acc = fmaf((float)dot[0], fp16_to_fp32(wd[pi]) * f[b], acc);
                if (kind != K_Q8I) acc = fmaf(fp16_to_fp32(wm[pi]), f[nb + b], acc);
            }
            y[r * ldy + n] = finish(acc, r, n, bias, res, ldr);
        }
}

/* Split 16-bit activations may be reused within one phase of the fused
 * decode step (decode_step.h): it sets planes_tag to a value unique to the
 * (step, phase) on each of its threads, during which the activations qa a
 * projection reads do not change, so a thread splits them into byte planes
 * (8-bit ones: Q8I's block sums) once a phase instead of once a chunk
 * (il_matmul_avx512). 0 (every other caller): split on every call. */
static _Thread_local uint64_t planes_tag;

/* --------------------------------------------------------------- x86 SIMD */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TQ_X86 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SUFFIX _avx2
#define VNNI 0
#include "quant_kernels_isa.h"
#undef SUFFIX
#undef VNNI
#pragma GCC pop_options

#pragma GCC push_options
/* avx512bf16 is in this region's target for panel_gemm_bf16.h and the
 * bfloat16 branch of panel_fill16; those run only for descriptors with bf16
 * set, which QuantKernels.linear_desc allows only where tq_has_bf16 (GCC
 * emits bfloat16 instructions for their intrinsics alone: no __bf16 type is
 * used here). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")
#define SUFFIX _vnni
#define VNNI 1
#include "quant_kernels_isa.h"
#undef SUFFIX
#undef VNNI
#include "quant_kernels_avx512.h"
#include "panel_gemm_avx512.h" /* and panel_gemm_bf16.h */
#include "interleaved_avx512.h"
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------- dispatch */

static int best_isa(void) {
#ifdef TQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return 3;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
#endif
    return 0;
}

static int isa = -1;

/* The best instruction set this CPU supports (see the top of this file). */
int tq_best_isa(void) { return best_isa(); }

/* Use instruction set `level` (clamped to what the CPU supports); returns the one in use. */
int tq_set_isa(int level) {
    int best = best_isa();
    isa = level < 0 || level > best ? best : level;
    return isa;
}

static inline int cur_isa(void) {
    if (isa < 0) isa = best_isa();
    return isa;
}

/* 1 when the CPU has AVX512_BF16 (the panel GEMM's bfloat16 products, panel_gemm_bf16.h). */
int tq_has_bf16(void) {
#ifdef TQ_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

/* Products of at least this many activation rows take the float panel GEMM
 * (panel_gemm_avx512.h) on the AVX-512 level (tq_set_panel_rows). Whole
 * decode steps of the default model on 2 threads, byte-split kernel vs
 * panel (docs/benchmarks.md): 4 rows 14.4 vs 21.5 ms, 6 rows 21.9 vs 24.2,
 * 8 rows 27.2 vs 25.2, 12 rows 39.8 vs 32.6. */
static int64_t panel_rows = 8;

/* Set that row count (n > 0; n <= 0 changes nothing); returns the previous one. */
int64_t tq_set_panel_rows(int64_t n) {
    const int64_t old = panel_rows;
    if (n > 0) panel_rows = n;
    return old;
}

/* Whether M rows of a part of `kind` under activation precision `bits` take
 * the panel GEMM: 16-bit (or float-weight) parts only, whose float GEMM
 * matches the integer kernels' precision; 8-bit activations keep their
 * integer kernels at every M, so their rounding does not depend on M, and
 * so do interleaved parts (K_Q4I, K_Q5I, K_Q6I, K_Q8I: one kernel for every M). */
static inline int panel_route(int64_t bits, int64_t kind, int64_t M) {
#ifdef TQ_X86
    return cur_isa() == 3 && M >= panel_rows && ((bits == 16 && kind < 4) || IS_HALF(kind));
#else
    (void)bits, (void)kind, (void)M;
    return 0;
#endif
}

#ifndef TQ_X86
#define PANEL_N 32
#endif

/* panel_gemm where it is built (the caller checked panel_route): float32
 * products from x (row stride ldx), or bfloat16 ones from xb [M, K] (the
 * same rows rounded by panel_x_bf16) when xb is not NULL. */
static inline int panel_call(int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                             const float *x, int64_t ldx, const uint16_t *xb, int64_t M, float *y, int64_t ldy,
                             const float *bias, const float *res, int64_t ldr, float *buf) {
#ifdef TQ_X86
    return panel_gemm(kind, wq, wd, wm, N, K, x, ldx, xb, M, y, ldy, bias, res, ldr, buf);
#else
    (void)kind, (void)wq, (void)wd, (void)wm, (void)N, (void)K, (void)x, (void)ldx, (void)xb, (void)M, (void)y;
    (void)ldy, (void)bias, (void)res, (void)ldr, (void)buf;
    return -1;
#endif
}

/* Round M rows of x (row stride ldx) to bfloat16 rows xb [M, K] for panel_call (K even). */
static inline void panel_x(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb) {
#ifdef TQ_X86
    panel_x_bf16(x, ldx, M, K, xb);
#else
    (void)x, (void)ldx, (void)M, (void)K, (void)xb;
#endif
}

/* Blocks b0 .. b1 - 1 of one row of nb blocks, as tq_quantize quantizes them
 * (x, qa and fa at the row's start; qa, fa laid out as tq_quantize's rows). */
static inline void quantize_blocks(int bits, const float *x, int64_t nb, int64_t b0, int64_t b1, void *qa, float *fa) {
#ifdef TQ_X86
    if (cur_isa() >= 1) {
        quantize_blocks_avx2(bits, x, nb, b0, b1, qa, fa);
        return;
    }
#endif
    quantize_blocks_c(bits, x, nb, b0, b1, qa, fa);
}

/* Quantize M rows of x (row stride ldx floats, K a multiple of 32) into
 * qa [M, K] (int8 for bits 8, int16 for bits 16) and fa [M, 4 K/32] (see FA). */
void tq_quantize(int bits, const float *x, int64_t ldx, int64_t M, int64_t K, void *qa, float *fa) {
    const int64_t nb = K / QK;
#pragma omp parallel for if (M * K >= (1 << 16)) schedule(static)
    for (int64_t r = 0; r < M; r++)
        quantize_blocks(bits, x + r * ldx, nb, 0, nb, (char *)qa + r * K * (bits / 8), fa + r * FA * nb);
}

/* y[r, n] = sum_k x[r, k] W[n, k] (+ bias[n]) (+ res[r, n]) for r < M, n < N,
 * from x quantized by tq_quantize with `bits`. y and res have row strides ldy
 * and ldr floats; bias and res may be NULL. */
void tq_matmul(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
               const void *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
               const float *res, int64_t ldr) {
    if (IS_IL(kind)) { /* any row count: a row's result does not depend on M */
#ifdef TQ_X86
        if (cur_isa() == 3 && il_matmul_avx512(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr) == 0)
            return;
#endif
        matmul_il_c(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr);
        return;
    }
#ifdef TQ_X86
    switch (cur_isa()) {
    case 3:
        matmul_avx512(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr);
        return;
    case 2:
        matmul_vnni(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr);
        return;
    case 1:
        matmul_avx2(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr);
        return;
    }
#endif
    matmul_c(kind, bits, wq, wd, wm, N, K, qa, fa, M, y, ldy, bias, res, ldr);
}

/* One projection y = x @ W^T (+ bias) (+ res), W stacked from parts along
 * the outputs (each a block kind, or float16 / bfloat16 as kinds 4 / 5),
 * described once by the caller: x is quantized once into a per-thread
 * buffer, then each part writes its columns of y (row stride n_total). */
void tq_matmul_half(int bf16, const uint16_t *w, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                    float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr);

#define TQ_MAX_PARTS 8
typedef struct {
    int64_t kind, n;
    const uint8_t *q;
    const uint16_t *d, *m;
} tq_part;

/* bf16: 1 when the panel GEMM multiplies bfloat16 values (bits 16, K even,
 * the CPU has AVX512_BF16: checked by the caller that builds the descriptor). */
typedef struct {
    int64_t nparts, bits, k, n_total;
    const float *bias;
    tq_part parts[TQ_MAX_PARTS];
    int64_t bf16;
} tq_linear_desc;

/* Whether M rows through L take the bfloat16 panel GEMM (every part does then: bits 16). */
static inline int panel_bf16(const tq_linear_desc *L, int64_t M) { return L->bf16 && panel_route(L->bits, 0, M); }

static _Thread_local void *act_buf;
static _Thread_local size_t act_cap;

static void *scratch(size_t bytes) {
    if (bytes > act_cap) {
        free(act_buf);
        act_cap = bytes * 2;
        act_buf = aligned_alloc(64, (act_cap + 63) / 64 * 64);
        if (!act_buf) act_cap = 0;
    }
    return act_buf;
}

/* Returns 0, or -1 when the activation (or a panel GEMM's) buffer cannot be allocated. */
int tq_linear(const tq_linear_desc *L, const float *x, int64_t ldx, int64_t M, float *y, const float *res,
              int64_t ldr) {
    const int64_t K = L->k, nb = K / QK;
    if (M <= 0) return 0; /* e.g. a pass whose rows want no logits: no buffer to ask for */
    void *qa = 0;
    float *fa = 0;
    uint16_t *xb = 0;
    if (panel_bf16(L, M)) { /* then every part takes the panel (bits 16): scratch() is not asked again below */
        xb = scratch((size_t)M * K * sizeof(uint16_t));
        if (!xb) return -1;
        panel_x(x, ldx, M, K, xb);
    }
    for (int64_t i = 0; i < L->nparts; i++)
        if (!IS_HALF(L->parts[i].kind) && !qa && !panel_route(L->bits, L->parts[i].kind, M)) {
            const size_t qbytes = (size_t)(M * K * (L->bits / 8) + 63) / 64 * 64;
            char *buf = scratch(qbytes + (size_t)M * FA * nb * sizeof(float));
            if (!buf) return -1;
            qa = buf;
            fa = (float *)(buf + qbytes);
            tq_quantize((int)L->bits, x, ldx, M, K, qa, fa);
        }
    int64_t n0 = 0;
    for (int64_t i = 0; i < L->nparts; i++) {
        const tq_part *p = &L->parts[i];
        const float *b = L->bias ? L->bias + n0 : 0, *r = res ? res + n0 : 0;
        if (panel_route(L->bits, p->kind, M)) {
            if (panel_call((int)p->kind, p->q, p->d, p->m, p->n, K, x, ldx, xb, M, y + n0, L->n_total, b, r, ldr, 0))
                return -1;
        } else if (IS_HALF(p->kind))
            tq_matmul_half(p->kind == 5, (const uint16_t *)p->q, p->n, K, x, ldx, M, y + n0, L->n_total, b, r, ldr);
        else
            tq_matmul((int)p->kind, (int)L->bits, p->q, p->d, p->m, p->n, K, qa, fa, M, y + n0, L->n_total, b, r, ldr);
        n0 += p->n;
    }
    return 0;
}

/* Dequantize R rows of W (rows[i], or row i when rows is NULL) into out [R, K] float32. */
void tq_dequantize(int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t K,
                   const int64_t *rows, int64_t R, float *out) {
    if (IS_IL(kind)) {
        const int64_t nb = K / QK;
#pragma omp parallel for if (R * K >= (1 << 18)) schedule(static)
        for (int64_t i = 0; i < R; i++) {
            const int64_t n = rows ? rows[i] : i;
            for (int64_t b = 0; b < nb; b++)
                for (int j = 0; j < QK; j++) {
                    const int64_t pi = il_param(kind, nb, n, b, j >= 16);
                    const float d = fp16_to_fp32(wd[pi]);
                    const float m = kind == K_Q8I ? 0.0f : kind == K_Q6I ? -32.0f * d : fp16_to_fp32(wm[pi]);
                    out[i * K + b * QK + j] = fmaf(d, (float)il_value(kind, wq, nb, n, b, j), m);
                }
        }
        return;
    }
#ifdef TQ_X86
    if (cur_isa() >= 1) {
        dequantize_avx2(kind, wq, wd, wm, K, rows, R, out);
        return;
    }
#endif
    const int64_t nb = K / QK, qb = QBYTES[kind];
#pragma omp parallel for if (R * K >= (1 << 18)) schedule(static)
    for (int64_t i = 0; i < R; i++) {
        const int64_t n = rows ? rows[i] : i;
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t v[QK];
            float ds[2], ms[2];
            unpack_c(kind, wq + (n * nb + b) * qb, v);
            params_c(kind, d, m, b, ds, ms);
            float *o = out + i * K + b * QK;
            for (int j = 0; j < QK; j++) o[j] = ds[j >= 16] * (float)v[j] + ms[j >= 16];
        }
    }
}

/* y[r, n] = sum_k x[r, k] W[n, k] (+ bias) (+ res) for W in float16 (bf16 = 0)
 * or bfloat16 (bf16 = 1), [N, K] row-major, x float32 [M, K] (row stride ldx). */
void tq_matmul_half(int bf16, const uint16_t *w, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                    float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
#ifdef TQ_X86
    if (cur_isa() >= 1) {
        matmul_half_avx2(bf16, w, N, K, x, ldx, M, y, ldy, bias, res, ldr);
        return;
    }
#endif
#pragma omp parallel for if (N * M * K >= (1 << 16)) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const uint16_t h = w[n * K + k];
                float wv;
                if (bf16) {
                    uint32_t bits = (uint32_t)h << 16;
                    memcpy(&wv, &bits, 4);
                } else {
                    wv = fp16_to_fp32(h);
                }
                sum += wv * x[r * ldx + k];
            }
            y[r * ldy + n] = finish(sum, r, n, bias, res, ldr);
        }
}

#include "kv_int8.h" /* int8 KV rows, for the fused step */
#include "decode_step.h"
#include "repack.h" /* GGUF blocks into the kinds at load, and the 16-row interleave */

/* The boundary as the C compiler lays it out (abi.h; checked by abi.py). */
static const tq_abi_entry abi_table[] = {
    {"version", TQ_ABI_VERSION},
    TQ_ABI_SIZE(tq_part), TQ_ABI_FIELD(tq_part, kind), TQ_ABI_FIELD(tq_part, n), TQ_ABI_FIELD(tq_part, q),
    TQ_ABI_FIELD(tq_part, d), TQ_ABI_FIELD(tq_part, m),
    TQ_ABI_SIZE(tq_linear_desc), TQ_ABI_FIELD(tq_linear_desc, nparts), TQ_ABI_FIELD(tq_linear_desc, bits),
    TQ_ABI_FIELD(tq_linear_desc, k), TQ_ABI_FIELD(tq_linear_desc, n_total), TQ_ABI_FIELD(tq_linear_desc, bias),
    TQ_ABI_FIELD(tq_linear_desc, parts), TQ_ABI_FIELD(tq_linear_desc, bf16),
    TQ_ABI_SIZE(tq_layer_desc), TQ_ABI_FIELD(tq_layer_desc, ln1), TQ_ABI_FIELD(tq_layer_desc, ln2),
    TQ_ABI_FIELD(tq_layer_desc, qkv), TQ_ABI_FIELD(tq_layer_desc, o), TQ_ABI_FIELD(tq_layer_desc, gate_up),
    TQ_ABI_FIELD(tq_layer_desc, down), TQ_ABI_FIELD(tq_layer_desc, k_pool), TQ_ABI_FIELD(tq_layer_desc, v_pool),
    TQ_ABI_SIZE(tq_attn_group), TQ_ABI_FIELD(tq_attn_group, rows), TQ_ABI_FIELD(tq_attn_group, row_start),
    TQ_ABI_FIELD(tq_attn_group, B), TQ_ABI_FIELD(tq_attn_group, L), TQ_ABI_FIELD(tq_attn_group, kv_slots),
    TQ_ABI_FIELD(tq_attn_group, bias), TQ_ABI_FIELD(tq_attn_group, probe), TQ_ABI_FIELD(tq_attn_group, probe_layers),
    TQ_ABI_SIZE(tq_decoder_desc), TQ_ABI_FIELD(tq_decoder_desc, n_layers), TQ_ABI_FIELD(tq_decoder_desc, hidden),
    TQ_ABI_FIELD(tq_decoder_desc, nh), TQ_ABI_FIELD(tq_decoder_desc, nkv), TQ_ABI_FIELD(tq_decoder_desc, hd),
    TQ_ABI_FIELD(tq_decoder_desc, ffn), TQ_ABI_FIELD(tq_decoder_desc, eps), TQ_ABI_FIELD(tq_decoder_desc, scale),
    TQ_ABI_FIELD(tq_decoder_desc, layers), TQ_ABI_FIELD(tq_decoder_desc, final_norm),
    TQ_ABI_FIELD(tq_decoder_desc, head), TQ_ABI_FIELD(tq_decoder_desc, kv_kind),
    TQ_ABI_SIZE(tq_lora_mat), TQ_ABI_FIELD(tq_lora_mat, at), TQ_ABI_FIELD(tq_lora_mat, bt), TQ_ABI_FIELD(tq_lora_mat, r),
    TQ_ABI_FIELD(tq_lora_mat, scale), TQ_ABI_FIELD(tq_lora_mat, dtype), TQ_ABI_FIELD(tq_lora_mat, nblocks),
    TQ_ABI_FIELD(tq_lora_mat, blocks), TQ_ABI_ENUM(TQ_LORA_F32), TQ_ABI_ENUM(TQ_LORA_F16), TQ_ABI_ENUM(TQ_LORA_I8), TQ_ABI_ENUM(TQ_LORA_W),
    TQ_ABI_SIZE(tq_lora_batch), TQ_ABI_FIELD(tq_lora_batch, n_adapters), TQ_ABI_FIELD(tq_lora_batch, adapters),
    TQ_ABI_FIELD(tq_lora_batch, row_adapter),
    TQ_ABI_ENUM(TQ_MAX_PARTS), TQ_ABI_ENUM(TQ_LORA_MAX_BLOCKS),
    TQ_ABI_ENUM(K_Q8), TQ_ABI_ENUM(K_Q4), TQ_ABI_ENUM(K_Q5), TQ_ABI_ENUM(K_Q6), TQ_ABI_ENUM(K_F16),
    TQ_ABI_ENUM(K_BF16), TQ_ABI_ENUM(K_Q4I), TQ_ABI_ENUM(K_Q8I), TQ_ABI_ENUM(K_Q5I), TQ_ABI_ENUM(K_Q6I),
    TQ_ABI_ENUM(TQ_KV_F32), TQ_ABI_ENUM(TQ_KV_Q8), TQ_ABI_ENUM(TQ_KV_F16),
    TQ_ABI_ENUM(G_Q8_0), TQ_ABI_ENUM(G_Q4_0), TQ_ABI_ENUM(G_Q4_1), TQ_ABI_ENUM(G_Q5_0), TQ_ABI_ENUM(G_Q5_1),
    TQ_ABI_ENUM(G_Q4_K), TQ_ABI_ENUM(G_Q5_K), TQ_ABI_ENUM(G_Q6_K),
    TQ_ABI_END,
};

const tq_abi_entry *tq_abi(void) { return abi_table; }
