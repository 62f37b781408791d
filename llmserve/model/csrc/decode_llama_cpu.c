/*
 * A whole forward pass of a Llama-family decoder (Llama, Mistral, Qwen2's q/k/v bias, Qwen3's per-head q/k
 * norms) for a step of at most MAX_TOKENS bf16 tokens on the CPU, in one call: embedding, every layer
 * (residual add + RMSNorm, qkv projection, rotary, new K/V written to their paged-cache slots, paged
 * attention, o projection, add + RMSNorm, gate_up projection with SiLU * up, down projection) and the final
 * norm. At batch 1 the weights stream in a few tens of milliseconds; the same work driven from Python, one
 * module and one kernel call at a time, added a quarter to that.
 *
 * It is the other kernels' code, included here, in the same order and with the same roundings as the
 * per-module path (llama.py with cpu_linear, cpu_fused and the attention kernel), so its hidden states are
 * the same bits. One OpenMP parallel region covers the whole step: the projections and attention are split
 * over its threads, the small per-token work between them runs on one thread (`omp single`), and a layer
 * costs eight barriers.
 *
 * Every token attends as a decode query does: over its sequence's cache up to its own position (the keys
 * of the step's earlier tokens of the same sequence are written first), so a short prefill chunk fits too.
 *
 * Built on first use by llmserve/model/cpu_decode.py, which prepares the descriptors once per model.
 */
#include "linear_bf16_cpu.c"
#include "elementwise_bf16_cpu.c"
#include "../attention/csrc/paged_attention_cpu.c"

#define MAX_TOKENS 8

/* How a projection's weights are stored; each format brings the kernel that computes a range of its outputs. */
enum { WEIGHTS_BF16 = 0 };

typedef struct {
    int32_t format; /* WEIGHTS_* */
    int32_t n, k;   /* output and input features */
    const void *weight; /* [n, k] */
    const float *scale; /* [n] per output channel, for quantized formats; NULL for bf16 */
    const uint16_t *bias; /* [n] bf16 or NULL */
} linear_weights;

typedef struct {
    const uint16_t *input_norm, *post_attention_norm; /* [hidden] */
    const uint16_t *q_norm, *k_norm; /* [head_dim], or NULL without per-head norms */
    linear_weights qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache; /* [blocks, kv_heads, block_size, head_dim] */
} layer_weights;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const uint16_t *embed, *final_norm;
    const float *cos_cache, *sin_cache; /* [max_positions, head_dim / 2] */
    const layer_weights *layers;
    /* scratch, MAX_TOKENS rows of: hidden, hidden, qkv width, heads * head_dim (twice), hidden,
       2 * intermediate, intermediate */
    uint16_t *residual, *normed, *qkv, *query, *attn, *proj, *gate_up, *act;
} decoder;

typedef struct {
    int32_t tokens, max_blocks, threads, portable;
    const int64_t *input_ids, *positions, *slots; /* [tokens] */
    const int32_t *tables; /* [tokens, max_blocks]: the block table of each token's sequence */
    const int32_t *lens; /* [tokens]: each token's context, its position + 1 */
    uint16_t *out; /* [tokens, hidden]: the final norm's output */
} decode_step;

/* This thread's share of y = x W^T (+ bias): output columns [first, last) for all m rows of x ([m, k]). */
static void linear_columns(const linear_weights *lw, const uint16_t *x, uint16_t *y, int m, int first, int last,
                           int portable) {
    switch (lw->format) {
    case WEIGHTS_BF16:
        linear_rows_bf16(x, lw->weight, lw->bias, y, m, lw->n, lw->k, lw->k, first, last, portable);
        break;
    default: break; /* rejected by llmserve_decode_step */
    }
}

static void linear_team(const linear_weights *lw, const uint16_t *x, uint16_t *y, int m, int portable) {
    int first, last;
    thread_share(lw->n, &first, &last);
    linear_columns(lw, x, y, m, first, last, portable);
}

/* act = SiLU(gate) * up: each thread computes the same range of gate and up columns, so it can multiply
   them without waiting for the others. */
static void gate_up_team(const decoder *d, const linear_weights *lw, int m, int portable) {
    const int inter = d->intermediate;
    int first, last;
    thread_share(inter, &first, &last);
    linear_columns(lw, d->normed, d->gate_up, m, first, last, portable);
    linear_columns(lw, d->normed, d->gate_up, m, inter + first, inter + last, portable);
    for (int t = 0; t < m; t++) {
        const uint16_t *row = d->gate_up + (size_t)t * 2 * inter;
        silu_mul_span(row + first, row + inter + first, d->act + (size_t)t * inter + first, last - first);
    }
}

/* Per-head norms and rotary on the qkv rows in place, the queries copied out for attention, the keys and
   values into their cache slots. */
