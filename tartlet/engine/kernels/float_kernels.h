/* Float32 building blocks shared by cpu_kernels.c (the per-op decode kernels
 * PyTorch's path calls) and quant_kernels.c (the fused decode step): the
 * softmax exponential, the weighted sum of values, one attention task and
 * the RoPE + KV write, over float32 or float16 pools (f16: IEEE binary16
 * values, converted as torch's .half() does). Static, so each library gets
 * its own copy; vectorised with AVX2 + FMA + F16C intrinsics when the
 * including file is compiled with them (-mavx2 -mfma -mf16c), plain loops
 * otherwise. No -ffast-math: masked positions are -inf and must stay so.
 * Layouts as in cpu_kernels.c. */
#ifndef TARTLET_FLOAT_KERNELS_H
#define TARTLET_FLOAT_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* IEEE binary16 -> float32 (exact). */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f;
    if (e == 0) { /* zero or subnormal: m 2^-24 */
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7f800000u | m << 13 : (e + 112) << 23 | m << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> IEEE binary16, rounded to nearest even (overflow to inf, NaN
 * kept quiet), as vcvtps2ph with rounding mode 0 and torch's .half(). */
static inline uint16_t float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)(x >> 16 & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf, NaN */
        return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | (ax >> 13 & 0x3ff) : 0);
    if (ax >= 0x477ff000u) /* 65520 and up round to inf */
        return sign | 0x7c00;
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal (or zero), round(|f| 2^24) of 2^-24 */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    uint32_t r = ax - 0x38000000u; /* exponent bias 127 -> 15 */
    r += 0x0fffu + (r >> 13 & 1); /* to nearest, ties to even: a carry moves into the exponent */
    return sign | (uint16_t)(r >> 13);
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TARTLET_AVX2 1
#endif

/* Value i of a pool row at p: float32 (f16 0) or float16 (f16 1). */
ALWAYS_INLINE float kv_at(const void *p, int64_t i, const int f16)
{
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef TARTLET_AVX2
/* Values i .. i + 7 of a pool row at p, as kv_at. */
ALWAYS_INLINE __m256 kv_load8(const void *p, int64_t i, const int f16)
{
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}
#endif

/* o[0:hd] = sum_j p[j] * v_pool[slot[j]] (row offset kv_off, in values),
 * skipping p[j] == 0. */
ALWAYS_INLINE void weighted_values(const float *p, const int64_t *sl, int64_t L, const void *v_pool, int64_t row,
                                   int64_t kv_off, int64_t hd, float *o, const int f16)
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
                const int64_t v = sl[j] * row + kv_off + c;
                for (int k = 0; k < 8; k++)
                    a[k] = _mm256_fmadd_ps(pj, kv_load8(v_pool, v + 8 * k, f16), a[k]);
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
        const int64_t v = sl[j] * row + kv_off;
#pragma omp simd
        for (int64_t i = 0; i < hd; i++)
            o[i] += p[j] * kv_at(v_pool, v + i, f16);
    }
}

/* ph [L] <- softmax(ph), the running maximum subtracted (exact, not online);
 * -inf entries (masked) become 0; at least one entry must be finite. */
static inline void softmax_row(float *ph, int64_t L)
{
    float m = -INFINITY, lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < L; j++)
        m = ph[j] > m ? ph[j] : m;
#pragma omp simd
    for (int64_t j = 0; j < L; j++)
        ph[j] = exp_nonpositive(ph[j] - m);
    /* The sum in a fixed order: lane j % 8 adds its entries in turn, then a fixed tree. Masked
     * keys (0 here) after the last visible one add exact zeros, so a query's weights are the same
     * bits whatever the length of its group: alone (decode) and in a multi-row step (a prompt
     * chunk, a speculative verify) whose later rows' keys it does not see. An `omp simd`
     * reduction's association depended on L (its vector tail) and made them differ by an ulp,
     * which 8-bit activations amplified into different greedy tokens. */
    int64_t j = 0;
#ifdef TARTLET_AVX2 /* the same sums, 8 lanes at a time (a zero-padded tail adds exact zeros) */
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= L; j += 8)
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(ph + j));
    _mm256_storeu_ps(lane, acc);
#endif
    for (; j < L; j++)
        lane[j & 7] += ph[j];
    const float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
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
ALWAYS_INLINE void scores_8keys(const float *qh, const void *k_pool, const int64_t *sl, int64_t L, int64_t g, int64_t hd,
                                int64_t row, int64_t kh, float *p, const int f16)
{
    for (int64_t j0 = 0; j0 < L; j0 += 8) {
        const int64_t nb = L - j0 < 8 ? L - j0 : 8;
        int64_t k[8];
        for (int64_t jj = 0; jj < 8; jj++)
            k[jj] = sl[j0 + (jj < nb ? jj : 0)] * row + kh * hd;
        for (int64_t h = 0; h < g; h++) {
            const float *q = qh + h * hd;
            __m256 acc[8];
            for (int jj = 0; jj < 8; jj++)
                acc[jj] = _mm256_setzero_ps();
            for (int64_t d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int jj = 0; jj < 8; jj++)
                    acc[jj] = _mm256_fmadd_ps(qv, kv_load8(k_pool, k[jj] + d, f16), acc[jj]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, hsum8x8(acc));
            for (int64_t jj = 0; jj < nb; jj++)
                p[h * L + j0 + jj] = sums[jj];
        }
    }
}
#endif

/* The attention probe: head h's softmax weights ph [L] copied to probe
 * [g, L] (row h), when the caller asked for them (probe not NULL). */
