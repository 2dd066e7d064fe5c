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
 * No -ffast-math: masked positions are -inf and must stay so. With AVX2 and
 * FMA (compiled with -mavx2 -mfma) the dot products and the weighted sum of
 * values use intrinsics; otherwise plain loops give the same results.
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

/* exp(x) for x <= 0, -inf giving 0: Cephes' expf (range reduction by
 * ln 2 split in two, degree-6 polynomial), relative error ~1e-7; written
 * without calls or branches so softmax loops vectorise. */
static inline float exp_nonpositive(float x)
{
    const float xc = x > -87.0f ? x : -87.0f;
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x == -INFINITY ? 0.0f : p * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TARTLET_AVX2 1
#endif

static inline float dot(const float *a, const float *b, int64_t n)
{
#ifdef TARTLET_AVX2
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        s0 = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        return _mm_cvtss_f32(h);
    }
#endif
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int64_t i = 0; i < n; i++)
        d += a[i] * b[i];
    return d;
}

/* o[0:hd] = sum_j p[j] * v_pool[slot[j]] (row offset kv_off), skipping p[j] == 0. */
static void weighted_values(const float *p, const int64_t *sl, int64_t L, const float *v_pool, int64_t row, int64_t kv_off,
                            int64_t hd, float *o)
{
#ifdef TARTLET_AVX2
    if (hd % 64 == 0) { /* 64 columns at a time, accumulators in registers */
        for (int64_t c = 0; c < hd; c += 64) {
            __m256 a[8];
            for (int k = 0; k < 8; k++)
                a[k] = _mm256_setzero_ps();
            for (int64_t j = 0; j < L; j++) {
                if (p[j] == 0.f)
                    continue;
                const __m256 pj = _mm256_set1_ps(p[j]);
                const float *v = v_pool + sl[j] * row + kv_off + c;
                for (int k = 0; k < 8; k++)
                    a[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * k), a[k]);
            }
            for (int k = 0; k < 8; k++)
                _mm256_storeu_ps(o + c + 8 * k, a[k]);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < hd; i++)
        o[i] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        if (p[j] == 0.f)
            continue;
        const float *v = v_pool + sl[j] * row + kv_off;
#pragma omp simd
        for (int64_t i = 0; i < hd; i++)
            o[i] += p[j] * v[i];
    }
}

/* q: query b at q + (row_start + b or rows[b]) * q_stride, heads [nh, hd];
 * out: the same row of out, [nh * hd]. Work is split over (sequence, KV
 * head); each task keeps its g = nh / nkv heads' scores in scratch. */
void paged_decode_attention(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
                            const int64_t *slots, const float *bias, const int64_t *rows, int64_t row_start,
                            float *out, int64_t B, int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale)
{
    const int64_t g = nh / nkv, row = nkv * hd;
    /* a short attention (one sequence of ~100 tokens: ~20 us) is not worth waking the other threads */
#pragma omp parallel if (B * L * nh * hd >= (1 << 20))
    {
        float *p = malloc(sizeof(float) * (size_t)(L * g));
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t kh = 0; kh < nkv; kh++) {
                const int64_t r = rows ? rows[b] : row_start + b;
                const float *qh = q + r * q_stride + kh * g * hd; /* the g query heads of this KV head */
                const int64_t *sl = slots + b * L;
                const float *bb = bias ? bias + b * L : NULL;
                for (int64_t j = 0; j < L; j++) {
                    if (bb && bb[j] == -INFINITY) {
                        for (int64_t h = 0; h < g; h++)
                            p[h * L + j] = -INFINITY;
                        continue;
                    }
                    const float *k = k_pool + sl[j] * row + kh * hd;
                    for (int64_t h = 0; h < g; h++)
                        p[h * L + j] = dot(qh + h * hd, k, hd) * scale + (bb ? bb[j] : 0.f);
                }
                for (int64_t h = 0; h < g; h++) {
                    float *ph = p + h * L, m = -INFINITY, sum = 0.f;
                    for (int64_t j = 0; j < L; j++)
                        m = ph[j] > m ? ph[j] : m;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < L; j++) {
                        ph[j] = exp_nonpositive(ph[j] - m);
                        sum += ph[j];
                    }
                    const float inv = 1.f / sum;
#pragma omp simd
                    for (int64_t j = 0; j < L; j++)
                        ph[j] *= inv;
                    weighted_values(ph, sl, L, v_pool, row, kh * hd, hd, out + r * nh * hd + (kh * g + h) * hd);
                }
            }
        }
        free(p);
    }
}
