/* Fused float32 CPU kernels of the decode path, called through ctypes by
 * tartlet/engine/kernels/cpu_kernels.py (which compiles this file once per machine).
 *
 * Each replaces a chain of small PyTorch ops whose per-call overhead, not
 * their arithmetic, dominates a decode step on a CPU:
 *
 *   tq_rms_norm                  RMSNorm (Zhang & Sennrich, 2019) as in HF Llama:
 *                                w * (x * rsqrt(mean(x^2) + eps)).
 *   tq_rope_qkv_store            rotary embedding (Su et al., 2021; HF rotate_half
 *                                layout) of the query and key heads of a fused QKV
 *                                row, queries to a buffer, keys and values straight
 *                                into their page-pool slots.
 *   tq_paged_decode_attention    one query token per sequence attending to its
 *                                keys/values where they lie in the page pool (no
 *                                gather into a padded copy), grouped-query heads
 *                                sharing each key/value read; optionally copying
 *                                the softmax weights out (the attention probe).
 *   tq_argmax_rows               greedy sampling: the first maximum of each row of
 *                                logits, as torch.argmax.
 *   tq_argmax_masked             greedy sampling under a logit mask: the first
 *                                maximum over the allowed positions of one row.
 *
 * Layouts (all float32, row-major, contiguous unless a stride is given):
 *   KV pool layer  [slots, nkv, hd]
 *   queries        [rows, nh, hd]
 *   slots          int64 [B, L] pool slot of each attended position
 *   bias           float [B, L] additive mask (0 or -inf), or NULL
 *
 * int8 pools (kv_int8.h): tq_rope_qkv_store_q8 and tq_paged_decode_attention_q8 are
 * the same two kernels over pool layers int8 [slots, nkv, hd + 4] (each row's
 * quants, then its float32 scale); float16 pools: tq_rope_qkv_store_f16 and
 * tq_paged_decode_attention_f16 over layers of IEEE binary16 [slots, nkv, hd]
 * (keys and values rounded to nearest even as they are written).
 *
 * The kernels that need per-thread scratch (the attentions and the int8 and
 * float16 RoPE + KV writes) return 0, or -1 when it cannot be allocated:
 * then every thread skips the work (the threads agree at a barrier) and the
 * outputs are left untouched.
 *
 * No -ffast-math: masked positions are -inf and must stay so. With AVX2, FMA
 * and F16C (compiled with -mavx2 -mfma -mf16c) the dot products and the
 * weighted sum of values use intrinsics; otherwise plain loops give the same
 * results up to float32 summation order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "abi.h"
#include "float_kernels.h"
#include "kv_int8.h"

void tq_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t H, float eps)
{
#pragma omp parallel for if (T * H >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++)
        rms_norm_row(x + t * x_stride, w, out + t * H, H, eps);
}

/* Inside a parallel region: whether any thread's scratch allocation (p of
 * bytes) failed; each reports its own, all threads get the same answer after a
 * barrier, so all of them skip or all enter the worksharing loop that follows. */
static int team_alloc_failed(const void *p, size_t bytes, int *failed)
{
    if (!p && bytes) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp barrier
    int f;
#pragma omp atomic read
    f = *failed;
    return f;
}

/* The RoPE + KV write of T rows into pools of `kind`; -1 when the scratch
 * row cannot be allocated (nothing written then). */
