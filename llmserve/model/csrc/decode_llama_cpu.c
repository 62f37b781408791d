/*
 * A whole forward pass of a Llama-family decoder (Llama, Mistral, Qwen2's q/k/v bias, Qwen3's per-head q/k
 * norms) for a step of at most MAX_TOKENS bf16 tokens on the CPU, in one call: embedding, every layer
 * (residual add + RMSNorm, qkv projection, rotary, new K/V written to their paged-cache slots (bf16, or
 * int8 with a scale per row), paged attention, o projection, add + RMSNorm, gate_up projection with SiLU * up, down projection) and the final
 * norm. At batch 1 the weights stream in a few tens of milliseconds; the same work driven from Python, one
 * module and one kernel call at a time, added a quarter to that.
 *
 * It is the other kernels' code, included here, in the same order and with the same roundings as the
 * per-module path (llama.py with cpu_linear, cpu_fused and the attention kernel), so its hidden states are
 * the same bits. One OpenMP parallel region covers the whole step: the projections and attention are split
 * over its threads; each thread norms the rows it needs itself (the same bits as the others), and readies
 * the heads of the qkv columns it computed, so a layer costs four barriers (the per-module path forks and
 * joins a team five times a layer).
 *
 * Every token attends as a decode query does: over its sequence's cache up to its own position (the keys
 * of the step's earlier tokens of the same sequence are written first), so a short prefill chunk fits too.
 *
 * LoRA adapters (llmserve/model/lora.py): a projection with adapter slots adds, for each token whose adapter has
 * a slot, (x A^T) B^T of that slot to the thread's columns, by lora_bf16_cpu.c as the per-module path does (each
 * thread shrinks the rows itself), so the hidden states are its bits here too.
 *
 * Built on first use by llmserve/model/cpu_decode.py, which prepares the descriptors once per model.
 */
#include "lora_bf16_cpu.c" /* and linear_bf16_cpu.c, which it includes */
#include "linear_int8_cpu.c"
#include "elementwise_bf16_cpu.c"
#include "../attention/csrc/paged_attention_cpu.c"

#include <stdlib.h>

#define MAX_TOKENS 16

/* How a projection's weights are stored; each format brings the kernel that computes a range of its outputs. */
enum { WEIGHTS_BF16 = 0, WEIGHTS_INT8 = 1 };

typedef struct {
    int32_t format; /* WEIGHTS_* */
    int32_t n, k;   /* output and input features */
    const void *weight; /* [n, k] */
    const float *scale; /* [n] per output channel, for quantized formats; NULL for bf16 */
    const uint16_t *bias; /* [n] bf16 or NULL */
    const uint16_t *lora_a; /* [slots, lora_width, k] bf16, or NULL without LoRA */
    const uint16_t *lora_bt; /* [slots, lora_width, n] bf16: B transposed */
    int32_t lora_width;
} linear_weights;

typedef struct {
    const uint16_t *input_norm, *post_attention_norm; /* [hidden] */
    const uint16_t *q_norm, *k_norm; /* [head_dim], or NULL without per-head norms */
    linear_weights qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* in the decoder's kv_format: paged_attention_cpu.c's layout */
} layer_weights;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int32_t kv_format; /* KV_BF16, or KV_INT8 (--kv-cache-dtype int8) */
    float eps, scale;
    const uint16_t *embed, *final_norm;
    const float *cos_cache, *sin_cache; /* [max_positions, head_dim / 2] */
    const layer_weights *layers;
    /* scratch shared by the threads, MAX_TOKENS rows of: qkv width, heads * head_dim (twice), hidden,
       2 * intermediate, intermediate */
    uint16_t *qkv, *query, *attn, *proj, *gate_up, *act;
} decoder;

typedef struct {
    int32_t tokens, max_blocks, threads, path; /* path: a PATH_* of bf16.h */
    const int64_t *input_ids, *positions, *slots; /* [tokens] */
    const int32_t *tables; /* [tokens, max_blocks]: the block table of each token's sequence */
    const int32_t *lens; /* [tokens]: each token's context, its position + 1 */
    uint16_t *out; /* [tokens, hidden]: the final norm's output */
    const int32_t *lora_slots; /* [tokens]: each token's adapter slot (-1: none); NULL when no token has one */
} decode_step;

