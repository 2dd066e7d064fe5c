/* The fused decode step of quant_kernels.c: every layer of a Llama-style
 * decoder (RMSNorm, fused QKV projection, RoPE + KV write, paged attention of
 * one query per sequence, output projection + residual, RMSNorm, fused
 * gate/up projection, SiLU(gate) * up, down projection + residual) for T
 * single-token rows, in ONE OpenMP parallel region.
 *
 * Why: at batch 1 a layer is ~11 small operations of 10-150 us each; run one
 * by one from Python, each pays the interpreter, ctypes and, to use both
 * cores, the wake-up of an OpenMP team (more than a 576 x 576 product
 * takes). Here the team is woken once per step and the threads meet at
 * barriers between operations (spinning, ~1 us), so every projection is
 * split across all threads - llama.cpp's graph-compute scheme.
 *
 * Work split: projections by weight rows (each thread a contiguous range of
 * the stacked output rows, crossing part boundaries), attention by (sequence,
 * KV head), row-wise operations by row; the small sequential pieces (norm +
 * activation quantization) run on thread 0. Between operations the threads
 * meet at team_wait, a spin barrier (see there why not OpenMP's). Results equal the op-by-op path
 * (same kernels, same order of summation per output) except SiLU (see
 * silu_mul).
 *
 * Included at the end of quant_kernels.c (uses its tq_linear_desc, tq_matmul,
 * tq_matmul_half and tq_quantize) after float_kernels.h. */
#include <omp.h>
#include <sched.h>

/* One decoder layer: norm weights [H] and the four projections (descriptors
 * as tq_linear takes them); this layer's KV pool [slots, nkv, hd]. */
typedef struct {
    const float *ln1, *ln2;
    const tq_linear_desc *qkv, *o, *gate_up, *down;
    float *k_pool, *v_pool;
} tq_layer_desc;

/* Decode queries attending to their own KV slots (AttentionGroup with one
 * query per request): request b's query is row rows[b] (or row_start + b),
 * its keys/values pool slots kv_slots [B, L], additive mask bias [B, L]
 * (0 or -inf) or NULL. */
typedef struct {
    const int64_t *rows;
    int64_t row_start, B, L;
    const int64_t *kv_slots;
    const float *bias;
} tq_attn_group;

typedef struct {
    int64_t n_layers, hidden, nh, nkv, hd, ffn;
    float eps, scale;
    const tq_layer_desc *layers;
    /* the final RMSNorm weight [H] and the LM head, or NULL: no head here */
    const float *final_norm;
    const tq_linear_desc *head;
} tq_decoder_desc;

/* Seconds spent per phase by thread 0 (tq_decode_profile), while enabled:
 * 0 norm + quantize, 1 QKV, 2 RoPE + KV write, 3 attention, 4 output
 * projection, 5 gate/up, 6 SiLU * up, 7 down, 8 LM head (each up to its
 * barrier). */
#define TQ_PHASES 9
static double prof_acc[TQ_PHASES];
static int prof_on;

/* Enable (1) or disable (0) the phase clock; copies the totals so far into
 * out [TQ_PHASES] (if not NULL) and resets them. Returns TQ_PHASES. */
int tq_decode_profile(int enable, double *out) {
    if (out) memcpy(out, prof_acc, sizeof(prof_acc));
    memset(prof_acc, 0, sizeof(prof_acc));
    prof_on = enable;
    return TQ_PHASES;
}

/* o = silu(g) * u = g * sigmoid(g) * u over n values, sigmoid from
 * exp(-|g|) <= 1 (float_kernels.h's exp_nonpositive, so the loop vectorises). */
static inline void silu_mul(const float *g, const float *u, float *o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float a = g[i], e = exp_nonpositive(-fabsf(a));
        o[i] = a * (a >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u[i];
    }
}

/* A sense-reversing spin barrier for the team of one step. OpenMP's own
 * barriers sleep on a futex after ~100 spins whenever the process has more
 * OpenMP threads than CPUs (libgomp's "throttled" spin count; PyTorch's
 * pools make that the usual case), and a futex wake-up per operation costs
 * more than the operation. Spins with pause, then yields the CPU, so an
 * oversubscribed machine still makes progress. */
typedef struct {
    int count, sense, n;
} team_barrier;