static int rope_store(int kind, const float *qkv, const float *cos_, const float *sin_, float *q_out, void *k_pool,
                      void *v_pool, const int64_t *write_slots, int64_t T, int64_t nh, int64_t nkv, int64_t hd)
{
    const int64_t half = hd / 2, row = (nh + 2 * nkv) * hd;
    int failed = 0;
#pragma omp parallel if (T >= 64)
    {
        const size_t bytes = kind == TQ_KV_F32 ? 0 : sizeof(float) * (size_t)hd;
        float *tmp = bytes ? malloc(bytes) : NULL;
        if (!team_alloc_failed(tmp, bytes, &failed)) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const float *src = qkv + t * row, *c = cos_ + t * half, *s = sin_ + t * half;
                float *q = q_out + t * nh * hd;
                if (kind == TQ_KV_Q8)
                    rope_store_row_q8(src, c, s, q, k_pool, v_pool, write_slots[t], nh, nkv, hd, tmp);
                else if (kind == TQ_KV_F16)
                    rope_store_row_f16(src, c, s, q, k_pool, v_pool, write_slots[t], nh, nkv, hd, tmp);
                else
                    rope_store_row(src, c, s, q, k_pool, v_pool, write_slots[t], nh, nkv, hd);
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}

/* qkv [T, (nh + 2 nkv) hd]; cos, sin [T, hd/2]; q_out [T, nh, hd];
 * k_pool, v_pool [slots, nkv, hd]; write_slots int64 [T]. */
void tq_rope_qkv_store(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_pool, float *v_pool,
                    const int64_t *write_slots, int64_t T, int64_t nh, int64_t nkv, int64_t hd)
{
    rope_store(TQ_KV_F32, qkv, cos_, sin_, q_out, k_pool, v_pool, write_slots, T, nh, nkv, hd);
}

/* tq_rope_qkv_store writing int8 rows: k_pool, v_pool int8 [slots, nkv, hd + 4]
 * (kv_int8.h); the other arguments as tq_rope_qkv_store. */
int tq_rope_qkv_store_q8(const float *qkv, const float *cos_, const float *sin_, float *q_out, int8_t *k_pool,
                      int8_t *v_pool, const int64_t *write_slots, int64_t T, int64_t nh, int64_t nkv, int64_t hd)
{
    return rope_store(TQ_KV_Q8, qkv, cos_, sin_, q_out, k_pool, v_pool, write_slots, T, nh, nkv, hd);
}

/* tq_rope_qkv_store writing float16 rows: k_pool, v_pool binary16 [slots, nkv,
 * hd]; the other arguments as tq_rope_qkv_store. */
int tq_rope_qkv_store_f16(const float *qkv, const float *cos_, const float *sin_, float *q_out, uint16_t *k_pool,
                       uint16_t *v_pool, const int64_t *write_slots, int64_t T, int64_t nh, int64_t nkv, int64_t hd)
{
    return rope_store(TQ_KV_F16, qkv, cos_, sin_, q_out, k_pool, v_pool, write_slots, T, nh, nkv, hd);
}

/* Decode attention over pools of `kind` (see tq_paged_decode_attention). Work
 * is split over (sequence, KV head); each task keeps its g = nh / nkv heads'
 * scores in scratch, and copies their softmax weights to probe when it is
 * not NULL. */
static int paged_attention(int kind, const float *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                           const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start, float *out,
                           int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale, float *probe)
{
    const int64_t g = nh / nkv, row = nkv * hd;
    int failed = 0;
    /* a short attention (one sequence of ~100 tokens: ~20 us) is not worth waking the other threads */
#pragma omp parallel if (B * L * nh * hd >= (1 << 20))
    {
        const size_t bytes = sizeof(float) * (size_t)(L * g);
        float *p = malloc(bytes);
        if (!team_alloc_failed(p, bytes, &failed)) {
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < B; b++)
                for (int64_t kh = 0; kh < nkv; kh++) {
                    const int64_t r = rows ? rows[b] : row_start + b;
                    const float *qh = q + r * q_stride + kh * g * hd, *bb = bias ? bias + b * L : NULL;
                    float *oh = out + r * nh * hd + kh * g * hd;
                    float *pr = probe ? probe + (b * nh + kh * g) * L : NULL;
                    if (kind == TQ_KV_Q8)
                        attend_kv_head_q8(qh, k_pool, v_pool, slots + b * L, bb, L, g, hd, nkv, kh, scale, p, oh, pr);
                    else if (kind == TQ_KV_F16)
                        attend_kv_head_f16(qh, k_pool, v_pool, slots + b * L, bb, L, g, hd, row, kh, scale, p, oh, pr);
                    else
                        attend_kv_head(qh, k_pool, v_pool, slots + b * L, bb, L, g, hd, row, kh, scale, p, oh, pr);
                }
        }
        free(p);
    }
    return failed ? -1 : 0;
}

/* q: query b at q + (row_start + b or rows[b]) * q_stride, heads [nh, hd];
 * out: the same row of out, [nh * hd]; pools float32 [slots, nkv, hd].
 * probe: NULL, or float32 [B, nh, L] that receives every query head's
 * softmax weights over its L slots (the attention probe; masked slots 0). */
int tq_paged_decode_attention(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
                           const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start,
                           float *out, int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale,
                           float *probe)
{
    return paged_attention(TQ_KV_F32, q, q_stride, k_pool, v_pool, slots, bias, rows, row_start, out, B, L, nh, nkv, hd,
                           scale, probe);
}

/* tq_paged_decode_attention over int8 pools k_pool, v_pool [slots, nkv, hd + 4]
 * (kv_int8.h); the other arguments as tq_paged_decode_attention. */
int tq_paged_decode_attention_q8(const float *q, int64_t q_stride, const int8_t *k_pool, const int8_t *v_pool,
                              const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start,
                              float *out, int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale,
                              float *probe)
{
    return paged_attention(TQ_KV_Q8, q, q_stride, k_pool, v_pool, slots, bias, rows, row_start, out, B, L, nh, nkv, hd,
                           scale, probe);
}