static void attention_inputs(const decoder *d, const layer_weights *lw, const decode_step *s) {
    const int dim = d->head_dim, q_size = d->heads * dim, kv_size = d->kv_heads * dim;
    const int width = q_size + 2 * kv_size;
    if (lw->q_norm != NULL)
        for (int t = 0; t < s->tokens; t++) {
            uint16_t *row = d->qkv + (size_t)t * width;
            llmserve_rms_norm_bf16(row, lw->q_norm, row, 1, d->heads, 0, dim, dim, d->eps);
            llmserve_rms_norm_bf16(row + q_size, lw->k_norm, row + q_size, 1, d->kv_heads, 0, dim, dim, d->eps);
        }
    llmserve_rotary_bf16(d->qkv, d->qkv + q_size, s->positions, d->cos_cache, d->sin_cache, s->tokens, d->heads,
                         d->kv_heads, dim, width, dim, width, dim);
    for (int t = 0; t < s->tokens; t++) {
        const uint16_t *row = d->qkv + (size_t)t * width;
        memcpy(d->query + (size_t)t * q_size, row, sizeof(uint16_t) * q_size);
        const int64_t block = s->slots[t] / d->block_size, offset = s->slots[t] % d->block_size;
        for (int h = 0; h < d->kv_heads; h++) {
            const size_t at = (((size_t)block * d->kv_heads + h) * d->block_size + offset) * dim;
            memcpy(lw->k_cache + at, row + q_size + h * dim, sizeof(uint16_t) * dim);
            memcpy(lw->v_cache + at, row + q_size + kv_size + h * dim, sizeof(uint16_t) * dim);
        }
    }
}

static void embed(const decoder *d, const decode_step *s) {
    for (int t = 0; t < s->tokens; t++)
        memcpy(d->residual + (size_t)t * d->hidden, d->embed + (size_t)s->input_ids[t] * d->hidden,
               sizeof(uint16_t) * d->hidden);
    llmserve_rms_norm_bf16(d->residual, d->layers[0].input_norm, d->normed, s->tokens, 1, d->hidden, 0, d->hidden,
                           d->eps);
}

static int supported(const decoder *d, const decode_step *s, decode_fn attend) {
    if (attend == NULL || s->tokens < 1 || s->tokens > MAX_TOKENS || s->threads < 1 || d->num_layers < 1) return 0;
    if (d->hidden > MAX_N || d->head_dim > MAX_N || d->head_dim % 2 != 0) return 0;
    for (int l = 0; l < d->num_layers; l++) {
        const layer_weights *lw = &d->layers[l];
        if (lw->qkv.format != WEIGHTS_BF16 || lw->o.format != WEIGHTS_BF16 || lw->gate_up.format != WEIGHTS_BF16
            || lw->down.format != WEIGHTS_BF16)
            return 0;
        if ((lw->q_norm == NULL) != (lw->k_norm == NULL)) return 0;
    }
    return 1;
}

/* Returns 0, or -1 for a step or a model it cannot take (nothing is computed then). */
int llmserve_decode_step(const decoder *d, const decode_step *s) {
    const decode_fn attend = choose_decode(1, !s->portable, d->heads, d->kv_heads, d->head_dim, d->block_size);
    if (!supported(d, s, attend)) return -1;
    const int m = s->tokens, portable = s->portable;
#pragma omp parallel num_threads(s->threads)
    {
#pragma omp single
        embed(d, s);
        for (int l = 0; l < d->num_layers; l++) {
            const layer_weights *lw = &d->layers[l];
            linear_team(&lw->qkv, d->normed, d->qkv, m, portable);
#pragma omp barrier
#pragma omp single
            attention_inputs(d, lw, s);
            attend(d->query, lw->k_cache, lw->v_cache, s->tables, s->lens, d->attn, m, d->heads, d->kv_heads,
                   d->head_dim, d->block_size, s->max_blocks, d->scale);
            linear_team(&lw->o, d->attn, d->proj, m, portable);
#pragma omp barrier
#pragma omp single
            llmserve_add_rms_norm_bf16(d->proj, d->residual, lw->post_attention_norm, d->normed, d->residual, m,
                                       d->hidden, d->eps);
            gate_up_team(d, &lw->gate_up, m, portable);
#pragma omp barrier
            linear_team(&lw->down, d->act, d->proj, m, portable);
#pragma omp barrier
            const uint16_t *next_norm = l + 1 < d->num_layers ? d->layers[l + 1].input_norm : d->final_norm;
            uint16_t *normed = l + 1 < d->num_layers ? d->normed : s->out;
#pragma omp single
            llmserve_add_rms_norm_bf16(d->proj, d->residual, next_norm, normed, d->residual, m, d->hidden, d->eps);
        }
    }
    return 0;
}
