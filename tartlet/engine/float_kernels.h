/* Float32 building blocks shared by cpu_kernels.c (the per-op decode kernels
 * PyTorch's path calls) and quant_kernels.c (the fused decode step): the
 * softmax exponential, dot products, the weighted sum of values and one
 * attention task. Static, so each library gets its own copy; vectorised with
 * AVX2 + FMA intrinsics when the including file is compiled with them
 * (-mavx2 -mfma), plain loops otherwise. No -ffast-math: masked positions
 * are -inf and must stay so. Layouts as in cpu_kernels.c. */
#ifndef TARTLET_FLOAT_KERNELS_H
#define TARTLET_FLOAT_KERNELS_H
#include <math.h>
#include <stdint.h>

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

/* ph [L] <- softmax(ph), the running maximum subtracted (exact, not online);
 * -inf entries (masked) become 0; at least one entry must be finite. */
static inline void softmax_row(float *ph, int64_t L)
{
    float m = -INFINITY, sum = 0.f;
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
}

#ifdef TARTLET_AVX2
/* The 8 sums of a[0..7]'s lanes, as one vector (lane i: sum of a[i]). */
static inline __m256 hsum8x8(const __m256 a[8])
{
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* p[h * L + j] = q_h . k_j for the g heads, 8 keys at a time (hd a multiple
 * of 8): one accumulator per key, so each key's products need no horizontal
 * sum of their own; the 8 sums come out of one hadd tree. */
static void scores_8keys(const float *qh, const float *k_pool, const int64_t *sl, int64_t L, int64_t g, int64_t hd,
                         int64_t row, int64_t kh, float *p)
{
    for (int64_t j0 = 0; j0 < L; j0 += 8) {
        const int64_t nb = L - j0 < 8 ? L - j0 : 8;
        const float *k[8];
        for (int64_t jj = 0; jj < 8; jj++)
            k[jj] = k_pool + sl[j0 + (jj < nb ? jj : 0)] * row + kh * hd;
        for (int64_t h = 0; h < g; h++) {
            const float *q = qh + h * hd;
            __m256 acc[8];
            for (int jj = 0; jj < 8; jj++)
                acc[jj] = _mm256_setzero_ps();
            for (int64_t d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int jj = 0; jj < 8; jj++)
                    acc[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[jj] + d), acc[jj]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, hsum8x8(acc));
            for (int64_t jj = 0; jj < nb; jj++)
                p[h * L + j0 + jj] = sums[jj];
        }
    }
}
#endif

/* One attention task: the g query heads sharing KV head kh of one decode
 * query (qh: those heads, [g, hd]) over L pool slots sl (additive mask bb, or
 * NULL), written to out [g, hd]; p: scratch of g * L floats. Softmax with
 * the running maximum subtracted (exact, not online). */
static void attend_kv_head(const float *qh, const float *k_pool, const float *v_pool, const int64_t *sl, const float *bb,
                           int64_t L, int64_t g, int64_t hd, int64_t row, int64_t kh, float scale, float *p, float *out)
{
#ifdef TARTLET_AVX2
    if (hd % 8 == 0) {
        scores_8keys(qh, k_pool, sl, L, g, hd, row, kh, p);
        for (int64_t h = 0; h < g; h++) {
            float *ph = p + h * L;
            for (int64_t j = 0; j < L; j++) /* a masked key's product is overwritten, whatever its slot holds */
                ph[j] = bb ? (bb[j] == -INFINITY ? -INFINITY : ph[j] * scale + bb[j]) : ph[j] * scale;
            softmax_row(ph, L);
            weighted_values(ph, sl, L, v_pool, row, kh * hd, hd, out + h * hd);
        }
        return;
    }
#endif
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
        softmax_row(p + h * L, L);
        weighted_values(p + h * L, sl, L, v_pool, row, kh * hd, hd, out + h * hd);
    }
}

/* RMSNorm of one row: o = w * (x * rsqrt(mean(x^2) + eps)). */
static inline void rms_norm_row(const float *x, const float *w, float *o, int64_t H, float eps)
{
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++)
        ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++)
        o[i] = w[i] * (x[i] * r);
}

/* RoPE (rotate_half layout) of the query and key heads of one fused QKV row
 * src [(nh + 2 nkv) hd] with c, s [hd / 2]: queries to q_out [nh, hd], keys
 * and values to pool row `slot` of k_pool, v_pool [slots, nkv, hd]. */
static inline void rope_store_row(const float *src, const float *c, const float *s, float *q_out, float *k_pool,
                                  float *v_pool, int64_t slot, int64_t nh, int64_t nkv, int64_t hd)
{
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < nh + nkv; h++) {
        const float *x = src + h * hd;
        float *o = h < nh ? q_out + h * hd : k_pool + (slot * nkv + (h - nh)) * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            o[i] = a * c[i] - b * s[i];
            o[i + half] = b * c[i] + a * s[i];
        }
    }
    const float *v = src + (nh + nkv) * hd;
    float *vo = v_pool + slot * nkv * hd;
#pragma omp simd
    for (int64_t i = 0; i < nkv * hd; i++)
        vo[i] = v[i];
}

#endif
