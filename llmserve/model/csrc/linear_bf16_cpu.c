/*
 * y = x W^T (+ bias) in bf16 for few rows of x (decode steps): each weight row is streamed from memory once
 * per call, whatever the number of rows, and dotted with every row of x while it sits in cache.
 *
 * x [m, k] (row stride ldx), W [n, k] as stored in the checkpoint (no repacking), bias [n] or NULL,
 * y [m, n] contiguous. Products are summed in float32 and rounded to bf16 once, as torch's bf16 linear does;
 * only the summation order differs.
 *
 * Four implementations, each compiled where the build machine has its instructions; a call runs the best
 * one unless it names another (PATH_* in bf16.h):
 *  - AVX512-BF16: each weight row (two adjacent ones from 8 rows of x up) against tiles of up to 4 rows of x,
 *    32 bf16 products per `vdpbf16ps` summed into float32 accumulators held in registers; masked loads for a
 *    k that is not a multiple of 32.
 *    Threads split the weight rows into contiguous ranges, so each thread reads one stretch of memory front
 *    to back (separate streams per row measured slower).
 *  - AVX-512 without BF16 (Intel Skylake-SP to Ice Lake): the AVX2 path's method on 32 bf16 weights per load,
 *    with tiles of up to 7 rows of x, or of 4 rows and two weight rows from 8 rows up; x's float32 copy is
 *    cache-line aligned (unaligned, its 64-byte loads split lines and the kernel ran 1.15-1.65x slower).
 *  - AVX2 + FMA (CPUs without AVX-512, e.g. AMD Zen 2/3, most Intel client parts): 16 bf16 weights per load,
 *    made float32 exactly by a shift (even elements) and a mask (odd ones), and the same done to x, so no
 *    shuffles are needed; FMA into float32 accumulators, the last k % 16 columns in scalar code.
 *  - Portable C for any machine, the same split over threads.
 * The fast paths prefetch the weight stream WEIGHT_PREFETCH_BYTES ahead (bf16.h), for a single row of x only
 * where BF16_ONE_ROW_PREFETCH says so.
 *
 * Built on first use by llmserve/model/cpu_linear.py and called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include "bf16.h"
#if HAVE_AVX512_BF16 || HAVE_AVX512
#include <immintrin.h>
#endif

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

#ifndef BF16_TILE_COLS
#define BF16_TILE_COLS 2 /* weight rows per tile on the AVX-512 paths from 8 rows of x up: 1 or 2 */
#endif

#define MR 4 /* rows of x per tile: at most MR x UNROLL_MAX float32 accumulators in registers */

#if HAVE_AVX512_BF16
#define UNROLL_MAX 2

static inline __m512bh load_pairs(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* Weight rows [j, j + cols) against rows [i0, i0 + mr) of x, with `unroll` accumulators per pair. Each weight
   row is read front to back, so a thread's range of rows is one sequential stream (two adjacent ones when
   cols is 2); rows of x come from cache, each of their vectors loaded once for the tile's weight rows. Always
   inlined with constant mr, cols and unroll, so the loops unroll and the accumulators stay in registers. A
   pair's products are summed in the same order whatever cols is. */
