/* Fused float32 CPU kernels of the decode path, called through ctypes by
 * tartlet/engine/cpu_kernels.py (which compiles this file once per machine).
 *
 * Each replaces a chain of small PyTorch ops whose per-call overhead, not
 * their arithmetic, dominates a decode step on a CPU:
 *
 *   rms_norm               RMSNorm (Zhang & Sennrich, 2019) as in HF Llama:
 *                          w * (x * rsqrt(mean(x^2) + eps)).
 *   rope_qkv_store         rotary embedding (Su et al., 2021; HF rotate_half
 *                          layout) of the query and key heads of a fused QKV
 *                          row, queries to a buffer, keys and values straight
 *                          into their page-pool slots.
 *   paged_decode_attention one query token per sequence attending to its
 *                          keys/values where they lie in the page pool (no
 *                          gather into a padded copy), grouped-query heads
 *                          sharing each key/value read.
 *
 * Layouts (all float32, row-major, contiguous unless a stride is given):
 *   KV pool layer  [slots, nkv, hd]
 *   queries        [rows, nh, hd]
 *   slots          int64 [B, L] pool slot of each attended position
 *   bias           float [B, L] additive mask (0 or -inf), or NULL
 *
 * No -ffast-math: masked positions are -inf and must stay so.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t H, float eps)
{
#pragma omp parallel for if (T * H >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * H;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++)
            ss += xr[i] * xr[i];
        const float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++)
            o[i] = w[i] * (xr[i] * r);
    }
}

/* qkv [T, (nh + 2 nkv) hd]; cos, sin [T, hd/2]; q_out [T, nh, hd];
 * k_pool, v_pool [slots, nkv, hd]; write_slots int64 [T]. */
void rope_qkv_store(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_pool, float *v_pool,
                    const int64_t *write_slots, int64_t T, int64_t nh, int64_t nkv, int64_t hd)
{
    const int64_t half = hd / 2, row = (nh + 2 * nkv) * hd;
#pragma omp parallel for if (T >= 64) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *src = qkv + t * row;
        const float *c = cos_ + t * half, *s = sin_ + t * half;
        for (int64_t h = 0; h < nh + nkv; h++) {
            const float *x = src + h * hd;
            float *o = h < nh ? q_out + (t * nh + h) * hd : k_pool + (write_slots[t] * nkv + (h - nh)) * hd;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                o[i] = a * c[i] - b * s[i];
                o[i + half] = b * c[i] + a * s[i];
            }
        }
        const float *v = src + (nh + nkv) * hd;
        float *vo = v_pool + write_slots[t] * nkv * hd;
#pragma omp simd
        for (int64_t i = 0; i < nkv * hd; i++)
            vo[i] = v[i];
    }
}

/* q: query b at q + (row_start + b or rows[b]) * q_stride, heads [nh, hd];
 * out: the same row of out, [nh * hd]. scratch is allocated per thread. */
void paged_decode_attention(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start,
                            float *out, int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale)
{
    const int64_t g = nh / nkv;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (size_t)(L * g));
        float *acc = malloc(sizeof(float) * (size_t)(g * hd));
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t kh = 0; kh < nkv; kh++) {
                const int64_t r = rows ? rows[b] : row_start + b;
                const float *qh = q + r * q_stride + kh * g * hd; /* the g query heads of this KV head */
                const int64_t *sl = slots + b * L;
                const float *bb = bias ? bias + b * L : NULL;
                for (int64_t j = 0; j < L; j++) {
                    if (bb && isinf(bb[j])) {
                        for (int64_t h = 0; h < g; h++)
                            p[h * L + j] = -INFINITY;
                        continue;
                    }
                    const float *k = k_pool + (sl[j] * nkv + kh) * hd;
                    for (int64_t h = 0; h < g; h++) {
                        const float *qq = qh + h * hd;
                        float d = 0.f;
#pragma omp simd reduction(+ : d)
                        for (int64_t i = 0; i < hd; i++)
                            d += qq[i] * k[i];
                        p[h * L + j] = d * scale + (bb ? bb[j] : 0.f);
                    }
                }
                for (int64_t h = 0; h < g; h++) {
                    float *ph = p + h * L, m = -INFINITY, sum = 0.f;
                    for (int64_t j = 0; j < L; j++)
                        m = ph[j] > m ? ph[j] : m;
                    for (int64_t j = 0; j < L; j++) {
                        ph[j] = isinf(ph[j]) ? 0.f : expf(ph[j] - m);
                        sum += ph[j];
                    }
                    const float inv = 1.f / sum;
                    for (int64_t j = 0; j < L; j++)
                        ph[j] *= inv;
                }
                for (int64_t i = 0; i < g * hd; i++)
                    acc[i] = 0.f;
                for (int64_t j = 0; j < L; j++) {
                    if (bb && isinf(bb[j]))
                        continue;
                    const float *v = v_pool + (sl[j] * nkv + kh) * hd;
                    for (int64_t h = 0; h < g; h++) {
                        const float pj = p[h * L + j];
                        float *a = acc + h * hd;
#pragma omp simd
                        for (int64_t i = 0; i < hd; i++)
                            a[i] += pj * v[i];
                    }
                }
                float *o = out + r * nh * hd + kh * g * hd;
                for (int64_t i = 0; i < g * hd; i++)
                    o[i] = acc[i];
            }
        }
        free(acc);
        free(p);
    }
}