/* This thread's share of y = x W^T (+ bias), the step's adapters added: output columns [first, last) for all m
   rows of x ([m, k]). */
static void linear_columns(const decoder *d, const decode_step *s, const linear_weights *lw, const uint16_t *x,
                           uint16_t *y, int first, int last) {
    const int m = s->tokens, path = s->path;
    switch (lw->format) {
    case WEIGHTS_BF16:
        linear_rows_bf16(x, lw->weight, lw->bias, y, m, lw->n, lw->k, lw->k, first, last, path);
        break;
    case WEIGHTS_INT8:
        linear_rows_int8(x, m, lw->k, lw->k, lw->weight, lw->scale, lw->bias, lw->n, y, first, last, path);
        break;
    default: break; /* rejected by llmserve_decode_step */
    }
    if (s->lora_slots != NULL && lw->lora_a != NULL)
        lora_add_columns(x, s->lora_slots, m, lw->lora_a, lw->lora_bt, lw->lora_width, lw->k, lw->n, y, first, last,
                         path);
}

static void linear_team(const decoder *d, const decode_step *s, const linear_weights *lw, const uint16_t *x,
                        uint16_t *y) {
    int first, last;
    thread_share(lw->n, &first, &last);
    linear_columns(d, s, lw, x, y, first, last);
}

/* act = SiLU(gate) * up: each thread computes the same range of gate and up columns, so it can multiply
   them without waiting for the others. */
static void gate_up_team(const decoder *d, const decode_step *s, const linear_weights *lw, const uint16_t *normed) {
    const int inter = d->intermediate, m = s->tokens;
    int first, last;
    thread_share(inter, &first, &last);
    linear_columns(d, s, lw, normed, d->gate_up, first, last);
    linear_columns(d, s, lw, normed, d->gate_up, inter + first, inter + last);
    for (int t = 0; t < m; t++) {
        const uint16_t *row = d->gate_up + (size_t)t * 2 * inter;
        silu_mul_span(row + first, row + inter + first, d->act + (size_t)t * inter + first, last - first);
    }
}