static inline __attribute__((always_inline)) void row_tile_avx512(const uint16_t *x, const uint16_t *w,
                                                           const uint16_t *bias, uint16_t *y, int i0, int mr,
                                                           int cols, int unroll, int j, int n, int k, int ldx) {
    __m512 acc[MR][2][UNROLL_MAX];
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < cols; q++)
            for (int u = 0; u < unroll; u++) acc[i][q][u] = _mm512_setzero_ps();
    const uint16_t *wj = w + (size_t)j * k;
    int c = 0;
    for (; c + 32 * unroll <= k; c += 32 * unroll) {
        __m512bh wv[2][UNROLL_MAX];
        for (int q = 0; q < cols; q++) {
            if (mr > 1 || BF16_ONE_ROW_PREFETCH)
                for (int u = 0; u < unroll; u++) prefetch_weights(wj + (size_t)q * k + c + 32 * u);
            for (int u = 0; u < unroll; u++) wv[q][u] = (__m512bh)_mm512_loadu_si512(wj + (size_t)q * k + c + 32 * u);
        }
        for (int i = 0; i < mr; i++) {
            const uint16_t *xi = x + (size_t)(i0 + i) * ldx + c;
            for (int u = 0; u < unroll; u++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xi + 32 * u);
                for (int q = 0; q < cols; q++) acc[i][q][u] = _mm512_dpbf16_ps(acc[i][q][u], xv, wv[q][u]);
            }
        }
    }
    for (; c < k; c += 32) { /* the last < 32 * unroll columns, the final partial group masked */
        const __mmask32 mask = k - c >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - c)) - 1u);
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = load_pairs(x + (size_t)(i0 + i) * ldx + c, mask);
            for (int q = 0; q < cols; q++)
                acc[i][q][0] = _mm512_dpbf16_ps(acc[i][q][0], xv, load_pairs(wj + (size_t)q * k + c, mask));
        }
    }
    for (int q = 0; q < cols; q++) {
        const float b = bias ? bf16_to_float(bias[j + q]) : 0.0f;
        for (int i = 0; i < mr; i++) {
            __m512 sum = acc[i][q][0];
            for (int u = 1; u < unroll; u++) sum = _mm512_add_ps(sum, acc[i][q][u]);
            y[(size_t)(i0 + i) * n + j + q] = float_to_bf16(_mm512_reduce_add_ps(sum) + b);
        }
    }
}

/* Weight row j against the rows [i0, m) that whole tiles of MR left over. */
static inline __attribute__((always_inline)) void remainder_rows_avx512(const uint16_t *x, const uint16_t *w,
                                                                 const uint16_t *bias, uint16_t *y, int i0,
                                                                 int m, int j, int n, int k, int ldx) {
    /* A single row keeps one accumulator: measured faster than two when only the weights stream. */
    switch (m - i0) {
    case 3: row_tile_avx512(x, w, bias, y, i0, 3, 1, 2, j, n, k, ldx); break;
    case 2: row_tile_avx512(x, w, bias, y, i0, 2, 1, 2, j, n, k, ldx); break;
    case 1: row_tile_avx512(x, w, bias, y, i0, 1, 1, 1, j, n, k, ldx); break;
    default: break;
    }
}

static void linear_rows_avx512bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                   int m, int n, int k, int ldx, int first, int last) {
    int j = first;
    /* From two tiles of MR rows up, two weight rows a tile: each vector of x loaded serves both, where the
       loads of x bounded the kernel. Below that the weight stream bounds it, and two streams ran slower. */
    if (BF16_TILE_COLS == 2 && m >= 2 * MR)
        for (; j + 2 <= last; j += 2) {
            int i0 = 0;
            for (; i0 + MR <= m; i0 += MR) row_tile_avx512(x, w, bias, y, i0, MR, 2, 2, j, n, k, ldx);
            remainder_rows_avx512(x, w, bias, y, i0, m, j, n, k, ldx);
            remainder_rows_avx512(x, w, bias, y, i0, m, j + 1, n, k, ldx);
        }
    for (; j < last; j++) {
        int i0 = 0;
        for (; i0 + MR <= m; i0 += MR) row_tile_avx512(x, w, bias, y, i0, MR, 1, 2, j, n, k, ldx);
        remainder_rows_avx512(x, w, bias, y, i0, m, j, n, k, ldx);
    }
}
#endif

#if HAVE_AVX2

#define UNROLL_AVX2 4