static inline void team_wait(team_barrier *b, int *local_sense) {
    const int s = *local_sense = !*local_sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == b->n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; spins++) {
        if (spins < 20000) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

static inline int desc_has_blocks(const tq_linear_desc *L) {
    for (int64_t i = 0; i < L->nparts; i++)
        if (L->parts[i].kind < 4) return 1;
    return 0;
}

/* This thread's share (of nt) of y = x @ W^T (+ bias) (+ res) for M rows:
 * a contiguous range of W's stacked output rows. x: float rows (for float16
 * parts), qa/fa: the same rows quantized (for block parts). y and res have
 * row stride n_total; res may alias y (each element is read, then written,
 * by the one thread that owns its column). */
static void team_linear(const tq_linear_desc *L, const float *x, const void *qa, const float *fa, int64_t M, float *y,
                        const float *res, int tid, int nt) {
    const int64_t K = L->k, nb = K / QK, N = L->n_total;
    const int64_t lo = N * tid / nt, hi = N * (tid + 1) / nt;
    int64_t n0 = 0;
    for (int64_t i = 0; i < L->nparts && n0 < hi; i++) {
        const tq_part *p = &L->parts[i];
        const int64_t a = lo > n0 ? lo - n0 : 0, b = hi < n0 + p->n ? hi - n0 : p->n;
        if (a < b) {
            const int64_t c = n0 + a; /* first output column */
            const float *bias = L->bias ? L->bias + c : 0, *r = res ? res + c : 0;
            if (p->kind >= 4) {
                tq_matmul_half(p->kind == 5, (const uint16_t *)p->q + a * K, b - a, K, x, K, M, y + c, N, bias, r, N);
            } else {
                const int kind = (int)p->kind;
                tq_matmul(kind, (int)L->bits, p->q + a * nb * QBYTES[kind], p->d + a * nb * (kind == K_Q6 ? 2 : 1),
                          p->m ? p->m + a * nb : 0, b - a, K, qa, fa, M, y + c, N, bias, r, N);
            }
        }
        n0 += p->n;
    }
}

/* Quantize M rows of x [M, K] for L's activation precision (if it has
 * block parts): called by one thread. */
static inline void quantize_for(const tq_linear_desc *L, const float *x, int64_t M, void *qa, float *fa) {
    if (desc_has_blocks(L)) tq_quantize((int)L->bits, x, L->k, M, L->k, qa, fa);
}

/* RMSNorm of T rows of x [T, H] with weight w into xn, then their
 * quantization for L (one thread). */
static void norm_quantize(const float *x, const float *w, float *xn, int64_t T, int64_t H, float eps,
                          const tq_linear_desc *L, void *qa, float *fa) {
    for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * H, w, xn + t * H, H, eps);
    quantize_for(L, xn, T, qa, fa);
}

/* Run every layer of D over x [T, H] (float32, contiguous; the residual
 * stream, updated in place) for T single-token rows at RoPE angles cos, sin
 * [T, hd / 2], writing each layer's keys/values to pool slots write_slots [T]
 * before attending (groups: every row in exactly one group), on nthreads
 * OpenMP threads (<= 0: the default team size). Then, when D has a head and
 * logits is not NULL, the final RMSNorm and the LM head of the S rows
 * out_rows [S] of x into logits [S, head->n_total] (the same team: no second
 * OpenMP start). Returns 0, or -1 when the scratch buffers cannot be
 * allocated (x untouched then). */
