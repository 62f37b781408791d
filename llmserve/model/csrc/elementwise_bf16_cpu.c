/*
 * The decoder's elementwise work for a few bf16 tokens (decode steps) on the CPU, one call per group of
 * torch ops: residual add + RMSNorm, RMSNorm alone (also per head), rotary embedding of q and k together,
 * SiLU(gate) * up. With the weights streamed by the linear kernel, these small ops were mostly per-op
 * dispatch; each function here reads and writes each element once.
 *
 * Math is float32 with a bf16 rounding wherever the torch code in llmserve/model/layers.py stores an
 * intermediate (as the Triton kernels in fused_kernels.py do), so results agree with it bit for bit except
 * where the float32 sum of squares, added in another order, rounds differently.
 *
 * Single-threaded: a decode step's rows are a few thousand elements, less than a thread hand-off costs.
 * Built on first use by llmserve/model/cpu_fused.py and called through ctypes with raw pointers.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* out[row] = w * bf16(x * rsqrt(mean(x^2) + eps)) for one row of n values (x already float32). */
static void norm_row(const float *x, const uint16_t *w, uint16_t *out, int n, float eps) {
    float sum = 0.0f;
    for (int c = 0; c < n; c++) sum += x[c] * x[c];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (int c = 0; c < n; c++) out[c] = float_to_bf16(bf16_to_float(w[c]) * round_bf16(x[c] * scale));
}

#define MAX_N 16384 /* longest row: cpu_fused.py keeps wider ones on the torch path */

/* RMSNorm of rows addressed as (outer, inner) with strides in elements, into a contiguous
   [outer, inner, n] output. */
void llmserve_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int outer, int inner,
                            long stride_outer, long stride_inner, int n, float eps) {
    float row[MAX_N];
    for (int o = 0; o < outer; o++)
        for (int i = 0; i < inner; i++) {
            const uint16_t *src = x + o * stride_outer + i * stride_inner;
            for (int c = 0; c < n; c++) row[c] = bf16_to_float(src[c]);
            norm_row(row, w, out + ((size_t)o * inner + i) * n, n, eps);
        }
}

/* residual_out = bf16(x + residual); out = RMSNorm(residual_out). Rows contiguous, [rows, n]. */
void llmserve_add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out,
                                uint16_t *residual_out, int rows, int n, float eps) {
    float row[MAX_N];
    for (int r = 0; r < rows; r++) {
        const size_t base = (size_t)r * n;
        for (int c = 0; c < n; c++) {
            const uint16_t sum = float_to_bf16(bf16_to_float(x[base + c]) + bf16_to_float(residual[base + c]));
            residual_out[base + c] = sum;
            row[c] = bf16_to_float(sum);
        }
        norm_row(row, w, out + base, n, eps);
    }
}

/* Rotate-half in place on `heads` heads of one token: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], each product
   and each sum rounded to bf16, c and s the bf16 roundings of the float32 cache rows. */
static void rotate_heads(uint16_t *x, long stride_head, int heads, const float *cos_row, const float *sin_row,
                         int half) {
    for (int h = 0; h < heads; h++) {
        uint16_t *v = x + h * stride_head;
        for (int d = 0; d < half; d++) {
            const float c = round_bf16(cos_row[d]), s = round_bf16(sin_row[d]);
            const float x1 = bf16_to_float(v[d]), x2 = bf16_to_float(v[d + half]);
            v[d] = float_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
            v[d + half] = float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
        }
    }
}

/* q [T, H, D] and k [T, KVH, D] given by token and head strides (elements), rotated in place at
   positions[t], with cos/sin caches [max_positions, D/2] in float32. */
void llmserve_rotary_bf16(uint16_t *q, uint16_t *k, const int64_t *positions, const float *cos_cache,
                          const float *sin_cache, int tokens, int heads, int kv_heads, int dim, long q_stride_token,
                          long q_stride_head, long k_stride_token, long k_stride_head) {
    const int half = dim / 2;
    for (int t = 0; t < tokens; t++) {
        const float *cos_row = cos_cache + (size_t)positions[t] * half;
        const float *sin_row = sin_cache + (size_t)positions[t] * half;
        rotate_heads(q + t * q_stride_token, q_stride_head, heads, cos_row, sin_row, half);
        rotate_heads(k + t * k_stride_token, k_stride_head, kv_heads, cos_row, sin_row, half);
    }
}

/* out[c] = bf16(bf16(silu(gate[c])) * up[c]) for `cols` columns. */
static void silu_mul_span(const uint16_t *gate, const uint16_t *up, uint16_t *out, int cols) {
    for (int c = 0; c < cols; c++) {
        const float g = bf16_to_float(gate[c]);
        out[c] = float_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(up[c]));
    }
}

/* out [T, I] = bf16(bf16(silu(gate)) * up), gate and up the halves of each gate_up row (row stride given). */
void llmserve_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int tokens, int cols, long stride) {
    for (int t = 0; t < tokens; t++) {
        const uint16_t *gate = gate_up + t * stride;
        silu_mul_span(gate, gate + cols, out + (size_t)t * cols, cols);
    }
}
