/* int8 KV rows for cpu_kernels.c: the quantizing RoPE + KV write and the
 * dequantizing inner loops of paged decode attention. Include after
 * float_kernels.h (exp_nonpositive, softmax_row, probe_weights, TARTLET_AVX2).
 *
 * Row format (tartlet/engine/core/kv_quant.py, which is the PyTorch twin): each
 * (token, KV head) row of hd values is hd int8 quants q followed by a float32
 * scale d (4 bytes, native order), so a pool layer is int8
 * [slots, nkv, hd + 4] and row (slot, kh) starts at byte
 * (slot * nkv + kh) * (hd + 4). Quantization is llama.cpp's Q8_0
 * (ggml-quants.c quantize_row_q8_0: d = max|x| / 127, q = round(x * 127 /
 * max|x|), nearest with ties to even as its AVX2 path's _mm256_round_ps) with
 * one block per row instead of blocks of 32; value ~ q * d.
 *
 * Attention reads q8 rows without a dequantized copy: a score is
 * d_k * dot(query, q_k), and a value row enters the weighted sum with weight
 * p_j * d_v. No -ffast-math, as in float_kernels.h. */
#ifndef TARTLET_KV_INT8_H
#define TARTLET_KV_INT8_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KV_Q8_SCALE_BYTES 4

static inline float q8_row_scale(const int8_t *row, int64_t hd)
{
    float d;
    memcpy(&d, row + hd, sizeof d);
    return d;
}

/* x [hd] float32 -> dst [hd + 4]: quants, then the scale. */
static inline void quantize_row_q8(const float *x, int8_t *dst, int64_t hd)
{
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < hd; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < hd; i++)
        dst[i] = (int8_t)rintf(x[i] * id); /* default rounding mode: nearest, ties to even */
    memcpy(dst + hd, &d, sizeof d);
}

/* dot(a, q) of float32 a [n] with int8 q [n] (the scale is the caller's). */
static inline float dot_q8(const float *a, const int8_t *q, int64_t n)
{
#ifdef TARTLET_AVX2
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + i));
            const __m256 k0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            const __m256 k1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), k0, s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), k1, s1);
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
        d += a[i] * (float)q[i];
    return d;
}

/* o[0:hd] = sum_j p[j] * dequant(v row of slot sl[j], KV head kh), skipping p[j] == 0;
 * v_pool int8 [slots, nkv, hd + 4]. */
static void weighted_values_q8(const float *p, const int64_t *sl, int64_t L, const int8_t *v_pool, int64_t nkv, int64_t kh,
                               int64_t hd, float *o)
{
    const int64_t rb = hd + KV_Q8_SCALE_BYTES;
#ifdef TARTLET_AVX2
    if (hd % 64 == 0) { /* 64 columns at a time, accumulators in registers */
        for (int64_t c = 0; c < hd; c += 64) {
            __m256 a[8];
            for (int k = 0; k < 8; k++)
                a[k] = _mm256_setzero_ps();
            for (int64_t j = 0; j < L; j++) {
                if (p[j] == 0.f)
                    continue;
                const int8_t *v = v_pool + (sl[j] * nkv + kh) * rb;
                const __m256 pj = _mm256_set1_ps(p[j] * q8_row_scale(v, hd));
                for (int k = 0; k < 4; k++) {
                    const __m128i b = _mm_loadu_si128((const __m128i *)(v + c + 16 * k));
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
                    a[2 * k] = _mm256_fmadd_ps(pj, lo, a[2 * k]);
                    a[2 * k + 1] = _mm256_fmadd_ps(pj, hi, a[2 * k + 1]);
                }
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
        const int8_t *v = v_pool + (sl[j] * nkv + kh) * rb;
        const float w = p[j] * q8_row_scale(v, hd);
#pragma omp simd
        for (int64_t i = 0; i < hd; i++)
            o[i] += w * (float)v[i];
    }
}

/* float_kernels.h's attend_kv_head over int8 pools: the g query heads
 * sharing KV head kh (qh [g, hd]) over L slots sl (additive mask bb or NULL),
 * out [g, hd]; p: scratch of g * L floats; probe: NULL or [g, L], each
 * head's softmax weights (probe_weights). */
static void attend_kv_head_q8(const float *qh, const int8_t *k_pool, const int8_t *v_pool, const int64_t *sl, const float *bb,
                              int64_t L, int64_t g, int64_t hd, int64_t nkv, int64_t kh, float scale, float *p, float *out,
                              float *probe)
{
    const int64_t rb = hd + KV_Q8_SCALE_BYTES;
    for (int64_t j = 0; j < L; j++) {
        if (bb && bb[j] == -INFINITY) {
            for (int64_t h = 0; h < g; h++)
                p[h * L + j] = -INFINITY;
            continue;
        }
        const int8_t *k = k_pool + (sl[j] * nkv + kh) * rb;
        const float ks = q8_row_scale(k, hd) * scale;
        for (int64_t h = 0; h < g; h++)
            p[h * L + j] = dot_q8(qh + h * hd, k, hd) * ks + (bb ? bb[j] : 0.f);
    }
    for (int64_t h = 0; h < g; h++) {
        softmax_row(p + h * L, L);
        probe_weights(probe, h, p + h * L, L);
        weighted_values_q8(p + h * L, sl, L, v_pool, nkv, kh, hd, out + h * hd);
    }
}

/* float_kernels.h's rope_store_row writing int8 rows: queries to q_out
 * [nh, hd] (float32), keys (after RoPE) and values quantized into pool row
 * `slot` of k_pool, v_pool int8 [slots, nkv, hd + 4]. tmp: hd floats. */
static inline void rope_store_row_q8(const float *src, const float *c, const float *s, float *q_out, int8_t *k_pool,
                                     int8_t *v_pool, int64_t slot, int64_t nh, int64_t nkv, int64_t hd, float *tmp)
{
    const int64_t rb = hd + KV_Q8_SCALE_BYTES;
    for (int64_t h = 0; h < nh + nkv; h++) {
        rope_rotate(src + h * hd, c, s, h < nh ? q_out + h * hd : tmp, hd / 2);
        if (h >= nh)
            quantize_row_q8(tmp, k_pool + (slot * nkv + (h - nh)) * rb, hd);
    }
    const float *v = src + (nh + nkv) * hd;
    for (int64_t kh = 0; kh < nkv; kh++)
        quantize_row_q8(v + kh * hd, v_pool + (slot * nkv + kh) * rb, hd);
}

#endif
