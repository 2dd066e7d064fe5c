/* The fused decode step of quant_kernels.c: every layer of a Llama-style
 * decoder (RMSNorm, fused QKV projection, RoPE + KV write, paged attention of
 * one query per sequence, output projection + residual, RMSNorm, fused
 * gate/up projection, SiLU(gate) * up, down projection + residual) for T
 * single-token rows, in ONE OpenMP parallel region.
 *
 * Why: at batch 1 a layer is ~11 small operations of 10-150 us each; run one
 * by one from Python, each pays the interpreter, ctypes and, to use both
 * cores, the wake-up of an OpenMP team (more than a 576 x 576 product
 * takes). Here the team is woken once per step and every projection is
 * split across all threads - llama.cpp's graph-compute scheme - but the
 * work is cut into chunks that threads claim (each its own range first,
 * then what is left of the others'), not shares assigned to each thread, so
 * no thread ever waits for another one (see tq_decode_layers).
 *
 * Work split: projections by weight rows (chunks of the stacked output rows,
 * crossing part boundaries), attention by (sequence, KV head), SiLU by
 * 256-column runs of a row, or whole rows from 16 rows (both quantizing
 * what they wrote for the next projection); the small sequential pieces
 * (RMSNorm + activation quantization, RoPE + KV write) run as the tail of
 * the phase before them, on whichever thread finished it, or split by rows
 * across the threads from ROW_TAIL_MIN rows. Results equal the op-by-op
 * path (same kernels, same order of summation per output) except SiLU (see
 * silu_mul), whatever the thread count.
 *
 * Included at the end of quant_kernels.c (uses its tq_linear_desc, tq_matmul,
 * tq_matmul_half and tq_quantize) after float_kernels.h. */
#include <omp.h>
#include <sched.h>

/* One decoder layer: norm weights [H] and the four projections (descriptors
 * as tq_linear takes them); this layer's KV pool rows [slots, nkv, ...] of
 * the decoder's kv_kind. */
typedef struct {
    const float *ln1, *ln2;
    const tq_linear_desc *qkv, *o, *gate_up, *down;
    void *k_pool, *v_pool;
} tq_layer_desc;

/* Decode queries attending to their own KV slots (AttentionGroup with one
 * query per request): request b's query is row rows[b] (or row_start + b),
 * its keys/values pool slots kv_slots [B, L], additive mask bias [B, L]
 * (0 or -inf) or NULL. The attention probe (probe NULL: none): probe float32
 * [n, B, nh, L] receives layer li's softmax weights of every query head at
 * index probe_layers[li] (probe_layers [n_layers]; -1: layer not probed). */
typedef struct {
    const int64_t *rows;
    int64_t row_start, B, L;
    const int64_t *kv_slots;
    const float *bias;
    float *probe;
    const int64_t *probe_layers;
} tq_attn_group;

typedef struct {
    int64_t n_layers, hidden, nh, nkv, hd, ffn;
    float eps, scale;
    const tq_layer_desc *layers;
    /* the final RMSNorm weight [H] and the LM head, or NULL: no head here */
    const float *final_norm;
    const tq_linear_desc *head;
    /* the KV pools' rows: TQ_KV_F32 float32 [slots, nkv, hd], TQ_KV_Q8 int8 [slots, nkv, hd + 4]
     * (kv_int8.h), TQ_KV_F16 binary16 [slots, nkv, hd] */
    int64_t kv_kind;
} tq_decoder_desc;

/* LoRA (models/lora.py): one adapter's update of one projection,
 * y += (x @ at) @ bt, with at = A^T [k, r] and bt = (s B)^T [r, n] (the
 * scale folded in), of dtype TQ_LORA_F32, TQ_LORA_F16 (IEEE binary16) or
 * TQ_LORA_I8 (int8 values; then rank c of the product is scaled by
 * scale[c], the product of at's column scale and bt's row scale: y +=
 * ((x @ at) * scale) @ bt), both packed in the order the kernels read them
 * (lora_kernels.h: at as rank groups [ceil(r / TQ_LORA_W)][k][TQ_LORA_W],
 * bt as its diagonal blocks' column panels); at NULL (or r 0): the adapter
 * leaves the projection alone. blocks: where bt is block diagonal (a fused
 * projection's parts, each with its own ranks), its nblocks blocks {n0, n1,
 * c0, c1}: outputs [n0, n1) use ranks [c0, c1) only (the rest of bt is
 * zeros, not stored); nblocks 0: bt is dense (one block {0, n, 0, r}). An
 * adapter is an array of 4 n_layers of them, projection p of layer l at
 * 4 l + p (p: 0 QKV, 1 output, 2 gate/up, 3 down). */
