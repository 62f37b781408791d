/*
 * y = x (W * scale)^T (+ bias) for few bf16 rows of x and int8 weights with one float scale per output
 * channel (`--quantization int8` on CPU, decode steps): each weight row is streamed from memory once per
 * call, half the bytes of a bf16 row, and dotted with every row of x while it sits in cache.
 *
 * Entry points, for Python (ctypes, llmserve/model/cpu_linear.py) and for other C code:
 *
 *   int llmserve_linear_int8(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w,
 *                            const float *scale, const uint16_t *bias, int64_t n, uint16_t *y, int threads,
 *                            int path);
 *
 *   x [m, k] bf16 with row stride ldx (>= k); w [n, k] int8 row-major, as quantized at load (no repacking);
 *   scale [n] float32; bias [n] bf16 or NULL; y [m, n] bf16, contiguous; `threads` OpenMP threads split the
 *   weight rows into contiguous ranges; `path` is a PATH_* of bf16.h. Any m works; the kernel is meant for
 *   decode-sized m (cpu_linear.int8_max_rows(): beyond, a GEMM on converted weights wins). Returns 0, or -1 for
 *   arguments it cannot take.
 *
 *   static void linear_rows_int8(x, m, k, ldx, w, scale, bias, n, y, first, last, path);
 *
 *   the same for output columns [first, last) only, on the calling thread: for C code that #includes this
 *   file and splits the columns over its own OpenMP team (every other name here starts with int8_, so it
 *   can sit beside linear_bf16_cpu.c in one translation unit). A column's products are summed in the same
 *   order whatever the split, so results do not depend on the number of threads.
 *
 * Numerics are weight-only quantization's: the int8 weights are converted to bf16 on the fly, which is exact
 * (|q| <= 127 fits bf16's 8 significant bits), products with x are exact in float32 and summed in float32,
 * and the sum is scaled once: y = bf16(sum_k x[k] q[k] * scale + bias). Activations are not quantized.
 *
 * Four implementations, each compiled where the build machine has its instructions; a call runs the best
 * one unless it names another (PATH_* in bf16.h):
 *  - AVX512-BF16: 32 weights per step widened to int32, converted to float32 and packed to bf16 pairs, then
 *    one `vdpbf16ps` per row of x (tiles of up to 8 rows) into float32 accumulators held in registers;
 *    masked loads for a k that is not a multiple of 32.
 *  - AVX-512 without BF16: 16 weights per step widened to int32 and converted to float32 in order, FMA with x
 *    converted to float32 once per call (cache-line aligned), tiles of up to 8 rows of x and, from 8 rows up,
 *    two weight rows; the last k % 16 columns in scalar code.
 *  - AVX2 + FMA: 16 weights per step widened to int16 pairs, their even and odd elements sign-extended to
 *    int32 by shifts and converted to float32, x split alike (bf16_even / bf16_odd), FMA into float32
 *    accumulators; the last k % 16 columns in scalar code.
 *  - Portable C for any machine, the same split over threads.
 * The fast paths prefetch the weight stream WEIGHT_PREFETCH_BYTES ahead (bf16.h): without it the AVX512-BF16
 * path was compute-starved at 65% of the bf16 kernel's stream rate on an Intel VM.
 * AVX512-VNNI with x quantized to int8 (what llama.cpp's Q8_0 does) was measured too: as fast at 1-4 rows,
 * twice as fast at 8, but it quantizes the activations (BENCHMARKS.md, issue 18), so it is not used.
 */
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include "bf16.h"
#if HAVE_AVX512_BF16 || HAVE_AVX512
#include <immintrin.h>
#endif

static inline uint16_t int8_finish(float sum, const float *scale, const uint16_t *bias, int64_t j) {
    return float_to_bf16(sum * scale[j] + (bias ? bf16_to_float(bias[j]) : 0.0f));
}

static void int8_rows_portable(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w,
                               const float *scale, const uint16_t *bias, int64_t n, uint16_t *y, int64_t first,
                               int64_t last) {
    for (int64_t j = first; j < last; j++) {
        const int8_t *wj = w + j * k;
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *xi = x + i * ldx;
            float acc = 0.0f;
            for (int64_t c = 0; c < k; c++) acc += bf16_to_float(xi[c]) * (float)wj[c];
            y[i * n + j] = int8_finish(acc, scale, bias, j);
        }
    }
}