/* tq_paged_decode_attention over float16 pools k_pool, v_pool [slots, nkv, hd];
 * the other arguments as tq_paged_decode_attention. */
int tq_paged_decode_attention_f16(const float *q, int64_t q_stride, const uint16_t *k_pool, const uint16_t *v_pool,
                               const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start,
                               float *out, int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale,
                               float *probe)
{
    return paged_attention(TQ_KV_F16, q, q_stride, k_pool, v_pool, slots, bias, rows, row_start, out, B, L, nh, nkv, hd,
                           scale, probe);
}

/* Rows scanned in blocks of this many values: the first pass keeps each
 * block's maximum, the second scans only the block holding the answer. */
#define ARGMAX_BLOCK 1024

/* The first maximum of row r [V] over the positions mask [V] allows
 * (nonzero; mask NULL: all), as torch.argmax gives it for the row with the
 * others set to -inf: a NaN at an allowed position counts as larger than
 * any number (the first one wins), -0.0 equals 0.0; when every allowed
 * value is -inf, the first allowed position (torch: 0, allowed or not); -1
 * when nothing is allowed. */
static inline int64_t argmax_row(const float *r, const uint8_t *mask, int64_t V)
{
    float best = -INFINITY;
    int64_t blk = -1, first = -1;
    int nan = 0;
    for (int64_t b0 = 0; b0 < V; b0 += ARGMAX_BLOCK) {
        const int64_t n = V - b0 < ARGMAX_BLOCK ? V - b0 : ARGMAX_BLOCK;
        float m = -INFINITY;
        int bad = 0, any = 1;
        if (mask) {
            any = 0;
#pragma omp simd reduction(max : m) reduction(| : bad, any)
            for (int64_t i = 0; i < n; i++) {
                const float v = mask[b0 + i] ? r[b0 + i] : -INFINITY;
                m = v > m ? v : m;
                bad |= v != v;
                any |= mask[b0 + i] != 0;
            }
        } else {
#pragma omp simd reduction(max : m) reduction(| : bad)
            for (int64_t i = 0; i < n; i++) {
                const float v = r[b0 + i];
                m = v > m ? v : m;
                bad |= v != v;
            }
        }
        if (any && first < 0)
            first = b0;
        if (bad) { /* the first allowed NaN is the answer: it is in this block */
            nan = 1;
            blk = b0;
            break;
        }
        if (m > best) { /* strictly: an equal maximum later does not move the answer */
            best = m;
            blk = b0;
        }
    }
    if (first < 0)
        return -1;
    if (blk < 0) /* every allowed value is -inf */
        blk = first;
    const int64_t end = blk + ARGMAX_BLOCK < V ? blk + ARGMAX_BLOCK : V;
    for (int64_t i = blk; i < end; i++)
        if ((!mask || mask[i]) && (nan ? r[i] != r[i] : r[i] == best))
            return i;
    return -1; /* not reached: the block holds an allowed position with that value */
}

/* out[s] = index of the first maximum of row s of x [S, V] (row stride ld),
 * as torch.argmax gives it (argmax_row; a row of -inf gives 0). Greedy
 * sampling of a decode step's logits: PyTorch's reduction takes ~110 us for
 * one 49,152-value row and ~5.3 ms for 64 (docs/benchmarks.md). */
void tq_argmax_rows(const float *x, int64_t ld, int64_t S, int64_t V, int64_t *out)
{
#pragma omp parallel for if (S * V >= (1 << 20)) schedule(static)
    for (int64_t s = 0; s < S; s++) out[s] = argmax_row(x + s * ld, NULL, V);
}

/* The first maximum of x [V] over the allowed positions (mask [V], nonzero
 * = allowed; argmax_row): greedy sampling under a logit mask (a grammar's)
 * without the masked copy of the row, one pass over the row and its mask. */
int64_t tq_argmax_masked(const float *x, const uint8_t *mask, int64_t V) { return argmax_row(x, mask, V); }

/* The boundary (abi.h; checked by abi.py): no structs cross it here, only
 * the KV kinds the entry points are named after. */
static const tq_abi_entry abi_table[] = {
    {"version", TQ_ABI_VERSION},
    TQ_ABI_ENUM(TQ_KV_F32), TQ_ABI_ENUM(TQ_KV_Q8), TQ_ABI_ENUM(TQ_KV_F16),
    TQ_ABI_END,
};

const tq_abi_entry *tq_abi(void) { return abi_table; }