int tq_decode_layers(const tq_decoder_desc *D, float *x, int64_t T, const float *cos_, const float *sin_,
                     const int64_t *write_slots, const tq_attn_group *groups, int64_t n_groups, int nthreads,
                     const int64_t *out_rows, int64_t S, float *logits) {
    const int64_t H = D->hidden, nh = D->nh, nkv = D->nkv, hd = D->hd, F = D->ffn, g = nh / nkv, half = hd / 2;
    const int64_t qkv_w = (nh + 2 * nkv) * hd, kmax = H > nh * hd ? (H > F ? H : F) : (nh * hd > F ? nh * hd : F);
    int64_t Lmax = 1, tasks = 0;
    for (int64_t i = 0; i < n_groups; i++) {
        Lmax = groups[i].L > Lmax ? groups[i].L : Lmax;
        tasks += groups[i].B * nkv;
    }
    const int nt_max = nthreads > 0 ? nthreads : omp_get_max_threads();
    /* float scratch: xn [T, kmax], qkv [T, qkv_w], q [T, nh hd], attn [T, nh hd], gu [T, 2F], scores per thread */
    const size_t nf = (size_t)(T * kmax + T * qkv_w + 2 * T * nh * hd + T * 2 * F + (int64_t)nt_max * g * Lmax);
    const size_t qbytes = ((size_t)T * kmax * 2 + 63) / 64 * 64, fbytes = (size_t)T * FA * (kmax / QK) * sizeof(float);
    char *buf = aligned_alloc(64, (nf * sizeof(float) + qbytes + fbytes + 63) / 64 * 64);
    if (!buf) return -1;
    float *xn = (float *)buf, *qkv = xn + T * kmax, *q = qkv + T * qkv_w, *attn = q + T * nh * hd;
    float *gu = attn + T * nh * hd, *scores = gu + T * 2 * F;
    void *qa = (char *)buf + nf * sizeof(float);
    float *fa = (float *)((char *)qa + qbytes);
    team_barrier bar = {0, 0, nt_max};
#pragma omp parallel num_threads(nt_max)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int sense = 0;
        if (tid == 0) bar.n = nt; /* the team may be smaller than asked; read after the first barrier */
        float *p = scores + (int64_t)tid * g * Lmax;
        const int clock = prof_on && tid == 0;
        double t_last = clock ? omp_get_wtime() : 0.0;
#define PHASE(i)                                      \
    if (clock) {                                      \
        const double now_ = omp_get_wtime();          \
        prof_acc[i] += now_ - t_last;                 \
        t_last = now_;                                \
    }
#define SYNC() team_wait(&bar, &sense)
#pragma omp barrier
        for (int64_t li = 0; li < D->n_layers; li++) {
            const tq_layer_desc *ly = &D->layers[li];
            if (tid == 0) norm_quantize(x, ly->ln1, xn, T, H, D->eps, ly->qkv, qa, fa);
            SYNC();
            PHASE(0)
            team_linear(ly->qkv, xn, qa, fa, T, qkv, 0, tid, nt);
            SYNC();
            PHASE(1)
            for (int64_t t = tid; t < T; t += nt)
                rope_store_row(qkv + t * qkv_w, cos_ + t * half, sin_ + t * half, q + t * nh * hd, ly->k_pool,
                               ly->v_pool, write_slots[t], nh, nkv, hd);
            SYNC();
            PHASE(2)
            for (int64_t i = tasks * tid / nt; i < tasks * (tid + 1) / nt; i++) {
                int64_t j = i, gi = 0;
                while (j >= groups[gi].B * nkv) j -= groups[gi++].B * nkv;
                const tq_attn_group *G = &groups[gi];
                const int64_t b = j / nkv, kh = j % nkv, r = G->rows ? G->rows[b] : G->row_start + b;
                attend_kv_head(q + r * nh * hd + kh * g * hd, ly->k_pool, ly->v_pool, G->kv_slots + b * G->L,
                               G->bias ? G->bias + b * G->L : NULL, G->L, g, hd, nkv * hd, kh, D->scale, p,
                               attn + r * nh * hd + kh * g * hd);
            }
            SYNC();
            PHASE(3)
            if (tid == 0) quantize_for(ly->o, attn, T, qa, fa);
            SYNC();
            PHASE(0)
            team_linear(ly->o, attn, qa, fa, T, x, x, tid, nt);
            SYNC();
            PHASE(4)
            if (tid == 0) norm_quantize(x, ly->ln2, xn, T, H, D->eps, ly->gate_up, qa, fa);
            SYNC();
            PHASE(0)
            team_linear(ly->gate_up, xn, qa, fa, T, gu, 0, tid, nt);
            SYNC();
            PHASE(5)
            const int64_t chunks = T * ((F + 255) / 256); /* SiLU(gate) * up into xn [T, F], 256 columns a chunk */
            for (int64_t c = chunks * tid / nt; c < chunks * (tid + 1) / nt; c++) {
                const int64_t t = c / ((F + 255) / 256), j = c % ((F + 255) / 256) * 256;
                silu_mul(gu + t * 2 * F + j, gu + t * 2 * F + F + j, xn + t * F + j, F - j < 256 ? F - j : 256);
            }
            SYNC();
            PHASE(6)
            if (tid == 0) quantize_for(ly->down, xn, T, qa, fa);
            SYNC();
            PHASE(0)
            team_linear(ly->down, xn, qa, fa, T, x, x, tid, nt);
            SYNC();
            PHASE(7)
        }
        if (logits && D->head && S > 0) { /* S <= T rows: the scratch fits */
            if (tid == 0) {
                for (int64_t i = 0; i < S; i++) rms_norm_row(x + out_rows[i] * H, D->final_norm, xn + i * H, H, D->eps);
                quantize_for(D->head, xn, S, qa, fa);
            }
            SYNC();
            PHASE(0)
            team_linear(D->head, xn, qa, fa, S, logits, 0, tid, nt);
            PHASE(8) /* the region's closing barrier ends it */
        }
    }
#undef SYNC
#undef PHASE
    free(buf);
    return 0;
}
