/* bfloat16 <-> float32 for the CPU kernels (shared by every kernel in csrc/ and attention/csrc/). */
#ifndef LLMSERVE_BF16_H
#define LLMSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* Which implementation a CPU kernel call runs: the best compiled in, the plain-C one, or a named one (for
   tests and comparisons on machines that have more than one; a call naming one not compiled in is refused).
   PATH_AVX512 is AVX-512 without its BF16 instructions (Intel Skylake-SP to Ice Lake): float32 FMA on bf16 made
   float32 by shifts, as PATH_AVX2 does, in vectors twice as wide. */
enum { PATH_BEST = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512_BF16 = 3, PATH_AVX512 = 4 };

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && HAVE_AVX2 /* its helpers extend AVX2's */
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* The paths compiled in, as the bits 1 << PATH_*. */
static inline int paths_built(void) {
    return (1 << PATH_PORTABLE) | (HAVE_AVX2 << PATH_AVX2) | (HAVE_AVX512_BF16 << PATH_AVX512_BF16)
           | (HAVE_AVX512 << PATH_AVX512);
}

/* Whether `path` names an implementation compiled in. */
static inline int path_built(int path) { return path == PATH_BEST || (path >= 0 && path <= PATH_AVX512 && (paths_built() >> path) & 1); }

/* How far ahead of the weights being read the linear kernels prefetch them. Intel's L2 streamer stops at every
   4 KiB page, so a weight stream left to it stalls at each page boundary; one page ahead keeps the next page
   coming. On the 2-core AVX-512 Xeon VM, one-row linears over two threads went from 18.0 to 22.3 GB/s (bf16)
   and from 12.3 to 22.3 GB/s (int8); 4-8 rows gained 30-50% (bf16) and 10-30% (int8). AMD's prefetchers
   need it less: int8 on Zen 3 gained 15-20% from 2 KiB ahead, bf16 on Zen 3 and Zen 4 nothing (BENCHMARKS.md,
   issue 18; benchmarks/cpu_weight_prefetch.py sweeps the distance). 0 turns it off. */
#ifndef WEIGHT_PREFETCH_BYTES
#define WEIGHT_PREFETCH_BYTES 4096
#endif

/* Whether the bf16 kernel prefetches when it computes a single row of x (batch-1 decode). On AMD Zen 4 the
   hardware prefetchers stream one weight row faster alone: without it the kernel read 3-11% faster and
   batch-1 bf16 decode ran 1.04-1.27x faster, while 4-8 rows and the int8 kernel still gained 10-27% from it
   (BENCHMARKS.md, issue 18). The loaders build with 0 on AMD CPUs (cpu_linear.TUNING). */
#ifndef BF16_ONE_ROW_PREFETCH
#define BF16_ONE_ROW_PREFETCH 1
#endif

/* Prefetches the cache line WEIGHT_PREFETCH_BYTES past p; called once per 64 bytes of a weight stream. Always
   inlined: GCC takes a function that only prefetches for one without side effects and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_weights(const void *p) {
    if (WEIGHT_PREFETCH_BYTES) __builtin_prefetch((const char *)p + WEIGHT_PREFETCH_BYTES, 0, 3);
}

#if HAVE_AVX2
#include <immintrin.h>
#include <stdlib.h>

/* The even and odd elements of 16 bf16 values (one 256-bit load) as two vectors of 8 float32, exactly: bf16
   is float32's top half, so a shift or a mask converts without shuffles. Split two operands alike and
   their products pair up. */
static inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 bf16_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* This thread's scratch of at least `count` floats (contents not kept), reused by its later calls; NULL when out
   of memory. Aligned to a cache line, so no vector load from it straddles two. */
static inline float *thread_floats(size_t count) {
    static _Thread_local float *buffer = NULL;
    static _Thread_local size_t capacity = 0;
    if (count > capacity) {
        free(buffer);
        const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
        buffer = (float *)aligned_alloc(64, bytes);
        capacity = buffer == NULL ? 0 : count;
    }
    return buffer;
}

static inline float hsum256(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#if HAVE_AVX512
/* bf16_even / bf16_odd for 32 bf16 values (one 512-bit load): two vectors of 16 float32. */
static inline __m512 bf16_even512(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 bf16_odd512(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

/* How a kernel wants its rows of x in float32: each group of 16 (or 32) columns as its even elements then its odd
   ones (the order bf16_even / bf16_odd, or their 512-bit forms, give the weights), or in order. */
enum { X_SPLIT_16 = 0, X_SPLIT_32 = 1, X_IN_ORDER_16 = 2 };

/* Rows [0, m) of x (bf16, row stride ldx) as float32 in `layout` (X_SPLIT_32 and X_IN_ORDER_16 need HAVE_AVX512),
   row after row with stride k rounded down to the group (the last columns are left to scalar code). Converted
   once per call rather than once per weight row, into the calling thread's scratch. NULL when out of memory. */
static inline const float *float_rows(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, int layout) {
    const int64_t group = layout == X_SPLIT_32 ? 32 : 16, kg = k / group * group;
    float *buffer = thread_floats((size_t)(m * kg > 0 ? m * kg : 1));
    if (buffer == NULL) return NULL;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < kg; c += group) {
            const uint16_t *in = x + i * ldx + c;
            float *out = buffer + i * kg + c;
            if (layout == X_SPLIT_16) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)in);
                _mm256_storeu_ps(out, bf16_even(v));
                _mm256_storeu_ps(out + 8, bf16_odd(v));
            }
#if HAVE_AVX512
            else if (layout == X_SPLIT_32) {
                const __m512i v = _mm512_loadu_si512(in);
                _mm512_storeu_ps(out, bf16_even512(v));
                _mm512_storeu_ps(out + 16, bf16_odd512(v));
            } else {
                const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)in));
                _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
#endif
        }
    return buffer;
}
#endif

#endif