#define TQ_LORA_MAX_BLOCKS 4
enum { TQ_LORA_F32 = 0, TQ_LORA_F16 = 1, TQ_LORA_I8 = 2, TQ_LORA_W = 16 };
typedef struct {
    const void *at, *bt;
    const float *scale;
    int64_t r, dtype, nblocks;
    int64_t blocks[TQ_LORA_MAX_BLOCKS][4];
} tq_lora_mat;

/* The adapters of one step: row t of x uses adapters[row_adapter[t]], or
 * none when that is negative (or not below n_adapters). */
typedef struct {
    int64_t n_adapters;
    const tq_lora_mat *const *adapters;
    const int64_t *row_adapter;
} tq_lora_batch;

/* Seconds spent per phase kind by thread 0 (tq_decode_profile), while
 * enabled: 0 QKV projection + RoPE/KV write, 1 attention (+ quantizing its
 * output), 2 output projection (+ norm), 3 gate/up projection, 4 SiLU * up
 * (+ quantizing), 5 down projection (+ norm), 6 LM head; each up to the end
 * of the phase as thread 0 sees it (its wait included). */
#define TQ_PHASES 7
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

/* A counter on its own cache line. A phase has nthreads + 1 of them: claim
 * counters, one per thread's range of chunks (claim_chunk), then the count
 * of finished chunks. */
typedef struct {
    int64_t v;
    char pad[56];
} ctr_line;

/* The next chunk of a phase of n chunks for thread tid of nt: first its own
 * range [tid n / nt, (tid + 1) n / nt) front to back (consecutive weight
 * rows, so its memory stream runs on from chunk to chunk), then, its range
 * used up, those left in the other threads' ranges (so a thread the OS
 * preempts holds back at most the chunk it is running); -1 when none is
 * left. Each chunk is handed out exactly once: owner and helpers take it
 * from the same counter. */
static inline int64_t claim_chunk(ctr_line *claims, int64_t n, int tid, int nt) {
    for (int i = 0; i < nt; i++) {
        const int u = (tid + i) % nt;
        const int64_t lo = n * u / nt, len = n * (u + 1) / nt - lo;
        if (__atomic_load_n(&claims[u].v, __ATOMIC_RELAXED) >= len) continue;
        const int64_t c = __atomic_fetch_add(&claims[u].v, 1, __ATOMIC_ACQ_REL);
        if (c < len) return lo + c;
    }
    return -1;
}

/* Wait until *completed >= p: spin with pause (a phase's last chunk takes
 * microseconds), then yield the CPU, so that on an oversubscribed machine the
 * thread holding that chunk can run. */