/* The even and odd products of 16 columns from c, weights and rows [i0, i0 + mr) of x, into accumulators u. */
static inline __attribute__((always_inline)) void bf16_columns_avx2(const float *xs, const uint16_t *wj,
                                                                    __m256 even[][UNROLL_AVX2],
                                                                    __m256 odd[][UNROLL_AVX2], int i0, int mr,
                                                                    int u, int c, int k16) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)(wj + c));
    const __m256 we = bf16_even(wv), wo = bf16_odd(wv);
    for (int i = 0; i < mr; i++) {
        const float *xi = xs + (size_t)(i0 + i) * k16 + c;
        even[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xi), we, even[i][u]);
        odd[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), wo, odd[i][u]);
    }
}

/* Weight row j against rows [i0, i0 + mr) of x (xs: float_rows' X_SPLIT_16 copy), read front to back, with `unroll`
   pairs of accumulators per row of x, so FMA's latency does not bound one pair. Always inlined with constant
   mr and unroll, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_tile_avx2(const uint16_t *x, const float *xs, const uint16_t *w,
                                                                const uint16_t *bias, uint16_t *y, int i0, int mr,
                                                                int unroll, int j, int n, int k, int ldx) {
    __m256 even[MR][UNROLL_AVX2], odd[MR][UNROLL_AVX2];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < unroll; u++) even[i][u] = odd[i][u] = _mm256_setzero_ps();
    const uint16_t *wj = w + (size_t)j * k;
    const int k16 = k / 16 * 16;
    int c = 0;
    for (; c + 16 * unroll <= k16; c += 16 * unroll) {
        if (mr > 1 || BF16_ONE_ROW_PREFETCH)
            for (int u = 0; u < unroll; u += 2) prefetch_weights(wj + c + 16 * u);
        for (int u = 0; u < unroll; u++) bf16_columns_avx2(xs, wj, even, odd, i0, mr, u, c + 16 * u, k16);
    }
    for (; c < k16; c += 16) bf16_columns_avx2(xs, wj, even, odd, i0, mr, 0, c, k16);
    const float b = bias ? bf16_to_float(bias[j]) : 0.0f;
    for (int i = 0; i < mr; i++) {
        __m256 total = _mm256_add_ps(even[i][0], odd[i][0]);
        for (int u = 1; u < unroll; u++) total = _mm256_add_ps(total, _mm256_add_ps(even[i][u], odd[i][u]));
        const uint16_t *xi = x + (size_t)(i0 + i) * ldx;
        float sum = hsum256(total);
        for (int t = c; t < k; t++) sum += bf16_to_float(xi[t]) * bf16_to_float(wj[t]);
        y[(size_t)(i0 + i) * n + j] = float_to_bf16(sum + b);
    }
}

/* Returns 0, or -1 when out of memory for x's float32 copy (nothing computed then). */
static int linear_rows_avx2(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m, int n,
                            int k, int ldx, int first, int last) {
    const float *xs = float_rows(x, m, k, ldx, X_SPLIT_16);
    if (xs == NULL) return -1;
    for (int j = first; j < last; j++) {
        int i0 = 0;
        for (; i0 + MR <= m; i0 += MR) row_tile_avx2(x, xs, w, bias, y, i0, MR, 1, j, n, k, ldx);
        switch (m - i0) {
        case 3: row_tile_avx2(x, xs, w, bias, y, i0, 3, 1, j, n, k, ldx); break;
        case 2: row_tile_avx2(x, xs, w, bias, y, i0, 2, 2, j, n, k, ldx); break;
        case 1: row_tile_avx2(x, xs, w, bias, y, i0, 1, UNROLL_AVX2, j, n, k, ldx); break;
        default: break;
        }
    }
    return 0;
}
#endif

#if HAVE_AVX512
#define MR_AVX512 7 /* rows of x in a tile of one weight row: 7 x 2 accumulators (even and odd) */
#define MR_AVX512_PAIR 4 /* rows of x per tile of two weight rows: 4 x 2 x 2 accumulators */
#define UNROLL_AVX512 2

/* The even and odd products of 32 columns from c, weight rows [j, j + cols) and rows [i0, i0 + mr) of x, into
   accumulators u; each vector of x loaded serves every weight row of the tile. */