ALWAYS_INLINE void probe_weights(float *probe, int64_t h, const float *ph, int64_t L)
{
    if (probe)
        memcpy(probe + h * L, ph, sizeof(float) * (size_t)L);
}

/* One attention task: the g query heads sharing KV head kh of one decode
 * query (qh: those heads, [g, hd]) over L pool slots sl (additive mask bb, or
 * NULL), written to out [g, hd]; p: scratch of g * L floats; pools of rows
 * of `row` values, float32 or (f16) float16. Softmax with the running
 * maximum subtracted (exact, not online). probe: NULL, or [g, L] floats that
 * receive each head's softmax weights (the attention probe; masked
 * positions 0). */
ALWAYS_INLINE void attend_kv_head_any(const float *qh, const void *k_pool, const void *v_pool, const int64_t *sl,
                                      const float *bb, int64_t L, int64_t g, int64_t hd, int64_t row, int64_t kh,
                                      float scale, float *p, float *out, float *probe, const int f16)
{
#ifdef TARTLET_AVX2
    if (hd % 8 == 0) {
        scores_8keys(qh, k_pool, sl, L, g, hd, row, kh, p, f16);
        for (int64_t h = 0; h < g; h++) {
            float *ph = p + h * L;
            for (int64_t j = 0; j < L; j++) /* a masked key's product is overwritten, whatever its slot holds */
                ph[j] = bb ? (bb[j] == -INFINITY ? -INFINITY : ph[j] * scale + bb[j]) : ph[j] * scale;
            softmax_row(ph, L);
            probe_weights(probe, h, ph, L);
            weighted_values(ph, sl, L, v_pool, row, kh * hd, hd, out + h * hd, f16);
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
        const int64_t k = sl[j] * row + kh * hd;
        for (int64_t h = 0; h < g; h++) {
            const float *q = qh + h * hd;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int64_t i = 0; i < hd; i++)
                d += q[i] * kv_at(k_pool, k + i, f16);
            p[h * L + j] = d * scale + (bb ? bb[j] : 0.f);
        }
    }
    for (int64_t h = 0; h < g; h++) {
        softmax_row(p + h * L, L);
        probe_weights(probe, h, p + h * L, L);
        weighted_values(p + h * L, sl, L, v_pool, row, kh * hd, hd, out + h * hd, f16);
    }
}

/* attend_kv_head_any over float32 pools [slots, row] (row = nkv hd). */
static void attend_kv_head(const float *qh, const float *k_pool, const float *v_pool, const int64_t *sl, const float *bb,
                           int64_t L, int64_t g, int64_t hd, int64_t row, int64_t kh, float scale, float *p, float *out,
                           float *probe)
{
    attend_kv_head_any(qh, k_pool, v_pool, sl, bb, L, g, hd, row, kh, scale, p, out, probe, 0);
}

/* attend_kv_head_any over float16 pools [slots, row]. */
static void attend_kv_head_f16(const float *qh, const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *sl,
                               const float *bb, int64_t L, int64_t g, int64_t hd, int64_t row, int64_t kh, float scale,
                               float *p, float *out, float *probe)
{
    attend_kv_head_any(qh, k_pool, v_pool, sl, bb, L, g, hd, row, kh, scale, p, out, probe, 1);
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

/* o = RoPE (rotate_half layout) of one head x [2 half] with c, s [half]. */
static inline void rope_rotate(const float *x, const float *c, const float *s, float *o, int64_t half)
{
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i] + a * s[i];
    }
}

/* RoPE (rotate_half layout) of the query and key heads of one fused QKV row
 * src [(nh + 2 nkv) hd] with c, s [hd / 2]: queries to q_out [nh, hd], keys
 * and values to pool row `slot` of k_pool, v_pool [slots, nkv, hd]. */
static inline void rope_store_row(const float *src, const float *c, const float *s, float *q_out, float *k_pool,
                                  float *v_pool, int64_t slot, int64_t nh, int64_t nkv, int64_t hd)
{
    for (int64_t h = 0; h < nh + nkv; h++)
        rope_rotate(src + h * hd, c, s, h < nh ? q_out + h * hd : k_pool + (slot * nkv + (h - nh)) * hd, hd / 2);
    memcpy(v_pool + slot * nkv * hd, src + (nh + nkv) * hd, sizeof(float) * (size_t)(nkv * hd));
}

/* dst [n] = float16 of x [n] (float_to_half's rounding). */
static inline void store_half_row(const float *x, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
#ifdef TARTLET_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = float_to_half(x[i]);
}

/* rope_store_row writing float16 pool rows k_pool, v_pool [slots, nkv, hd]
 * (keys rounded after RoPE). tmp: hd floats. */
static inline void rope_store_row_f16(const float *src, const float *c, const float *s, float *q_out, uint16_t *k_pool,
                                      uint16_t *v_pool, int64_t slot, int64_t nh, int64_t nkv, int64_t hd, float *tmp)
{
    for (int64_t h = 0; h < nh; h++)
        rope_rotate(src + h * hd, c, s, q_out + h * hd, hd / 2);
    for (int64_t kh = 0; kh < nkv; kh++) {
        rope_rotate(src + (nh + kh) * hd, c, s, tmp, hd / 2);
        store_half_row(tmp, k_pool + (slot * nkv + kh) * hd, hd);
    }
    store_half_row(src + (nh + nkv) * hd, v_pool + slot * nkv * hd, nkv * hd);
}

#endif