static inline void wait_phase(const int64_t *completed, int64_t p) {
    for (int spins = 0; __atomic_load_n(completed, __ATOMIC_ACQUIRE) < p; spins++) {
        if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* Whether M rows through L meet an integer kernel (and need their activations quantized). */
static inline int desc_needs_quantized(const tq_linear_desc *L, int64_t M) {
    for (int64_t i = 0; i < L->nparts; i++)
        if (!IS_HALF(L->parts[i].kind) && !panel_route(L->bits, L->parts[i].kind, M)) return 1;
    return 0;
}

/* Output columns [lo, hi) of y = x @ W^T (+ bias) (+ res) for M rows (a
 * range of W's stacked output rows, crossing part boundaries). x: float rows
 * (for float16 parts and the panel GEMM), qa/fa: the same rows quantized
 * (for the integer kernels), or qa the same rows in bfloat16 (for the
 * bfloat16 panel GEMM, L->bf16; see quantize_rows); pbuf: this thread's panel buffer [K, PANEL_N]. y
 * and res have row stride n_total; res may alias y (each element is read,
 * then written, by the one chunk that owns its column). */
static void linear_cols(const tq_linear_desc *L, const float *x, const void *qa, const float *fa, int64_t M, float *y,
                        const float *res, int64_t lo, int64_t hi, float *pbuf) {
    const int64_t K = L->k, nb = K / QK, N = L->n_total;
    int64_t n0 = 0;
    for (int64_t i = 0; i < L->nparts && n0 < hi; i++) {
        const tq_part *p = &L->parts[i];
        const int64_t a = lo > n0 ? lo - n0 : 0, b = hi < n0 + p->n ? hi - n0 : p->n;
        if (a < b) {
            const int64_t c = n0 + a; /* first output column */
            const float *bias = L->bias ? L->bias + c : 0, *r = res ? res + c : 0;
            if (panel_route(L->bits, p->kind, M)) { /* the calling thread's panel buffer: cannot fail */
                const int64_t eb = IS_HALF(p->kind) ? 2 * K : nb * QBYTES[p->kind], sc = NSCALES(p->kind);
                panel_call((int)p->kind, p->q + a * eb, p->d ? p->d + a * nb * sc : 0, p->m ? p->m + a * nb : 0, b - a,
                           K, x, K, panel_bf16(L, M) ? (const uint16_t *)qa : 0, M, y + c, N, bias, r, N, pbuf);
            } else if (IS_HALF(p->kind)) {
                tq_matmul_half(p->kind == 5, (const uint16_t *)p->q + a * K, b - a, K, x, K, M, y + c, N, bias, r, N);
            } else {
                const int kind = (int)p->kind;
                tq_matmul(kind, (int)L->bits, p->q + a * nb * QBYTES[kind], p->d + a * nb * NSCALES(kind),
                          p->m ? p->m + a * nb : 0, b - a, K, qa, fa, M, y + c, N, bias, r, N);
            }
        }
        n0 += p->n;
    }
}

/* Rows [t0, t1) of the M rows x [M, K] quantized for L's activation
 * precision (if it has block parts for the integer kernels), or rounded to
 * bfloat16 into qa for the bfloat16 panel GEMM; the route, panel or
 * integer, is the one M rows take. Rows are quantized independently, so
 * any split of [0, M) gives the same result. */
static inline void quantize_rows(const tq_linear_desc *L, const float *x, int64_t M, int64_t t0, int64_t t1, void *qa,
                                 float *fa) {
    const int64_t K = L->k;
    if (panel_bf16(L, M))
        panel_x(x + t0 * K, K, t1 - t0, K, (uint16_t *)qa + t0 * K);
    else if (desc_needs_quantized(L, M))
        tq_quantize((int)L->bits, x + t0 * K, K, t1 - t0, K, (char *)qa + t0 * K * (L->bits / 8),
                    fa + t0 * FA * (K / QK));
}

/* RMSNorm of rows [t0, t1) of x [T, H] with weight w into xn, then their
 * quantization for L (as T rows take it). */
static void norm_quantize(const float *x, const float *w, float *xn, int64_t T, int64_t t0, int64_t t1, int64_t H,
                          float eps, const tq_linear_desc *L, void *qa, float *fa) {
    for (int64_t t = t0; t < t1; t++) rms_norm_row(x + t * H, w, xn + t * H, H, eps);
    quantize_rows(L, xn, T, t0, t1, qa, fa);
}

/* Rows from which a phase's tail is split across the threads (a sub-phase
 * of row chunks) instead of run by the thread that finished the phase: at
 * 64 rows the serial tails (RoPE + KV write, the RMSNorms and their
 * quantization) held the other thread idle for ~4 ms of a ~95 ms step. */
#define ROW_TAIL_MIN 16

/* Chunks of a projection with N outputs: nt ranges (one a thread, see
 * claim_chunk) of k chunks each, as many as chunk_rows needs to end on
 * chunks of one group of `align` rows (16: the interleaved kinds' row
 * groups; PANEL_N on the panel GEMM). */
static inline int64_t linear_chunks(int64_t N, int nt, int64_t align) {
    const int64_t quarter = ((N + align - 1) / align + nt - 1) / nt / 4; /* of the largest range, in groups */
    int64_t k = 3;
    while (quarter >> (k - 2)) k++;
    return k * nt;
}

/* Groups of a range of g left after its chunk j (chunk_rows): three
 * quarters, a half, a quarter, then halving. */
static inline int64_t chunk_left(int64_t g, int64_t j) { return j < 3 ? g * (3 - j) / 4 : (g / 4) >> (j - 2); }

/* Output rows [*lo, *hi) of chunk c of n (linear_chunks) of a projection
 * with N outputs. Thread u's range, groups [G u / nt, G (u + 1) / nt) of
 * the G groups of `align` rows, is cut into three quarters and then
 * chunks that halve in size down to one group (chunk_left): the range is
 * still one stream front to back; a thread the OS preempts holds back at
 * most a quarter of its range, as before; and when a thread runs out of
 * work, what the other is still running is small. With 4 equal chunks a
 * thread, the thread that finished first waited at every phase's end for
 * up to a quarter of the other's range (at the end of a batch-1 step of
 * the default model ~100 us on average, for the 6144-row chunks of its LM
 * head; with these chunks steps of 1 to 64 rows took 0.92-0.97x the time,
 * docs/benchmarks.md).
 * Every output is still computed whole by one chunk, in the kernel's
 * order: results do not depend on the chunking. */
static inline void chunk_rows(int64_t N, int nt, int64_t align, int64_t n, int64_t c, int64_t *lo, int64_t *hi) {
    const int64_t G = (N + align - 1) / align, k = n / nt, u = c / k, j = c % k;
    const int64_t g0 = G * u / nt, g = G * (u + 1) / nt - g0;
    const int64_t a = (g0 + g - (j == 0 ? g : chunk_left(g, j - 1))) * align;
    const int64_t b = (g0 + g - (j == k - 1 ? 0 : chunk_left(g, j))) * align;
    *lo = a < N ? a : N;
    *hi = b < N ? b : N;
}

/* Attention task c of tasks split hsplit to a (query, KV head): its group
 * *G, query b of the group and KV head kh. */
static inline const tq_attn_group *attn_task(const tq_attn_group *groups, int64_t nkv, int64_t hsplit, int64_t c,
                                             int64_t *b, int64_t *kh) {
    int64_t j = c / hsplit, gi = 0;
    while (j >= groups[gi].B * nkv) j -= groups[gi++].B * nkv;
    *b = j / nkv, *kh = j % nkv;
    return &groups[gi];
}

/* Bytes of keys and values a thread prefetches for the attention phase at
 * most (prefetch_attention_kv). */
#define KV_PREFETCH_BYTES (256 * 1024)

/* Prefetch into L2 the key and value rows that thread tid of nt will read
 * in the attention phase of layer ly (its own range of the phase's `tasks`
 * tasks, hsplit of them for each (query, KV head), as claim_chunk hands
 * them out; up to KV_PREFETCH_BYTES), so that they arrive while the QKV projection streams
 * its weights. From memory a task's rows (a KV head's part of each pool
 * row, strided by the other heads) came at ~5-9 GB/s: at batch 1 and
 * context 48 the attention phase took 0.4-0.5 ms of a ~5 ms step, 0.3 with
 * the prefetch, and in one process alternating with and without it the
 * step took 0.951x the time (0.954x at 8 rows, 0.99x at 1 x 300, 1.00x at
 * 64 rows, where the rows are past the budget). */
static void prefetch_attention_kv(const tq_decoder_desc *D, const tq_layer_desc *ly, const tq_attn_group *groups,
                                  int64_t tasks, int64_t hsplit, int tid, int nt) {
    const int64_t nkv = D->nkv, hd = D->hd;
    const int64_t part = D->kv_kind == TQ_KV_Q8 ? hd + KV_Q8_SCALE_BYTES : hd * (D->kv_kind == TQ_KV_F16 ? 2 : 4);
    int64_t budget = KV_PREFETCH_BYTES;
    for (int64_t c = tasks * tid / nt; c < tasks * (tid + 1) / nt && budget > 0; c++) {
        if (c > tasks * tid / nt && c / hsplit == (c - 1) / hsplit) continue; /* the same rows as the task before */
        int64_t b, kh;
        const tq_attn_group *G = attn_task(groups, nkv, hsplit, c, &b, &kh);
        for (int64_t i = 0; i < G->L && budget > 0; i++, budget -= 2 * part) {
            const int64_t off = (G->kv_slots[b * G->L + i] * nkv + kh) * part;
            for (int64_t o = 0; o < part; o += 64) {
                __builtin_prefetch((const char *)ly->k_pool + off + o, 0, 2);
                __builtin_prefetch((const char *)ly->v_pool + off + o, 0, 2);
            }
        }
    }
}

/* What a phase's tail reads and writes (tq_decode_layers' buffers). */
typedef struct {
    const tq_decoder_desc *D;
    float *x, *xn, *qkv, *q, *attn, *fa;
    void *qa;
    const float *cos_, *sin_;
    const int64_t *write_slots, *out_rows;
    int64_t T, S;
    int head;
    /* LoRA rows, or NULL; lt: [r_max, T] rank-major, the x @ at of the next projection, rank c of the row
     * at position j of lora_rows at lt[c T + j]; lora_rows: the rows with an adapter, grouped by adapter
     * (adapter a's are lora_rows[lora_start[a] .. lora_start[a + 1])) */
    const tq_lora_batch *lora;
    float *lt;
    int64_t r_max;
    const int64_t *lora_rows, *lora_start;
} step_ctx;

#include "lora_kernels.h" /* lora_a_rows, lora_b_cols */

/* Rows of the tail of phase ph (of kind `kind`, layer ly, li; last: the
 * head's phase) and, with r1 > r0, that tail over rows [r0, r1) (tmp: hd
 * floats of the calling thread). The tails: after the first phase and
 * each down projection, the next layer's RMSNorm + quantizing (or the
 * final norm of the S output rows + quantizing for the head); after QKV,
 * RoPE + KV write; after the output projection, RMSNorm + quantizing for
 * gate/up; after attention and SiLU, the quantizing their chunks did not do
 * (o_blocks, down_blocks). Every tail is row by row, so any split of its
 * rows gives the same result. */
static int64_t phase_tail(const step_ctx *C, int64_t ph, int last, int64_t kind, int64_t li, int o_blocks,
                          int down_blocks, int64_t r0, int64_t r1, float *tmp) {
    const tq_decoder_desc *D = C->D;
    const tq_layer_desc *ly = li >= 0 && li < D->n_layers ? &D->layers[li] : 0;
    const int64_t T = C->T, H = D->hidden, nh = D->nh, nkv = D->nkv, hd = D->hd, half = hd / 2;
    if (last) return 0; /* nothing after the head */
    if (ph == 0 || kind == 5) { /* norm for the next layer's QKV, or for the head */
        const tq_layer_desc *nx = li + 1 < D->n_layers ? &D->layers[li + 1] : 0;
        if (nx) {
            if (r1 > r0) norm_quantize(C->x, nx->ln1, C->xn, T, r0, r1, H, D->eps, nx->qkv, C->qa, C->fa);
            lora_a_rows(C, li + 1, 0, C->xn, H, r0, r1);
            return T;
        }
        if (!C->head) return 0;
        for (int64_t i = r0; i < r1; i++) rms_norm_row(C->x + C->out_rows[i] * H, D->final_norm, C->xn + i * H, H, D->eps);
        if (r1 > r0) quantize_rows(D->head, C->xn, C->S, r0, r1, C->qa, C->fa);
        return C->S;
    }
    if (kind == 0) {
        const int64_t qkv_w = (nh + 2 * nkv) * hd;
        for (int64_t t = r0; t < r1; t++) {
            const float *src = C->qkv + t * qkv_w, *c = C->cos_ + t * half, *s = C->sin_ + t * half;
            float *qo = C->q + t * nh * hd;
            if (D->kv_kind == TQ_KV_Q8)
                rope_store_row_q8(src, c, s, qo, ly->k_pool, ly->v_pool, C->write_slots[t], nh, nkv, hd, tmp);
            else if (D->kv_kind == TQ_KV_F16)
                rope_store_row_f16(src, c, s, qo, ly->k_pool, ly->v_pool, C->write_slots[t], nh, nkv, hd, tmp);
            else
                rope_store_row(src, c, s, qo, ly->k_pool, ly->v_pool, C->write_slots[t], nh, nkv, hd);
        }
        return T;
    }
    if (kind == 1 && (!o_blocks || C->lora)) { /* with LoRA rows a tail even when the chunks quantized */
        if (r1 > r0 && !o_blocks) quantize_rows(ly->o, C->attn, T, r0, r1, C->qa, C->fa);
        lora_a_rows(C, li, 1, C->attn, nh * hd, r0, r1);
        return T;
    }
    if (kind == 2) {
        if (r1 > r0) norm_quantize(C->x, ly->ln2, C->xn, T, r0, r1, H, D->eps, ly->gate_up, C->qa, C->fa);
        lora_a_rows(C, li, 2, C->xn, H, r0, r1);
        return T;
    }
    if (kind == 4 && (!down_blocks || C->lora)) {
        if (r1 > r0 && !down_blocks) quantize_rows(ly->down, C->xn, T, r0, r1, C->qa, C->fa);
        lora_a_rows(C, li, 3, C->xn, D->ffn, r0, r1);
        return T;
    }
    return 0;
}

/* Run every layer of D over x [T, H] (float32, contiguous; the residual
 * stream, updated in place) for T single-token rows at RoPE angles cos, sin
 * [T, hd / 2], writing each layer's keys/values to pool slots write_slots [T]
 * before attending (groups: every row in exactly one group), on nthreads
 * OpenMP threads (<= 0: the default team size). Then, when D has a head and
 * logits is not NULL, the final RMSNorm and the LM head of the S rows
 * out_rows [S] of x into logits [S, head->n_total] (the same team: no second
 * OpenMP start). lora (or NULL): the LoRA adapters of the rows that have
 * one; each projection of such a row adds its adapter's update
 * y += (x @ at) @ bt, as models/lora.py does after the base projection:
 * x @ at in the tail of the phase that finished x (row by row), the
 * product with bt in the projection's own chunks (column by column, after
 * their base columns). Returns 0, or -1 when the scratch buffers cannot be
 * allocated (x untouched then).
 *
 * Scheduling. The step is a sequence of phases, six per layer: QKV (tail:
 * RoPE + KV write), attention (each chunk quantizing its output columns'
 * blocks, or a tail rounding them for the bfloat16 panel), output
 * projection (tail: RMSNorm + quantizing), gate/up, SiLU * up (each chunk
 * quantizing its blocks for the integer kernels, or a tail rounding them
 * for the bfloat16 panel), down projection (tail: the next layer's RMSNorm + quantizing,
 * or the head's), then the head; a first phase norms the input. Each phase
 * is cut into chunks, a range of consecutive chunks per thread, which any
 * thread may claim (claim_chunk: a thread runs its own range in order, so
 * its weight reads stay one stream, then helps with the others'). The
 * thread that finishes a phase's last chunk runs its tail (the small serial
 * piece, phase_tail) and opens the next phase; a tail of ROW_TAIL_MIN rows
 * or more is instead split into row chunks that every thread claims, and
 * the thread that finishes the last of them opens the next phase. No
 * thread waits for another thread, only for unfinished chunks: when the OS
 * preempts a thread (more runnable threads than cores: the server's event
 * loop, a client, other processes), the others take the chunks it would
 * have run. With barriers between operations (OpenMP's or a spin barrier)
 * every operation waited for the preempted thread: measured on 2 cores at
 * load ~9, 350-520 ms a step instead of 60-80 ms op by op. */
int tq_decode_layers(const tq_decoder_desc *D, float *x, int64_t T, const float *cos_, const float *sin_,
                     const int64_t *write_slots, const tq_attn_group *groups, int64_t n_groups, int nthreads,
                     const int64_t *out_rows, int64_t S, float *logits, const tq_lora_batch *lora) {
    const int64_t H = D->hidden, nh = D->nh, nkv = D->nkv, hd = D->hd, F = D->ffn, g = nh / nkv;
    const int64_t qkv_w = (nh + 2 * nkv) * hd, kmax = H > nh * hd ? (H > F ? H : F) : (nh * hd > F ? nh * hd : F);
    const int head = logits && D->head && S > 0; /* S <= T rows: the scratch fits */
    if (T <= 0) return 0;
    int64_t Lmax = 1, tasks = 0;
    for (int64_t i = 0; i < n_groups; i++) {
        Lmax = groups[i].L > Lmax ? groups[i].L : Lmax;
        tasks += groups[i].B * nkv;
    }
    const int nt_max = nthreads > 0 ? nthreads : omp_get_max_threads();
    int64_t r_max = 0; /* the largest LoRA rank of the step's adapters */
    if (lora && lora->n_adapters <= 0) lora = 0;
    for (int64_t a = 0; lora && a < lora->n_adapters; a++)
        for (int64_t i = 0; i < 4 * D->n_layers; i++)
            if (lora->adapters[a][i].at && lora->adapters[a][i].r > r_max) r_max = lora->adapters[a][i].r;
    if (!r_max) lora = 0;
    /* attention tasks: one per (query, KV head), or, when those are too few to share among the threads
     * (batch 1: 3 tasks on 2 threads), one per query head (the same results: each head's scores, softmax
     * and values are computed alone either way); ag query heads a task */
    const int64_t hsplit = tasks < 4 * nt_max ? g : 1, att_tasks = tasks * hsplit, ag = g / hsplit;
    /* SiLU chunks: 256 columns, or whole rows from 16 rows (at 64 rows 256-column chunks, ~12k a step,
     * took 4.5 ms a step of a ~95 ms step in claiming and finishing chunks; whole rows 1.9 ms) */
    const int64_t silu_w = T >= 16 ? (F + QK - 1) / QK * QK : 256, silu_per_row = (F + silu_w - 1) / silu_w;
    const int64_t n_phases = 1 + 6 * D->n_layers + head;
    /* float scratch: xn [T, kmax], qkv [T, qkv_w], q [T, nh hd], attn [T, nh hd], gu [T, 2F], scores per
     * thread, hd per thread for the int8 or float16 key row being written */
    const size_t nf = (size_t)(T * kmax + T * qkv_w + 2 * T * nh * hd + T * 2 * F + (int64_t)nt_max * (g * Lmax + hd) +
                               T * r_max);
    const size_t qbytes = ((size_t)T * kmax * 2 + 63) / 64 * 64, fbytes = ((size_t)T * FA * (kmax / QK) * sizeof(float) + 63) / 64 * 64;
    /* per phase: nt_max claim counters, finished chunks, then the row tail's open flag, claims, finished rows */
    const int64_t n_ctr = nt_max + 4;
    const size_t cbytes = (size_t)n_phases * n_ctr * sizeof(ctr_line);
    /* a panel buffer per thread when a projection may take the panel GEMM (no projection has more than T rows) */
    const size_t pbytes = panel_route(16, 0, T) ? (size_t)nt_max * kmax * PANEL_N * sizeof(float) : 0;
    /* the rows with an adapter grouped by adapter, and where each adapter's start (n_adapters + 1) */
    const size_t lbytes = lora ? (size_t)(T + lora->n_adapters + 1) * sizeof(int64_t) : 0;
    char *buf = aligned_alloc(64, (nf * sizeof(float) + 63) / 64 * 64 + qbytes + fbytes + cbytes + pbytes + lbytes);
    if (!buf) return -1;
    float *xn = (float *)buf, *qkv = xn + T * kmax, *q = qkv + T * qkv_w, *attn = q + T * nh * hd;
    float *gu = attn + T * nh * hd, *scores = gu + T * 2 * F, *ktmp = scores + (int64_t)nt_max * g * Lmax;
    float *lt = ktmp + (int64_t)nt_max * hd; /* [r_max, T], rank-major (step_ctx) */
    void *qa = buf + (nf * sizeof(float) + 63) / 64 * 64;
    float *fa = (float *)((char *)qa + qbytes);
    ctr_line *ctr = (ctr_line *)((char *)fa + fbytes); /* phase ph: ctr + ph n_ctr */
    float *pbuf = (float *)((char *)ctr + cbytes);
    memset(ctr, 0, cbytes);
    int64_t *lora_rows = (int64_t *)((char *)pbuf + pbytes), *lora_start = lora_rows + T;
    if (lora) { /* a counting sort of the rows by adapter */
        const int64_t na = lora->n_adapters;
        memset(lora_start, 0, (size_t)(na + 1) * sizeof(int64_t));
        for (int64_t t = 0; t < T; t++) {
            const int64_t a = lora->row_adapter[t];
            if (a >= 0 && a < na) lora_start[a + 1]++;
        }
        for (int64_t a = 0; a < na; a++) lora_start[a + 1] += lora_start[a];
        for (int64_t t = 0, *next = lora_rows; t < T; t++) { /* lora_start[a] moves to a's end, then back */
            const int64_t a = lora->row_adapter[t];
            if (a >= 0 && a < na) next[lora_start[a]++] = t;
        }
        for (int64_t a = na; a > 0; a--) lora_start[a] = lora_start[a - 1];
        lora_start[0] = 0;
    }
    int64_t completed = 0; /* phases finished (their tails included) */
    const step_ctx C = {D, x, xn, qkv, q, attn, fa, qa, cos_, sin_, write_slots, out_rows, T, S, head, lora, lt, r_max,
                        lora_rows, lora_start};
    static uint64_t steps_run; /* makes each step's planes_tag values its own */
    const uint64_t step_id = __atomic_add_fetch(&steps_run, 1, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(nt_max)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *sc = scores + (int64_t)tid * g * Lmax, *tmp = ktmp + (int64_t)tid * hd;
        const int clock = prof_on && tid == 0;
        double t_last = clock ? omp_get_wtime() : 0.0;
        for (int64_t ph = 0; ph < n_phases; ph++) {
            wait_phase(&completed, ph);
            planes_tag = step_id << 20 | (uint64_t)(ph + 1); /* qa is fixed until this phase ends */
            const int64_t li = ph == 0 ? -1 : (ph - 1) / 6, kind = ph == 0 ? 5 : (ph - 1) % 6;
            if (clock && ph > 0) { /* the phase before this one ended */
                const double now = omp_get_wtime();
                prof_acc[ph == 1 ? 5 : (ph - 2) % 6] += now - t_last;
                t_last = now;
            }
            const tq_layer_desc *ly = li >= 0 && li < D->n_layers ? &D->layers[li] : 0;
            /* SiLU phase: its chunks quantize the down projection's input block by block (silu_w and F
             * are multiples of QK) when integer kernels take it; else its tail rounds it (quantize_rows) */
            const int down_blocks = ly && kind == 4 && !panel_bf16(ly->down, T) && desc_needs_quantized(ly->down, T);
            /* attention phase: likewise each (sequence, KV head) chunk quantizes its g hd output columns for
             * the output projection, when they are whole blocks */
            const int o_blocks = ly && kind == 1 && (ag * hd) % QK == 0 && !panel_bf16(ly->o, T) &&
                                 desc_needs_quantized(ly->o, T);
            const tq_linear_desc *lin = 0;
            float *y = 0;
            const float *xin = xn, *res = 0;
            int64_t n_chunks = 1;
            int lp = -1; /* the projection's LoRA index (tq_lora_mat) */
            if (ph == n_phases - 1 && head) {
                lin = D->head, y = logits;
            } else if (ph > 0) {
                switch (kind) {
                case 0: lin = ly->qkv, y = qkv, lp = 0; break;
                case 1: n_chunks = att_tasks; break;
                case 2: lin = ly->o, xin = attn, y = x, res = x, lp = 1; break;
                case 3: lin = ly->gate_up, y = gu, lp = 2; break;
                case 4: n_chunks = T * silu_per_row; break;
                case 5: lin = ly->down, y = x, res = x, lp = 3; break;
                }
            }
            if (!lora) lp = -1;
            const int64_t M = ph == n_phases - 1 && head ? S : T;
            if (ly && kind == 0) /* the attention phase after this one reads them */
                prefetch_attention_kv(D, ly, groups, att_tasks, hsplit, tid, nt);
            const int64_t align = lin && panel_route(lin->bits, 0, M) ? PANEL_N : 16;
            if (lin) n_chunks = linear_chunks(lin->n_total, nt, align);
            if (n_chunks < 1) n_chunks = 1; /* a phase always has a last chunk, which opens the next */
            ctr_line *claims = ctr + ph * n_ctr, *done = claims + nt_max, *tail_open = done + 1;
            const int last = ph == n_phases - 1 && head;
            const int64_t tail_n = phase_tail(&C, ph, last, kind, li, o_blocks, down_blocks, 0, 0, tmp);
            const int row_tail = tail_n >= ROW_TAIL_MIN;
            for (;;) {
                const int64_t c = claim_chunk(claims, n_chunks, tid, nt);
                if (c < 0) break;
                if (lin) {
                    int64_t lo, hi;
                    chunk_rows(lin->n_total, nt, align, n_chunks, c, &lo, &hi);
                    linear_cols(lin, xin, qa, fa, M, y, res, lo, hi, pbuf + (int64_t)tid * kmax * PANEL_N);
                    if (lp >= 0) lora_b_cols(&C, li, lp, y, lin->n_total, lo, hi); /* its rows' adapters' updates */
                } else if (ph > 0 && kind == 1 && c < att_tasks) { /* attention of one query's ag heads */
                    int64_t b, kh;
                    const tq_attn_group *G = attn_task(groups, nkv, hsplit, c, &b, &kh);
                    const int64_t r = G->rows ? G->rows[b] : G->row_start + b;
                    const int64_t h0 = kh * g + c % hsplit * ag; /* the task's first query head */
                    const float *qh = q + r * nh * hd + h0 * hd, *bb = G->bias ? G->bias + b * G->L : NULL;
                    float *oh = attn + r * nh * hd + h0 * hd, *pr = NULL;
                    if (G->probe && G->probe_layers[li] >= 0) /* the attention probe: this task's heads' weights */
                        pr = G->probe + ((G->probe_layers[li] * G->B + b) * nh + h0) * G->L;
                    if (D->kv_kind == TQ_KV_Q8)
                        attend_kv_head_q8(qh, ly->k_pool, ly->v_pool, G->kv_slots + b * G->L, bb, G->L, ag, hd, nkv, kh,
                                          D->scale, sc, oh, pr);
                    else if (D->kv_kind == TQ_KV_F16)
                        attend_kv_head_f16(qh, ly->k_pool, ly->v_pool, G->kv_slots + b * G->L, bb, G->L, ag, hd, nkv * hd,
                                           kh, D->scale, sc, oh, pr);
                    else
                        attend_kv_head(qh, ly->k_pool, ly->v_pool, G->kv_slots + b * G->L, bb, G->L, ag, hd, nkv * hd, kh,
                                       D->scale, sc, oh, pr);
                    if (o_blocks) {
                        const int64_t nbo = nh * hd / QK, b0 = h0 * hd / QK;
                        quantize_blocks((int)ly->o->bits, attn + r * nh * hd, nbo, b0, b0 + ag * hd / QK,
                                        (char *)qa + r * nh * hd * (ly->o->bits / 8), fa + r * FA * nbo);
                    }
                } else if (ph > 0 && kind == 4) { /* SiLU(gate) * up into xn [T, F], silu_w columns a chunk */
                    const int64_t t = c / silu_per_row, j = c % silu_per_row * silu_w, w = F - j < silu_w ? F - j : silu_w;
                    silu_mul(gu + t * 2 * F + j, gu + t * 2 * F + F + j, xn + t * F + j, w);
                    if (down_blocks) /* the down projection's blocks of these columns, here rather than in a serial tail */
                        quantize_blocks((int)ly->down->bits, xn + t * F, F / QK, j / QK, (j + w) / QK,
                                        (char *)qa + t * F * (ly->down->bits / 8), fa + t * FA * (F / QK));
                }
                if (__atomic_add_fetch(&done->v, 1, __ATOMIC_ACQ_REL) != n_chunks) continue;
                /* the last chunk of the phase: open its row tail, or run its tail and open the next phase */
                if (row_tail) {
                    __atomic_store_n(&tail_open->v, 1, __ATOMIC_RELEASE);
                    break;
                }
                phase_tail(&C, ph, last, kind, li, o_blocks, down_blocks, 0, tail_n, tmp);
                __atomic_store_n(&completed, ph + 1, __ATOMIC_RELEASE);
            }
            if (row_tail) { /* row chunks of about a quarter of a thread's share */
                const int64_t rows_c = (tail_n + 4 * nt - 1) / (4 * nt), n_tc = (tail_n + rows_c - 1) / rows_c;
                wait_phase(&tail_open->v, 1);
                for (;;) {
                    const int64_t c = __atomic_fetch_add(&tail_open[1].v, 1, __ATOMIC_ACQ_REL);
                    if (c >= n_tc) break;
                    const int64_t r0 = c * rows_c, r1 = r0 + rows_c < tail_n ? r0 + rows_c : tail_n;
                    phase_tail(&C, ph, last, kind, li, o_blocks, down_blocks, r0, r1, tmp);
                    if (__atomic_add_fetch(&tail_open[2].v, 1, __ATOMIC_ACQ_REL) == n_tc)
                        __atomic_store_n(&completed, ph + 1, __ATOMIC_RELEASE);
                }
            }
        }
        planes_tag = 0;
        if (clock) {
            wait_phase(&completed, n_phases);
            prof_acc[head ? 6 : 5] += omp_get_wtime() - t_last;
        }
    }
    free(buf);
    return 0;
}
