/*
 * LoRA adapters' contribution to a projection's bf16 output rows on the CPU: y += (x A^T) B^T for each row, with
 * the A and B of the row's adapter slot (llmserve/model/lora.py keeps them: A [width, k] and B transposed,
 * bt [width, n], per slot). Rows of one slot are shrunk one at a time by the linear kernel (x A^T rounded to bf16,
 * the kernel's arithmetic for a single row) and expanded together, LORA_ROWS at a time, over this thread's
 * columns: each column sums over the width in order (float32), the sum rounds to bf16 and so does its addition
 * to y. The per-module path (cpu_lora.py) and the one-call decoder (decode_llama_cpu.c, which includes this file)
 * both run `lora_add_columns`, so their bits agree whatever rows a step holds and however columns are split.
 *
 * The expand runs over rows of bt, each scaled into blocks of column sums, so it reads B once per LORA_ROWS rows
 * and vectorises as written (a dot product per column of B [n, width], width 16 to 64, ran at a fifth of that
 * speed). Rows of a slot beyond its adapter's rank shrink to exact zeros and are skipped.
 */
#include "linear_bf16_cpu.c"

#define MAX_LORA_WIDTH 1024 /* a slot's width (its projection's shards times the maximum rank) taken here */
#define LORA_COLUMNS 256 /* column sums a block keeps per row */
#define LORA_ROWS 8 /* rows of x one pass over B serves */
#define LORA_TOKENS 16 /* rows shrunk before their expands */

/* Columns [first, last) of `count` (at most LORA_ROWS) rows of one slot: y_i[j] = bf16(y_i[j] + bf16(sum over r
   of s_i[r] * bt[r, j])). A column's sum runs over r in the same order however many rows share the pass. */
static void lora_expand_rows(const uint16_t *const *s, uint16_t *const *y, int count, const uint16_t *bt, int width,
                             int n, int first, int last) {
    float sums[LORA_ROWS][LORA_COLUMNS], b[LORA_COLUMNS];
    for (int j0 = first; j0 < last; j0 += LORA_COLUMNS) {
        const int cols = last - j0 < LORA_COLUMNS ? last - j0 : LORA_COLUMNS;
        for (int i = 0; i < count; i++)
            for (int c = 0; c < cols; c++) sums[i][c] = 0.0f;
        for (int r = 0; r < width; r++) {
            const uint16_t *row = bt + (size_t)r * n + j0;
            int converted = 0;
            for (int i = 0; i < count; i++) {
                const float scale = bf16_to_float(s[i][r]);
                if (scale == 0.0f) continue; /* a row of the slot beyond the adapter's rank */
                if (!converted) {
                    for (int c = 0; c < cols; c++) b[c] = bf16_to_float(row[c]);
                    converted = 1;
                }
                for (int c = 0; c < cols; c++) sums[i][c] += scale * b[c];
            }
        }
        for (int i = 0; i < count; i++)
            for (int c = 0; c < cols; c++)
                y[i][j0 + c] = float_to_bf16(bf16_to_float(y[i][j0 + c]) + bf16_to_float(float_to_bf16(sums[i][c])));
    }
}

/* Columns [first, last) of y ([m, n]) += each row's (x A^T) B^T, for the rows of x ([m, k]) whose slot >= 0. */
static void lora_add_columns(const uint16_t *x, const int32_t *slots, int m, const uint16_t *a, const uint16_t *bt,
                             int width, int k, int n, uint16_t *y, int first, int last, int path) {
    uint16_t shrunk[LORA_TOKENS][MAX_LORA_WIDTH];
    for (int t0 = 0; t0 < m; t0 += LORA_TOKENS) {
        const int t1 = m - t0 < LORA_TOKENS ? m : t0 + LORA_TOKENS;
        int done[LORA_TOKENS] = {0};
        for (int t = t0; t < t1; t++) {
            const int slot = slots[t];
            if (slot < 0 || done[t - t0]) continue;
            const uint16_t *slot_a = a + (size_t)slot * width * k, *slot_bt = bt + (size_t)slot * width * n;
            const uint16_t *rows[LORA_ROWS];
            uint16_t *out[LORA_ROWS];
            int count = 0;
            for (int u = t; u < t1; u++) {
                if (slots[u] != slot) continue;
                done[u - t0] = 1;
                linear_rows_bf16(x + (size_t)u * k, slot_a, NULL, shrunk[u - t0], 1, width, k, k, 0, width, path);
                rows[count] = shrunk[u - t0];
                out[count++] = y + (size_t)u * n;
                if (count == LORA_ROWS) {
                    lora_expand_rows(rows, out, count, slot_bt, width, n, first, last);
                    count = 0;
                }
            }
            if (count > 0) lora_expand_rows(rows, out, count, slot_bt, width, n, first, last);
        }
    }
}

/* The whole of y, the columns split over `threads` threads. Returns 0, or -1 for arguments it cannot take. */
int llmserve_lora_add_bf16(const uint16_t *x, const int32_t *slots, int m, const uint16_t *a, const uint16_t *bt,
                           int width, int k, int n, uint16_t *y, int threads, int path) {
    if (width < 1 || width > MAX_LORA_WIDTH || !path_built(path)) return -1;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(n, &first, &last);
        lora_add_columns(x, slots, m, a, bt, width, k, n, y, first, last, path);
    }
    return 0;
}
