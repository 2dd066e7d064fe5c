/* 256-bit SIMD kernels of quant_kernels.c, included once per instruction set
 * with SUFFIX (function name suffix) and VNNI (0: AVX2 vpmaddubsw + vpmaddwd,
 * 1: AVX-512 VNNI vpdpbusd on 256-bit vectors) defined, inside a
 * "#pragma GCC target" region. Layouts: see the top of quant_kernels.c. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

/* 32 unsigned weight values of one block, element e in byte e. */
INLINE __m256i FN(unpack)(const int kind, const uint8_t *q) {
    if (kind == K_Q8) return _mm256_loadu_si256((const __m256i *)q);
    const __m128i x = _mm_loadu_si128((const __m128i *)q);
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
    if (kind == K_Q5) {
        uint32_t h;
        memcpy(&h, q + 16, 4);
        __m256i hb = _mm256_srlv_epi32(_mm256_set1_epi32((int)h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(1)), 4));
    } else if (kind == K_Q6) {
        uint64_t h;
        memcpy(&h, q + 16, 8);
        __m256i hb = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)h), _mm256_setr_epi64x(0, 2, 4, 6));
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
    }
    return v;
}

INLINE float FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_i h[i] f[i] for float16 h, float32 f */
INLINE float FN(dot_h)(const uint16_t *h, const float *f, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), _mm256_loadu_ps(f + i), acc);
    float sum = FN(hsum)(acc);
    for (; i < n; i++) sum += _cvtsh_ss(h[i]) * f[i];
    return sum;
}

/* sum over blocks of m_w * (d_x sum(a)) for one weight row and one activation
 * row (fa planes, see FA in quant_kernels.c); signed_q8: no minimum (AVX2's
 * signed 8-bit product) */
INLINE float FN(min_term)(const int kind, const int signed_q8, const uint16_t *d, const uint16_t *m, const float *f,
                          int64_t nb) {
    if (kind == K_Q6) return -32.0f * FN(dot_h)(d, f + 2 * nb, 2 * nb);
    if (kind == K_Q8) return signed_q8 ? 0.0f : -128.0f * FN(dot_h)(d, f + nb, nb);
    return FN(dot_h)(m, f + nb, nb);
}

/* int32 partial dot products (8 lanes of 4 products) of unsigned w and signed a. */
INLINE __m256i FN(dot)(__m256i w, __m256i a) {
#if VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

/* 16 int16 x 16 int16 -> 8 lanes of pair sums */
INLINE __m256i FN(dot16)(__m256i w16, const int16_t *a) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
#if VNNI
    return _mm256_dpwssd_epi32(_mm256_setzero_si256(), w16, av);
#else
    return _mm256_madd_epi16(w16, av);
#endif
}

/* Dot products of one weight row (nb blocks) with R activation rows
 * (A16: int16 activations, else int8). */