#define INT8_MR 4 /* rows of x per tile on AVX2: at most INT8_MR x 2 x INT8_UNROLL_AVX2 accumulators in its 16 registers */

#if HAVE_AVX512_BF16
#define INT8_UNROLL_MAX 4
/* Rows of x per tile on AVX-512: 8 x 2 accumulators fit its 32 registers, and each weight, converted once, serves
   every row of an 8-row step (tiles of 4 converted it twice and ran 1.3x slower than the bf16 kernel there). */
#define INT8_MR_AVX512 8

/* 32 int8 weights (the first `count` of them, the rest read as 0) as bf16 pairs, exactly. */
static inline __m512bh int8_widen(const int8_t *p, int count) {
    const __mmask16 lo = count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1u);
    const __mmask16 hi = count >= 32 ? 0xffff : count <= 16 ? 0 : (__mmask16)((1u << (count - 16)) - 1u);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lo, p)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(hi, p + 16)));
    return _mm512_cvtne2ps_pbh(b, a); /* a in the low half: element order kept */
}

static inline __m512bh int8_widen32(const int8_t *p) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(b, a);
}

/* Weight row j against rows [i0, i0 + mr) of x with `unroll` accumulators per row of x; the weight row is
   read front to back, so a thread's range of rows is one sequential stream. Always inlined with constant
   mr and unroll, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void int8_row_tile_avx512(const uint16_t *x, int64_t k, int64_t ldx,
                                                                const int8_t *w, const float *scale,
                                                                const uint16_t *bias, int64_t n, uint16_t *y,
                                                                int64_t i0, int mr, int unroll, int64_t j) {
    __m512 acc[INT8_MR_AVX512][INT8_UNROLL_MAX];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < unroll; u++) acc[i][u] = _mm512_setzero_ps();
    const int8_t *wj = w + j * k;
    int64_t c = 0;
    for (; c + 32 * unroll <= k; c += 32 * unroll) {
        __m512bh wv[INT8_UNROLL_MAX];
        for (int u = 0; u < unroll; u += 2) prefetch_weights(wj + c + 32 * u);
        for (int u = 0; u < unroll; u++) wv[u] = int8_widen32(wj + c + 32 * u);
        for (int i = 0; i < mr; i++) {
            const uint16_t *xi = x + (i0 + i) * ldx + c;
            for (int u = 0; u < unroll; u++)
                acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)_mm512_loadu_si512(xi + 32 * u), wv[u]);
        }
    }
    for (; c < k; c += 32) { /* the last < 32 * unroll columns, the final partial group masked */
        const int count = k - c >= 32 ? 32 : (int)(k - c);
        const __mmask32 mask = count == 32 ? 0xffffffffu : (__mmask32)((1u << count) - 1u);
        const __m512bh wv = int8_widen(wj + c, count);
        for (int i = 0; i < mr; i++)
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (i0 + i) * ldx + c),
                                         wv);
    }
    for (int i = 0; i < mr; i++) {
        __m512 sum = acc[i][0];
        for (int u = 1; u < unroll; u++) sum = _mm512_add_ps(sum, acc[i][u]);
        y[(i0 + i) * n + j] = int8_finish(_mm512_reduce_add_ps(sum), scale, bias, j);
    }
}

static void int8_rows_avx512bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w,
                                 const float *scale, const uint16_t *bias, int64_t n, uint16_t *y, int64_t first,
                                 int64_t last) {
    for (int64_t j = first; j < last; j++) {
        int64_t i0 = 0;
        for (; i0 + INT8_MR_AVX512 <= m; i0 += INT8_MR_AVX512)
            int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, INT8_MR_AVX512, 2, j);
        /* Fewer rows of x leave registers for more accumulators, which hide vdpbf16ps's latency. */
        switch (m - i0) {
        case 7: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 7, 2, j); break;
        case 6: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 6, 2, j); break;
        case 5: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 5, 2, j); break;
        case 4: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 4, 2, j); break;
        case 3: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 3, 2, j); break;
        case 2: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 2, 2, j); break;
        case 1: int8_row_tile_avx512(x, k, ldx, w, scale, bias, n, y, i0, 1, 4, j); break;
        default: break;
        }
    }
}
#endif

