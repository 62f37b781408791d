/* How the CPU kernels split rows over OpenMP threads: contiguous ranges, so each thread streams one stretch
   of memory front to back (separate streams per row measured slower). */
#ifndef LLMSERVE_THREAD_ROWS_H
#define LLMSERVE_THREAD_ROWS_H

#include <stdint.h>

/* Rows [first, last) of thread `t` of `threads`, in blocks of `align` rows. */
static inline void thread_rows(int64_t n, int64_t align, int t, int threads, int64_t *first, int64_t *last) {
    const int64_t blocks = (n + align - 1) / align;
    const int64_t per = blocks / threads, extra = blocks % threads;
    const int64_t b0 = t * per + (t < extra ? t : extra);
    const int64_t b1 = b0 + per + (t < extra ? 1 : 0);
    *first = b0 * align < n ? b0 * align : n;
    *last = b1 * align < n ? b1 * align : n;
}

#endif