INLINE void FN(tile)(const int kind, const int A16, const int R, const uint8_t *wq, const uint16_t *d,
                     const uint16_t *m, int64_t nb, const void *qa, const float *fa, float *out) {
    const int signed_q8 = kind == K_Q8 && !VNNI && !A16;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w = FN(unpack)(kind, wq + b * KIND_QBYTES(kind));
        float d0, d1;
        if (kind == K_Q6) {
            d0 = _cvtsh_ss(d[2 * b]);
            d1 = _cvtsh_ss(d[2 * b + 1]);
        } else {
            d0 = d1 = _cvtsh_ss(d[b]);
        }
        if (A16) {
            const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
            const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
            for (int r = 0; r < R; r++) {
                const int16_t *a = (const int16_t *)qa + (r * nb + b) * QK;
                const float da = fa[r * FA * nb + b];
                const __m256i p0 = FN(dot16)(w0, a), p1 = FN(dot16)(w1, a + 16);
                if (kind == K_Q6) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * da), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * da), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(d0 * da), acc[r]);
                }
            }
        } else {
            __m256i wabs = w;
            if (signed_q8) { /* |w| * sign(a, w) keeps vpmaddubsw from saturating */
                w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
                wabs = _mm256_sign_epi8(w, w);
            }
            for (int r = 0; r < R; r++) {
                const __m256i av = _mm256_loadu_si256((const __m256i *)((const int8_t *)qa + (r * nb + b) * QK));
                const float da = fa[r * FA * nb + b];
                const __m256i p = signed_q8 ? FN(dot)(wabs, _mm256_sign_epi8(av, w)) : FN(dot)(w, av);
                const __m256 sc = kind == K_Q6 ? _mm256_setr_m128(_mm_set1_ps(d0 * da), _mm_set1_ps(d1 * da))
                                               : _mm256_set1_ps(d0 * da);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = FN(hsum)(acc[r]) + FN(min_term)(kind, signed_q8, d, m, fa + r * FA * nb, nb);
}

/* The row loop shared by every instruction set: weight rows n0 .. n1 - 1
 * (a thread's share, PAR_RANGE), activation rows in tiles of 4 through
 * TILE. Expands inside a function with the matmul_kind parameters. */
#ifndef MATMUL_ROWS
#define MATMUL_ROWS(TILE)                                                                                  \
    const int64_t nb = K / QK, qb = KIND_QBYTES(kind), asz = A16 ? 2 : 1;                                 \
    for (int64_t n = n0; n < n1; n++) {                                                                    \
        const uint8_t *w = wq + n * nb * qb;                                                               \
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;               \
        float s[4];                                                                                        \
        int64_t r = 0;                                                                                     \
        for (; r + 4 <= M; r += 4) {                                                                       \
            TILE(kind, A16, 4, w, d, m, nb, (const char *)qa + r * K * asz, fa + r * FA * nb, s);          \
            for (int i = 0; i < 4; i++) y[(r + i) * ldy + n] = finish(s[i], r + i, n, bias, res, ldr);     \
        }                                                                                                  \
        for (; r < M; r++) {                                                                               \
            TILE(kind, A16, 1, w, d, m, nb, (const char *)qa + r * K * asz, fa + r * FA * nb, s);          \
            y[r * ldy + n] = finish(s[0], r, n, bias, res, ldr);                                           \
        }                                                                                                  \
    }
#endif

INLINE void FN(matmul_kind)(const int kind, const int A16, int64_t n0, int64_t n1, const uint8_t *wq,
                            const uint16_t *wd, const uint16_t *wm, int64_t K, const void *qa, const float *fa,
                            int64_t M, float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    MATMUL_ROWS(FN(tile))
}

#define DISPATCH_KINDS(F, ...)                                          \
    switch (kind * 2 + (bits == 16)) {                                  \
    case 0: F(K_Q8, 0, __VA_ARGS__); break;                             \
    case 1: F(K_Q8, 1, __VA_ARGS__); break;                             \
    case 2: F(K_Q4, 0, __VA_ARGS__); break;                             \
    case 3: F(K_Q4, 1, __VA_ARGS__); break;                             \
    case 4: F(K_Q5, 0, __VA_ARGS__); break;                             \
    case 5: F(K_Q5, 1, __VA_ARGS__); break;                             \
    case 6: F(K_Q6, 0, __VA_ARGS__); break;                             \
    default: F(K_Q6, 1, __VA_ARGS__); break;                            \
    }

static void FN(matmul)(int kind, int bits, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t N,
                       int64_t K, const void *qa, const float *fa, int64_t M, float *y, int64_t ldy, const float *bias,
                       const float *res, int64_t ldr) {
    PAR_RANGE(N, N * M * (K / QK) >= par_min,
              DISPATCH_KINDS(FN(matmul_kind), n0, n1, wq, wd, wm, K, qa, fa, M, y, ldy, bias, res, ldr));
}

#if !VNNI
/* Dequantize rows of W into float32 (same values as tq_dequantize's C loop). */
static void FN(dequantize)(int kind, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t K,
                           const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / QK, qb = QBYTES[kind];
#pragma omp parallel for if (R * K >= (1 << 18)) schedule(static)
    for (int64_t i = 0; i < R; i++) {
        const int64_t n = rows ? rows[i] : i;
        const uint16_t *d = wd + n * nb * (kind == K_Q6 ? 2 : 1), *m = wm ? wm + n * nb : 0;
        for (int64_t b = 0; b < nb; b++) {
            const __m256i v = FN(unpack)(kind, wq + (n * nb + b) * qb);
            float d0, d1, m0, m1;
            if (kind == K_Q6) {
                d0 = _cvtsh_ss(d[2 * b]);
                d1 = _cvtsh_ss(d[2 * b + 1]);
                m0 = -32.0f * d0;
                m1 = -32.0f * d1;
            } else {
                d0 = d1 = _cvtsh_ss(d[b]);
                m0 = m1 = kind == K_Q8 ? -128.0f * d0 : _cvtsh_ss(m[b]);
            }
            float *o = out + i * K + b * QK;
            const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int j = 0; j < 4; j++) {
                const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
                const __m256 dv = _mm256_set1_ps(j < 2 ? d0 : d1), mv = _mm256_set1_ps(j < 2 ? m0 : m1);
                _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(f, dv, mv));
            }
        }
    }
}
#endif