#if HAVE_AVX2
#define INT8_UNROLL_AVX2 4

/* The even and odd products of 16 columns from c, weights and rows [i0, i0 + mr) of x, into accumulators u. */
static inline __attribute__((always_inline)) void int8_columns_avx2(const float *xs, const int8_t *wj,
                                                                    __m256 even[][INT8_UNROLL_AVX2],
                                                                    __m256 odd[][INT8_UNROLL_AVX2], int64_t i0,
                                                                    int mr, int u, int64_t c, int64_t k16) {
    const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wj + c)));
    const __m256 we = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
    const __m256 wo = _mm256_cvtepi32_ps(_mm256_srai_epi32(pairs, 16));
    for (int i = 0; i < mr; i++) {
        const float *xi = xs + (i0 + i) * k16 + c;
        even[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xi), we, even[i][u]);
        odd[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), wo, odd[i][u]);
    }
}

/* Weight row j against rows [i0, i0 + mr) of x (xs: float_rows' X_SPLIT_16 copy), read front to back, with `unroll`
   pairs of accumulators per row of x (FMA's latency bounds one pair); always inlined with constant mr and
   unroll. */
static inline __attribute__((always_inline)) void int8_row_tile_avx2(const uint16_t *x, const float *xs, int64_t k,
                                                                     int64_t ldx, const int8_t *w, const float *scale,
                                                                     const uint16_t *bias, int64_t n, uint16_t *y,
                                                                     int64_t i0, int mr, int unroll, int64_t j) {
    __m256 even[INT8_MR][INT8_UNROLL_AVX2], odd[INT8_MR][INT8_UNROLL_AVX2];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < unroll; u++) even[i][u] = odd[i][u] = _mm256_setzero_ps();
    const int8_t *wj = w + j * k;
    const int64_t k16 = k / 16 * 16;
    int64_t c = 0;
    for (; c + 16 * unroll <= k16; c += 16 * unroll) {
        if ((c & 63) == 0) prefetch_weights(wj + c);
        for (int u = 0; u < unroll; u++) int8_columns_avx2(xs, wj, even, odd, i0, mr, u, c + 16 * u, k16);
    }
    for (; c < k16; c += 16) int8_columns_avx2(xs, wj, even, odd, i0, mr, 0, c, k16);
    for (int i = 0; i < mr; i++) {
        __m256 total = _mm256_add_ps(even[i][0], odd[i][0]);
        for (int u = 1; u < unroll; u++) total = _mm256_add_ps(total, _mm256_add_ps(even[i][u], odd[i][u]));
        const uint16_t *xi = x + (i0 + i) * ldx;
        float sum = hsum256(total);
        for (int64_t t = c; t < k; t++) sum += bf16_to_float(xi[t]) * (float)wj[t];
        y[(i0 + i) * n + j] = int8_finish(sum, scale, bias, j);
    }
}

/* Returns 0, or -1 when out of memory for x's float32 copy (nothing computed then). */
static int int8_rows_avx2(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w, const float *scale,
                          const uint16_t *bias, int64_t n, uint16_t *y, int64_t first, int64_t last) {
    const float *xs = float_rows(x, m, k, ldx, X_SPLIT_16);
    if (xs == NULL) return -1;
    for (int64_t j = first; j < last; j++) {
        int64_t i0 = 0;
        for (; i0 + INT8_MR <= m; i0 += INT8_MR)
            int8_row_tile_avx2(x, xs, k, ldx, w, scale, bias, n, y, i0, INT8_MR, 1, j);
        switch (m - i0) {
        case 3: int8_row_tile_avx2(x, xs, k, ldx, w, scale, bias, n, y, i0, 3, 1, j); break;
        case 2: int8_row_tile_avx2(x, xs, k, ldx, w, scale, bias, n, y, i0, 2, 2, j); break;
        case 1: int8_row_tile_avx2(x, xs, k, ldx, w, scale, bias, n, y, i0, 1, INT8_UNROLL_AVX2, j); break;
        default: break;
        }
    }
    return 0;
}
#endif