static int thread_index(void) {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* This thread's qkv columns, whole heads of them, and those heads made ready for attention: per-head norm
   and rotary in place, queries copied out, keys and values written to their cache slots. A thread touches
   only its own heads, so no other thread is waited for until attention. */
static void qkv_team(const decoder *d, const layer_weights *lw, const decode_step *s, const uint16_t *normed) {
    const int dim = d->head_dim, heads = d->heads, kv_heads = d->kv_heads, width = (heads + 2 * kv_heads) * dim;
    int first = 0, last = width;
#if defined(_OPENMP)
    thread_rows(width, dim, omp_get_thread_num(), omp_get_num_threads(), &first, &last);
#endif
    linear_columns(d, s, &lw->qkv, normed, d->qkv, first, last);
    for (int t = 0; t < s->tokens; t++) {
        uint16_t *row = d->qkv + (size_t)t * width;
        const float *cos_row = d->cos_cache + (size_t)s->positions[t] * (dim / 2);
        const float *sin_row = d->sin_cache + (size_t)s->positions[t] * (dim / 2);
        const int64_t block = s->slots[t] / d->block_size, offset = s->slots[t] % d->block_size;
        for (int head = first / dim; head < last / dim; head++) {
            uint16_t *x = row + (size_t)head * dim;
            if (head < heads + kv_heads) { /* a query or key head */
                const uint16_t *norm = head < heads ? lw->q_norm : lw->k_norm;
                if (norm != NULL) llmserve_rms_norm_bf16(x, norm, x, 1, 1, 0, 0, dim, d->eps);
                rotate_heads(x, 0, 1, cos_row, sin_row, dim / 2);
            }
            if (head < heads) {
                memcpy(d->query + ((size_t)t * heads + head) * dim, x, sizeof(uint16_t) * dim);
                continue;
            }
            void *cache = head < heads + kv_heads ? lw->k_cache : lw->v_cache;
            const int h = (head - heads) % kv_heads;
            store_row(cache, d->kv_format, (size_t)block * kv_heads + h, (int)offset, dim, d->block_size, x);
        }
    }
}

/* Each thread keeps its own copy of the residual stream and of the normed rows (the input of the next
   projection): every thread computes the same bits from the shared projection output, which spares the
   barrier that handing one thread's result to the others would cost. */
typedef struct {
    uint16_t *residual, *normed;
} thread_rows_copy;

static void embed(const decoder *d, const decode_step *s, thread_rows_copy own) {
    for (int t = 0; t < s->tokens; t++)
        memcpy(own.residual + (size_t)t * d->hidden, d->embed + (size_t)s->input_ids[t] * d->hidden,
               sizeof(uint16_t) * d->hidden);
    llmserve_rms_norm_bf16(own.residual, d->layers[0].input_norm, own.normed, s->tokens, 1, d->hidden, 0, d->hidden,
                           d->eps);
}

static int known_format(const linear_weights *lw) {
    const int lora = lw->lora_a == NULL || (lw->lora_bt != NULL && lw->lora_width > 0 && lw->lora_width <= MAX_LORA_WIDTH);
    return lora && (lw->format == WEIGHTS_BF16 || (lw->format == WEIGHTS_INT8 && lw->scale != NULL));
}

static int supported(const decoder *d, const decode_step *s, decode_fn attend) {
    if (attend == NULL || s->tokens < 1 || s->tokens > MAX_TOKENS || s->threads < 1 || d->num_layers < 1
        || !path_built(s->path))
        return 0;
    if (d->hidden > MAX_N || d->head_dim > MAX_N || d->head_dim % 2 != 0) return 0;
    for (int l = 0; l < d->num_layers; l++) {
        const layer_weights *lw = &d->layers[l];
        if (!known_format(&lw->qkv) || !known_format(&lw->o) || !known_format(&lw->gate_up)
            || !known_format(&lw->down))
            return 0;
        if ((lw->q_norm == NULL) != (lw->k_norm == NULL)) return 0;
    }
    return 1;
}

/* Returns 0, or -1 for a step or a model it cannot take (nothing is computed then). */
int llmserve_decode_step(const decoder *d, const decode_step *s) {
    /* The attention kernel's AVX-512 path (AVX512F) goes with the linears' best or AVX-512 paths. */
    const int attention_avx512 = s->path == PATH_BEST || s->path == PATH_AVX512_BF16 || s->path == PATH_AVX512;
    const decode_fn attend = d->kv_format == KV_BF16 || d->kv_format == KV_INT8
        ? choose_decode(d->kv_format, attention_avx512, d->heads, d->kv_heads, d->head_dim, d->block_size)
        : NULL;
    if (!supported(d, s, attend)) return -1;
    const size_t rows = (size_t)MAX_TOKENS * d->hidden;
    uint16_t *copies = malloc(sizeof(uint16_t) * 2 * rows * (size_t)s->threads);
    if (copies == NULL) return -1;
    const int m = s->tokens;
    /* Four barriers a layer: before attention, at its end, after the o projection, after gate_up. */
#pragma omp parallel num_threads(s->threads)
    {
        const thread_rows_copy own = {copies + 2 * rows * thread_index(), copies + (2 * thread_index() + 1) * rows};
        embed(d, s, own);
        for (int l = 0; l < d->num_layers; l++) {
            const layer_weights *lw = &d->layers[l];
            qkv_team(d, lw, s, own.normed);
#pragma omp barrier
            attend(d->query, lw->k_cache, lw->v_cache, s->tables, s->lens, d->attn, m, d->heads, d->kv_heads,
                   d->head_dim, d->block_size, s->max_blocks, d->scale);
            linear_team(d, s, &lw->o, d->attn, d->proj);
#pragma omp barrier
            llmserve_add_rms_norm_bf16(d->proj, own.residual, lw->post_attention_norm, own.normed, own.residual, m,
                                       d->hidden, d->eps);
            gate_up_team(d, s, &lw->gate_up, own.normed);
#pragma omp barrier
            linear_team(d, s, &lw->down, d->act, d->proj);
#pragma omp barrier
            if (l + 1 < d->num_layers)
                llmserve_add_rms_norm_bf16(d->proj, own.residual, d->layers[l + 1].input_norm, own.normed,
                                           own.residual, m, d->hidden, d->eps);
            else if (thread_index() == 0)
                llmserve_add_rms_norm_bf16(d->proj, own.residual, d->final_norm, s->out, own.residual, m, d->hidden,
                                           d->eps);
        }
    }
    free(copies);
    return 0;
}