static inline __attribute__((always_inline)) void bf16_columns_avx512(const float *xs, const uint16_t *wj,
                                                                      __m512 even[][2][UNROLL_AVX512],
                                                                      __m512 odd[][2][UNROLL_AVX512], int i0,
                                                                      int mr, int cols, int u, int c, int k,
                                                                      int k32) {
    __m512 we[2], wo[2];
    for (int q = 0; q < cols; q++) {
        const __m512i wv = _mm512_loadu_si512(wj + (size_t)q * k + c);
        we[q] = bf16_even512(wv);
        wo[q] = bf16_odd512(wv);
    }
    for (int i = 0; i < mr; i++) {
        const float *xi = xs + (size_t)(i0 + i) * k32 + c;
        const __m512 xe = _mm512_load_ps(xi), xo = _mm512_load_ps(xi + 16);
        for (int q = 0; q < cols; q++) {
            even[i][q][u] = _mm512_fmadd_ps(xe, we[q], even[i][q][u]);
            odd[i][q][u] = _mm512_fmadd_ps(xo, wo[q], odd[i][q][u]);
        }
    }
}

/* row_tile_avx2 in vectors of 16 float32 (xs: float_rows' X_SPLIT_32 copy, 64-byte aligned rows), for weight rows
   [j, j + cols). */
static inline __attribute__((always_inline)) void row_tile_avx512f(const uint16_t *x, const float *xs,
                                                                   const uint16_t *w, const uint16_t *bias,
                                                                   uint16_t *y, int i0, int mr, int cols,
                                                                   int unroll, int j, int n, int k, int ldx) {
    __m512 even[MR_AVX512][2][UNROLL_AVX512], odd[MR_AVX512][2][UNROLL_AVX512];
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < cols; q++)
            for (int u = 0; u < unroll; u++) even[i][q][u] = odd[i][q][u] = _mm512_setzero_ps();
    const uint16_t *wj = w + (size_t)j * k;
    const int k32 = k / 32 * 32;
    int c = 0;
    for (; c + 32 * unroll <= k32; c += 32 * unroll) {
        if (mr > 1 || BF16_ONE_ROW_PREFETCH)
            for (int q = 0; q < cols; q++)
                for (int u = 0; u < unroll; u++) prefetch_weights(wj + (size_t)q * k + c + 32 * u);
        for (int u = 0; u < unroll; u++) bf16_columns_avx512(xs, wj, even, odd, i0, mr, cols, u, c + 32 * u, k, k32);
    }
    for (; c < k32; c += 32) bf16_columns_avx512(xs, wj, even, odd, i0, mr, cols, 0, c, k, k32);
    for (int q = 0; q < cols; q++) {
        const uint16_t *wq = wj + (size_t)q * k;
        const float b = bias ? bf16_to_float(bias[j + q]) : 0.0f;
        for (int i = 0; i < mr; i++) {
            __m512 total = _mm512_add_ps(even[i][q][0], odd[i][q][0]);
            for (int u = 1; u < unroll; u++) total = _mm512_add_ps(total, _mm512_add_ps(even[i][q][u], odd[i][q][u]));
            const uint16_t *xi = x + (size_t)(i0 + i) * ldx;
            float sum = _mm512_reduce_add_ps(total);
            for (int t = c; t < k; t++) sum += bf16_to_float(xi[t]) * bf16_to_float(wq[t]);
            y[(size_t)(i0 + i) * n + j + q] = float_to_bf16(sum + b);
        }
    }
}

/* Accumulator pairs per row of x and weight row in a tile of mr rows. It depends on mr alone, and the tiles on m
   alone, so a weight row's products are summed in the same order whether it is paired or not, and results do not
   depend on how the threads split the rows. */
#define UNROLL_AVX512F_FOR(mr) ((mr) <= 3 ? 2 : 1)
#define TILE_AVX512F(mr, cols) row_tile_avx512f(x, xs, w, bias, y, i0, mr, cols, UNROLL_AVX512F_FOR(mr), j, n, k, ldx)