#if !VNNI
/* Activation quantization, same results as quantize_blocks_c: int8 (bits 8, scale
 * max|x| / 127) or int16 (bits 16, max|x| / 32767), round half to even;
 * and the float16/bfloat16 weight kernel. Blocks b0 .. b1 - 1 of one row
 * of nb blocks: x, qa and fa at the row's start. */
static void FN(quantize_blocks)(int bits, const float *x, int64_t nb, int64_t b0, int64_t b1, void *qa, float *fa) {
    const float qmax = bits == 8 ? 127.0f : 32767.0f;
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / qmax, id = amax > 0.0f ? qmax / amax : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i s0 = _mm256_add_epi32(q[0], q[1]), s1 = _mm256_add_epi32(q[2], q[3]);
        if (bits == 8) {
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)((int8_t *)qa + b * QK), p);
        } else { /* packs interleaves 128-bit lanes: restore the order with a 64-bit permute */
            int16_t *o = (int16_t *)qa + b * QK;
            _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8));
            _mm256_storeu_si256((__m256i *)(o + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8));
        }
        __m256i h = _mm256_hadd_epi32(s0, s1);  /* [s0 s0 s1 s1 | s0 s0 s1 s1] pair sums */
        h = _mm256_hadd_epi32(h, h);
        const int t0 = _mm256_extract_epi32(h, 0) + _mm256_extract_epi32(h, 4);
        const int t1 = _mm256_extract_epi32(h, 1) + _mm256_extract_epi32(h, 5);
        fa[b] = d;
        fa[nb + b] = d * (float)(t0 + t1);
        fa[2 * nb + 2 * b] = d * (float)t0;
        fa[2 * nb + 2 * b + 1] = d * (float)t1;
    }
}

INLINE __m256 FN(load_half)(const int bf16, const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

INLINE void FN(matmul_half_kind)(const int bf16, int64_t n0, int64_t n1, const uint16_t *w, int64_t K, const float *x,
                                 int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias, const float *res,
                                 int64_t ldr) {
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? (int)(M - r0) : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t k = 0; k < K8; k += 8) {
                const __m256 wv = FN(load_half)(bf16, wr + k);
                for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (r0 + r) * ldx + k), acc[r]);
            }
            for (int r = 0; r < R; r++) {
                float sum = FN(hsum)(acc[r]);
                for (int64_t k = K8; k < K; k++) {
                    float wv;
                    if (bf16) {
                        uint32_t bits = (uint32_t)wr[k] << 16;
                        memcpy(&wv, &bits, 4);
                    } else {
                        wv = _cvtsh_ss(wr[k]);
                    }
                    sum += wv * x[(r0 + r) * ldx + k];
                }
                y[(r0 + r) * ldy + n] = finish(sum, r0 + r, n, bias, res, ldr);
            }
        }
    }
}

static void FN(matmul_half)(int bf16, const uint16_t *w, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                            float *y, int64_t ldy, const float *bias, const float *res, int64_t ldr) {
    PAR_RANGE(N, N * M * K >= (1 << 16), if (bf16) {
        FN(matmul_half_kind)(1, n0, n1, w, K, x, ldx, M, y, ldy, bias, res, ldr);
    } else {
        FN(matmul_half_kind)(0, n0, n1, w, K, x, ldx, M, y, ldy, bias, res, ldr);
    });
}
#endif

#undef FN
