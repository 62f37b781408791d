/*
 * y = x W^T (+ bias) in bf16 for few rows of x (decode steps): each weight row is streamed from memory once
 * per call, whatever the number of rows, and dotted with every row of x while it sits in cache.
 *
 * x [m, k] (row stride ldx), W [n, k] as stored in the checkpoint (no repacking), bias [n] or NULL,
 * y [m, n] contiguous. Products are summed in float32 and rounded to bf16 once, as torch's bf16 linear does;
 * only the summation order differs.
 *
 * Two implementations:
 *  - AVX512-BF16 (compiled where the build machine has it): each weight row against tiles of up to 4 rows
 *    of x, 32 bf16 products per `vdpbf16ps` summed into float32 accumulators held in registers; masked
 *    loads for a k that is not a multiple of 32. Threads split the weight rows into contiguous ranges, so
 *    each thread reads one stretch of memory front to back (separate streams per row measured slower).
 *  - Portable C for any machine, the same split over threads.
 *
 * Built on first use by llmserve/model/cpu_linear.py and called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"

/* Weight rows [first, last) of thread `t` of `threads`, in blocks of `align` rows. */
static void thread_rows(int n, int align, int t, int threads, int *first, int *last) {
    const int blocks = (n + align - 1) / align;
    const int per = blocks / threads, extra = blocks % threads;
    const int b0 = t * per + (t < extra ? t : extra);
    const int b1 = b0 + per + (t < extra ? 1 : 0);
    *first = b0 * align < n ? b0 * align : n;
    *last = b1 * align < n ? b1 * align : n;
}

/* Output columns [first, last) of y for every row of x: one thread's share of the work. */
static void linear_rows_portable(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m,
                                 int n, int k, int ldx, int first, int last) {
    for (int j = first; j < last; j++) {
        const uint16_t *wj = w + (size_t)j * k;
        for (int i = 0; i < m; i++) {
            const uint16_t *xi = x + (size_t)i * ldx;
            float acc = 0.0f;
            for (int c = 0; c < k; c++) acc += bf16_to_float(xi[c]) * bf16_to_float(wj[c]);
            if (bias) acc += bf16_to_float(bias[j]);
            y[(size_t)i * n + j] = float_to_bf16(acc);
        }
    }
}

#if defined(__AVX512BF16__)
#define MR 4 /* rows of x per tile: at most MR x UNROLL_MAX float32 accumulators in registers */
#define UNROLL_MAX 2

static inline __m512bh load_pairs(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* Weight row j against rows [i0, i0 + mr) of x, with `unroll` accumulators per row of x. The weight row is
   read front to back, so a thread's range of rows is one sequential stream; rows of x come from cache.
   Always inlined with constant mr and unroll, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_tile(const uint16_t *x, const uint16_t *w,
                                                           const uint16_t *bias, uint16_t *y, int i0, int mr,
                                                           int unroll, int j, int n, int k, int ldx) {
    __m512 acc[MR][UNROLL_MAX];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < unroll; u++) acc[i][u] = _mm512_setzero_ps();
    const uint16_t *wj = w + (size_t)j * k;
    int c = 0;
    for (; c + 32 * unroll <= k; c += 32 * unroll) {
        __m512bh wv[UNROLL_MAX];
        for (int u = 0; u < unroll; u++) wv[u] = (__m512bh)_mm512_loadu_si512(wj + c + 32 * u);
        for (int i = 0; i < mr; i++) {
            const uint16_t *xi = x + (size_t)(i0 + i) * ldx + c;
            for (int u = 0; u < unroll; u++)
                acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)_mm512_loadu_si512(xi + 32 * u), wv[u]);
        }
    }
    for (; c < k; c += 32) { /* the last < 32 * unroll columns, the final partial group masked */
        const __mmask32 mask = k - c >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - c)) - 1u);
        const __m512bh wv = load_pairs(wj + c, mask);
        for (int i = 0; i < mr; i++)
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], load_pairs(x + (size_t)(i0 + i) * ldx + c, mask), wv);
    }
    const float b = bias ? bf16_to_float(bias[j]) : 0.0f;
    for (int i = 0; i < mr; i++) {
        __m512 sum = acc[i][0];
        for (int u = 1; u < unroll; u++) sum = _mm512_add_ps(sum, acc[i][u]);
        y[(size_t)(i0 + i) * n + j] = float_to_bf16(_mm512_reduce_add_ps(sum) + b);
    }
}

static void linear_rows_avx512bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                   int m, int n, int k, int ldx, int first, int last) {
    for (int j = first; j < last; j++) {
        int i0 = 0;
        for (; i0 + MR <= m; i0 += MR) row_tile(x, w, bias, y, i0, MR, 2, j, n, k, ldx);
        /* A single row keeps one accumulator: measured faster than two when only the weights stream. */
        switch (m - i0) {
        case 3: row_tile(x, w, bias, y, i0, 3, 2, j, n, k, ldx); break;
        case 2: row_tile(x, w, bias, y, i0, 2, 2, j, n, k, ldx); break;
        case 1: row_tile(x, w, bias, y, i0, 1, 1, j, n, k, ldx); break;
        default: break;
        }
    }
}
#endif

/* Output columns [first, last) by the best implementation compiled in, or the portable one. Callable by each
   thread of a team (decode_llama_cpu.c runs whole layers in one parallel region). Products of a column are
   summed in the same order whatever the split, so results do not depend on the number of threads. */
static void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m, int n,
                             int k, int ldx, int first, int last, int portable) {
#if defined(__AVX512BF16__)
    if (!portable) {
        linear_rows_avx512bf16(x, w, bias, y, m, n, k, ldx, first, last);
        return;
    }
#else
    (void)portable;
#endif
    linear_rows_portable(x, w, bias, y, m, n, k, ldx, first, last);
}

/* This thread's contiguous range of n output columns (the whole of them outside a parallel region). */
static void thread_share(int n, int *first, int *last) {
    *first = 0;
    *last = n;
#if defined(_OPENMP)
    thread_rows(n, 1, omp_get_thread_num(), omp_get_num_threads(), first, last);
#endif
}

static int linear_parallel(const void *x, const void *w, const void *bias, void *y, int m, int n, int k, int ldx,
                           int threads, int portable) {
    if (m < 0 || n < 0 || k <= 0 || ldx < k || threads < 1) return -1;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(n, &first, &last);
        linear_rows_bf16(x, w, bias, y, m, n, k, ldx, first, last, portable);
    }
    return 0;
}

/* Returns 0, or -1 for arguments it cannot take. */
int llmserve_linear_bf16(const void *x, const void *w, const void *bias, void *y, int m, int n, int k, int ldx,
                         int threads) {
    return linear_parallel(x, w, bias, y, m, n, k, ldx, threads, 0);
}

int llmserve_linear_bf16_portable(const void *x, const void *w, const void *bias, void *y, int m, int n, int k,
                                  int ldx, int threads) {
    return linear_parallel(x, w, bias, y, m, n, k, ldx, threads, 1);
}

/* 1 when the fast path above was compiled in. */
int llmserve_linear_bf16_has_avx512bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