#if HAVE_AVX512
#define INT8_MR_AVX512F 8 /* rows of x per tile: each weight, widened once, serves 8 rows */
#define INT8_UNROLL_AVX512F 4
#ifndef INT8_TILE_COLS
#define INT8_TILE_COLS 2 /* weight rows per tile from 8 rows of x up, on the AVX-512 path: 1 or 2 */
#endif

/* The products of 16 columns from c, weight rows [j, j + cols) and rows [i0, i0 + mr) of x, into accumulators
   u; each vector of x loaded serves every weight row of the tile. */
static inline __attribute__((always_inline)) void int8_columns_avx512f(const float *xs, const int8_t *wj,
                                                                       __m512 acc[][2][INT8_UNROLL_AVX512F],
                                                                       int64_t i0, int mr, int cols, int u,
                                                                       int64_t c, int64_t k, int64_t k16) {
    __m512 wv[2];
    for (int q = 0; q < cols; q++)
        wv[q] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wj + q * k + c))));
    for (int i = 0; i < mr; i++) {
        const __m512 xv = _mm512_load_ps(xs + (i0 + i) * k16 + c);
        for (int q = 0; q < cols; q++) acc[i][q][u] = _mm512_fmadd_ps(xv, wv[q], acc[i][q][u]);
    }
}

/* int8_row_tile_avx2 in vectors of 16 float32, for weight rows [j, j + cols), the weights widened in order (xs:
   float_rows' X_IN_ORDER_16 copy, 64-byte aligned rows). */
static inline __attribute__((always_inline)) void int8_row_tile_avx512f(const uint16_t *x, const float *xs,
                                                                        int64_t k, int64_t ldx, const int8_t *w,
                                                                        const float *scale, const uint16_t *bias,
                                                                        int64_t n, uint16_t *y, int64_t i0, int mr,
                                                                        int cols, int unroll, int64_t j) {
    __m512 acc[INT8_MR_AVX512F][2][INT8_UNROLL_AVX512F];
    for (int i = 0; i < mr; i++)
        for (int q = 0; q < cols; q++)
            for (int u = 0; u < unroll; u++) acc[i][q][u] = _mm512_setzero_ps();
    const int8_t *wj = w + j * k;
    const int64_t k16 = k / 16 * 16;
    int64_t c = 0;
    for (; c + 16 * unroll <= k16; c += 16 * unroll) {
        if ((c & 63) == 0)
            for (int q = 0; q < cols; q++) prefetch_weights(wj + q * k + c);
        for (int u = 0; u < unroll; u++) int8_columns_avx512f(xs, wj, acc, i0, mr, cols, u, c + 16 * u, k, k16);
    }
    for (; c < k16; c += 16) int8_columns_avx512f(xs, wj, acc, i0, mr, cols, 0, c, k, k16);
    for (int q = 0; q < cols; q++) {
        const int8_t *wq = wj + q * k;
        for (int i = 0; i < mr; i++) {
            __m512 total = acc[i][q][0];
            for (int u = 1; u < unroll; u++) total = _mm512_add_ps(total, acc[i][q][u]);
            const uint16_t *xi = x + (i0 + i) * ldx;
            float sum = _mm512_reduce_add_ps(total);
            for (int64_t t = c; t < k; t++) sum += bf16_to_float(xi[t]) * (float)wq[t];
            y[(i0 + i) * n + j + q] = int8_finish(sum, scale, bias, j + q);
        }
    }
}

/* Accumulators per row of x and weight row in a tile of mr rows: enough to hide FMA's latency, within the
   registers with two weight rows. It depends on mr alone, so a weight row's products are summed in the same order
   whether it is paired or not, and results do not depend on how the threads split the rows. */
#define INT8_UNROLL_FOR(mr) ((mr) >= 5 ? 1 : (mr) >= 3 ? 2 : 4)
#define INT8_TILE_AVX512F(mr, cols) \
    int8_row_tile_avx512f(x, xs, k, ldx, w, scale, bias, n, y, i0, mr, cols, INT8_UNROLL_FOR(mr), j)