/* Weight rows [j, j + cols) against every row of x: one tile below 8 rows, tiles of MR_AVX512_PAIR rows from 8 up
   (with two weight rows, no more rows fit in the registers). Always inlined with a constant cols. */
static inline __attribute__((always_inline)) void columns_tiles_avx512f(const uint16_t *x, const float *xs,
                                                                        const uint16_t *w, const uint16_t *bias,
                                                                        uint16_t *y, int m, int cols, int j, int n,
                                                                        int k, int ldx) {
    int i0 = 0;
    if (m >= 2 * MR_AVX512_PAIR)
        for (; i0 + MR_AVX512_PAIR <= m; i0 += MR_AVX512_PAIR) TILE_AVX512F(MR_AVX512_PAIR, cols);
    switch (m - i0) {
    case 7: TILE_AVX512F(7, 1); break; /* from here to 4: fewer than 8 rows, one weight row */
    case 6: TILE_AVX512F(6, 1); break;
    case 5: TILE_AVX512F(5, 1); break;
    case 4: TILE_AVX512F(4, 1); break;
    case 3: TILE_AVX512F(3, cols); break;
    case 2: TILE_AVX512F(2, cols); break;
    case 1: TILE_AVX512F(1, cols); break;
    default: break;
    }
}

/* Returns 0, or -1 when out of memory for x's float32 copy (nothing computed then). */
static int linear_rows_avx512f(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m,
                               int n, int k, int ldx, int first, int last) {
    const float *xs = float_rows(x, m, k, ldx, X_SPLIT_32);
    if (xs == NULL) return -1;
    int j = first;
    /* From two tiles of rows up, two weight rows a tile: each vector of x loaded serves both, where the loads of x
       bounded the kernel (1.3-1.6x at 12-24 rows on Ice Lake). */
    if (BF16_TILE_COLS == 2 && m >= 2 * MR_AVX512_PAIR)
        for (; j + 2 <= last; j += 2) columns_tiles_avx512f(x, xs, w, bias, y, m, 2, j, n, k, ldx);
    for (; j < last; j++) columns_tiles_avx512f(x, xs, w, bias, y, m, 1, j, n, k, ldx);
    return 0;
}
#endif

/* Output columns [first, last) by the implementation `path` asks for (one compiled in: see path_built).
   Callable by each thread of a team (decode_llama_cpu.c runs whole layers in one parallel region). Products
   of a column are summed in the same order whatever the split, so results do not depend on the number of
   threads. */
static void linear_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m, int n,
                             int k, int ldx, int first, int last, int path) {
#if HAVE_AVX512_BF16
    if (path == PATH_BEST || path == PATH_AVX512_BF16) {
        linear_rows_avx512bf16(x, w, bias, y, m, n, k, ldx, first, last);
        return;
    }
#endif
#if HAVE_AVX512
    if ((path == PATH_BEST || path == PATH_AVX512) && linear_rows_avx512f(x, w, bias, y, m, n, k, ldx, first, last) == 0)
        return;
#endif
#if HAVE_AVX2
    if ((path == PATH_BEST || path == PATH_AVX2) && linear_rows_avx2(x, w, bias, y, m, n, k, ldx, first, last) == 0)
        return;
#endif
    (void)path;
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

/* Returns 0, or -1 for arguments it cannot take (an implementation not compiled in among them). */
int llmserve_linear_bf16(const void *x, const void *w, const void *bias, void *y, int m, int n, int k, int ldx,
                         int threads, int path) {
    if (m < 0 || n < 0 || k <= 0 || ldx < k || threads < 1 || !path_built(path)) return -1;
#pragma omp parallel num_threads(threads)
    {
        int first, last;
        thread_share(n, &first, &last);
        linear_rows_bf16(x, w, bias, y, m, n, k, ldx, first, last, path);
    }
    return 0;
}

/* The implementations compiled in, as the bits 1 << PATH_*. */
int llmserve_linear_bf16_paths(void) { return paths_built(); }