/* Weight rows [j, j + cols) against every row of x; always inlined with a constant cols. */
static inline __attribute__((always_inline)) void int8_columns_tiles_avx512f(const uint16_t *x, const float *xs,
                                                                             int64_t m, int64_t k, int64_t ldx,
                                                                             const int8_t *w, const float *scale,
                                                                             const uint16_t *bias, int64_t n,
                                                                             uint16_t *y, int cols, int64_t j) {
    int64_t i0 = 0;
    for (; i0 + INT8_MR_AVX512F <= m; i0 += INT8_MR_AVX512F) INT8_TILE_AVX512F(INT8_MR_AVX512F, cols);
    switch (m - i0) {
    case 7: INT8_TILE_AVX512F(7, cols); break;
    case 6: INT8_TILE_AVX512F(6, cols); break;
    case 5: INT8_TILE_AVX512F(5, cols); break;
    case 4: INT8_TILE_AVX512F(4, cols); break;
    case 3: INT8_TILE_AVX512F(3, cols); break;
    case 2: INT8_TILE_AVX512F(2, cols); break;
    case 1: INT8_TILE_AVX512F(1, cols); break;
    default: break;
    }
}

/* Returns 0, or -1 when out of memory for x's float32 copy (nothing computed then). */
static int int8_rows_avx512f(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w,
                             const float *scale, const uint16_t *bias, int64_t n, uint16_t *y, int64_t first,
                             int64_t last) {
    const float *xs = float_rows(x, m, k, ldx, X_IN_ORDER_16);
    if (xs == NULL) return -1;
    int64_t j = first;
    /* From a whole tile of rows of x up, two weight rows a tile: each vector of x loaded serves both, where the
       loads of x bounded the kernel. */
    if (INT8_TILE_COLS == 2 && m >= INT8_MR_AVX512F)
        for (; j + 2 <= last; j += 2) int8_columns_tiles_avx512f(x, xs, m, k, ldx, w, scale, bias, n, y, 2, j);
    for (; j < last; j++) int8_columns_tiles_avx512f(x, xs, m, k, ldx, w, scale, bias, n, y, 1, j);
    return 0;
}
#endif

static void linear_rows_int8(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w,
                             const float *scale, const uint16_t *bias, int64_t n, uint16_t *y, int64_t first,
                             int64_t last, int path) {
#if HAVE_AVX512_BF16
    if (path == PATH_BEST || path == PATH_AVX512_BF16) {
        int8_rows_avx512bf16(x, m, k, ldx, w, scale, bias, n, y, first, last);
        return;
    }
#endif
#if HAVE_AVX512
    if ((path == PATH_BEST || path == PATH_AVX512) && int8_rows_avx512f(x, m, k, ldx, w, scale, bias, n, y, first, last) == 0)
        return;
#endif
#if HAVE_AVX2
    if ((path == PATH_BEST || path == PATH_AVX2) && int8_rows_avx2(x, m, k, ldx, w, scale, bias, n, y, first, last) == 0)
        return;
#endif
    (void)path;
    int8_rows_portable(x, m, k, ldx, w, scale, bias, n, y, first, last);
}

/* Columns [first, last) of thread `t` of `threads`: contiguous ranges, so each thread streams one stretch of
   the weights front to back (separate streams per row measured slower). */
static void int8_thread_columns(int64_t n, int t, int threads, int64_t *first, int64_t *last) {
    const int64_t per = n / threads, extra = n % threads;
    *first = t * per + (t < extra ? t : extra);
    *last = *first + per + (t < extra ? 1 : 0);
}

/* Returns 0, or -1 for arguments it cannot take (an implementation not compiled in among them). */
int llmserve_linear_int8(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *w, const float *scale,
                         const uint16_t *bias, int64_t n, uint16_t *y, int threads, int path) {
    if (m < 0 || n < 0 || k <= 0 || ldx < k || threads < 1 || !path_built(path)) return -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t first = 0, last = n;
#if defined(_OPENMP)
        int8_thread_columns(n, omp_get_thread_num(), omp_get_num_threads(), &first, &last);
#endif
        linear_rows_int8(x, m, k, ldx, w, scale, bias, n, y, first, last, path);
    }
    return 0;
}

/* The implementations compiled in, as the bits 1 << PATH_*. */
int llmserve_linear_int8_paths(void) { return paths_built(); }
