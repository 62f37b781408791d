/*
 * Paged-attention decode on the CPU: one query token per sequence, keys and values read straight from
 * their cache blocks through the block table (no gathered copy), one pass over each sequence's KV.
 *
 * Cache layout [num_blocks, kv_heads, block_size, head_dim], in float32 or bfloat16 like the queries, or in
 * int8 beside bfloat16 queries (see KV_INT8 below). Scores and accumulators are float32 whatever the storage
 * type. Two implementations:
 *  - AVX-512 (compiled where the build machine has it, used when head_dim is a multiple of 16 and the
 *    block size at most 64): a task is one sequence and a run of its kv heads, so each cache block is read
 *    as one contiguous stretch; an online softmax per block (no score buffer); 16-lane exp. For head_dim 64
 *    and 128: bf16 keys dotted with the bf16 query by the AVX512-BF16 instruction where present (bf16
 *    products are exact in float32, so only the summation order differs), 16 rows at a time with one
 *    transpose-and-add for their sums (block sizes that are multiples of 16), and the value accumulators
 *    held in registers across a block's rows; other shapes convert keys to float32 row by row. An int8
 *    cache converts each key and value row to float32 once for all the query heads that share it; a row's
 *    scale multiplies its score (keys) or its softmax weight (values), not its elements.
 *  - Portable C for everything else: work split over (sequence, kv head), the `group` query heads that
 *    share a kv head scored together so each key/value row is loaded once.
 *
 * Built on first use by llmserve/model/attention/cpu_kernels.py with the system C compiler and called
 * through ctypes with raw pointers, so it needs no PyTorch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

static inline float f32_load(const float *p) { return *p; }
static inline float bf16_load(const uint16_t *p) { return bf16_to_float(*p); }
static inline void f32_store(float *p, float v) { *p = v; }
static inline void bf16_store(uint16_t *p, float v) { *p = float_to_bf16(v); }

#define MAX_GROUP 16
#define MAX_DIM 256

/* Cache formats, the `dtype` argument of the entry points. KV_F32 and KV_BF16: queries, outputs and cache in
   that type. KV_INT8: bfloat16 queries and outputs over an int8 cache in which each (block, kv head) holds
   block_size rows of head_dim int8 values followed by block_size bfloat16 scales, value = int8 * scale, one
   scale per (token, kv head): half the bytes of bfloat16 and two bytes a row. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };
#define KV_INT8_MIN_SCALE 1e-30f

/* Bytes of one (block, kv head) of a cache in `format`. */
static inline size_t region_bytes(int format, int dim, int block_size) {
    const size_t rows = (size_t)block_size;
    switch (format) {
    case KV_F32: return rows * (size_t)dim * sizeof(float);
    case KV_BF16: return rows * (size_t)dim * sizeof(uint16_t);
    default: return rows * ((size_t)dim + sizeof(uint16_t));
    }
}

/* An int8 region's scales, after its values. */
static inline const uint16_t *int8_scales(const int8_t *region, int dim, int block_size) {
    return (const uint16_t *)(region + (size_t)block_size * dim);
}

/* Row r of (block, kv head) number `region` of a cache in `format`, in float32. */
static inline __attribute__((always_inline)) void load_row(float *row, const void *cache, int format, size_t region,
                                                           int r, int dim, int block_size) {
    const char *base = (const char *)cache + region * region_bytes(format, dim, block_size);
    if (format == KV_F32) {
        memcpy(row, (const float *)base + (size_t)r * dim, sizeof(float) * dim);
    } else if (format == KV_BF16) {
        const uint16_t *p = (const uint16_t *)base + (size_t)r * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) row[d] = bf16_to_float(p[d]);
    } else {
        const int8_t *p = (const int8_t *)base + (size_t)r * dim;
        const float scale = bf16_to_float(int8_scales((const int8_t *)base, dim, block_size)[r]);
#pragma omp simd
        for (int d = 0; d < dim; d++) row[d] = (float)p[d] * scale;
    }
}

/* A (token, kv head) row of bfloat16 values x written at row `offset` of region `region` of a cache in
   `format`. int8: scale = absmax / 127 rounded to bfloat16, values x / scale rounded half to even and clamped
   to +-127; the torch backend's write (int8_kv.py) does the same arithmetic, so both store the same bits. */
static inline void store_row(void *cache, int format, size_t region, int offset, int dim, int block_size,
                             const uint16_t *x) {
    char *base = (char *)cache + region * region_bytes(format, dim, block_size);
    if (format == KV_BF16) {
        memcpy((uint16_t *)base + (size_t)offset * dim, x, sizeof(uint16_t) * dim);
        return;
    }
    float absmax = 0.0f;
    for (int d = 0; d < dim; d++) absmax = fmaxf(absmax, fabsf(bf16_to_float(x[d])));
    const uint16_t scale = float_to_bf16(fmaxf(absmax / 127.0f, KV_INT8_MIN_SCALE));
    const float divisor = bf16_to_float(scale);
    int8_t *values = (int8_t *)base + (size_t)offset * dim;
    for (int d = 0; d < dim; d++) {
        const float v = nearbyintf(bf16_to_float(x[d]) / divisor);
        values[d] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    ((uint16_t *)(base + (size_t)block_size * dim))[offset] = scale;
}
#ifndef KV_PREFETCH_BLOCKS
#define KV_PREFETCH_BLOCKS 2
#endif

/* Asks for `bytes` from p a cache line at a time. Always inlined: GCC takes a function that only prefetches
   for one without side effects and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_range(const void *p, size_t bytes) {
    for (size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch((const char *)p + offset, 0, 3);
}

/* A task reads its heads' part of each block, a few KiB, then jumps to the next block wherever the block
   table puts it, so the hardware prefetcher never gets going. While the task reads the block holding
   position `first` of its sequence (`table`: its block table), this prefetches heads [h0, h0 + nh) of
   `cache` (`region` bytes per block and head) in the block KV_PREFETCH_BLOCKS ahead, and at the first block
   in every block up to it. */
static inline __attribute__((always_inline)) void prefetch_blocks_ahead(const void *cache, const int32_t *table,
                                                                        int first, int len, int block_size,
                                                                        size_t kv_heads, size_t h0, size_t nh,
                                                                        size_t region) {
    const int index = first / block_size;
    for (int ahead = first == 0 ? 1 : KV_PREFETCH_BLOCKS; ahead <= KV_PREFETCH_BLOCKS; ahead++) {
        if (first + ahead * block_size >= len) return;
        const size_t at = ((size_t)table[index + ahead] * kv_heads + h0) * region;
        prefetch_range((const char *)cache + at, nh * region);
    }
}

/* Threads of the enclosing team (1 outside a parallel region): the functions below split their tasks over
   it with an orphaned `omp for`, so they run inside one region opened by their caller. */
static inline int team_size(void) {
#if defined(_OPENMP)
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* The portable implementation for queries and outputs of type T over a cache in FORMAT. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, FORMAT)                                                     \
    static void NAME(const T *q, const void *k_cache, const void *v_cache, const int32_t *tables,         \
                     const int32_t *lens, T *out, int batch, int heads, int kv_heads, int dim,             \
                     int block_size, int max_blocks, float scale) {                                        \
        const int group = heads / kv_heads;                                                               \
        const size_t region = region_bytes(FORMAT, dim, block_size);                                      \
        _Pragma("omp for schedule(dynamic, 1)")                                                           \
        for (int task = 0; task < batch * kv_heads; task++) {                                             \
            const int b = task / kv_heads, h = task % kv_heads, len = lens[b];                            \
            const int32_t *table = tables + (size_t)b * max_blocks;                                       \
            float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], row[MAX_DIM];                         \
            float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(len > 0 ? len : 1));  \
            for (int g = 0; g < group; g++)                                                               \
                for (int d = 0; d < dim; d++)                                                             \
                    qf[g * dim + d] = LOAD(q + ((size_t)b * heads + h * group + g) * dim + d) * scale;     \
            float maxs[MAX_GROUP];                                                                        \
            for (int g = 0; g < group; g++) maxs[g] = -INFINITY;                                          \
            for (int first = 0; first < len; first += block_size) {                                       \
                const size_t kregion = (size_t)table[first / block_size] * kv_heads + h;                  \
                const int rows = len - first < block_size ? len - first : block_size;                     \
                prefetch_blocks_ahead(k_cache, table, first, len, block_size, (size_t)kv_heads, (size_t)h, 1, region); \
                for (int r = 0; r < rows; r++) {                                                          \
                    load_row(row, k_cache, FORMAT, kregion, r, dim, block_size);                          \
                    for (int g = 0; g < group; g++) {                                                     \
                        float dot = 0.0f;                                                                 \
                        const float *qg = qf + g * dim;                                                   \
                        _Pragma("omp simd reduction(+:dot)")                                              \
                        for (int d = 0; d < dim; d++) dot += qg[d] * row[d];                              \
                        scores[(size_t)g * len + first + r] = dot;                                        \
                        if (dot > maxs[g]) maxs[g] = dot;                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            float sums[MAX_GROUP];                                                                        \
            for (int g = 0; g < group; g++) {                                                             \
                float sum = 0.0f;                                                                         \
                float *sg = scores + (size_t)g * len;                                                     \
                for (int pos = 0; pos < len; pos++) {                                                     \
                    sg[pos] = expf(sg[pos] - maxs[g]);                                                    \
                    sum += sg[pos];                                                                       \
                }                                                                                         \
                sums[g] = sum;                                                                            \
            }                                                                                             \
            memset(acc, 0, sizeof(float) * (size_t)group * dim);                                          \
            for (int first = 0; first < len; first += block_size) {                                       \
                const size_t vregion = (size_t)table[first / block_size] * kv_heads + h;                  \
                const int rows = len - first < block_size ? len - first : block_size;                     \
                prefetch_blocks_ahead(v_cache, table, first, len, block_size, (size_t)kv_heads, (size_t)h, 1, region); \
                for (int r = 0; r < rows; r++) {                                                          \
                    load_row(row, v_cache, FORMAT, vregion, r, dim, block_size);                          \
                    for (int g = 0; g < group; g++) {                                                     \
                        const float p = scores[(size_t)g * len + first + r];                              \
                        float *ag = acc + g * dim;                                                        \
                        _Pragma("omp simd")                                                               \
                        for (int d = 0; d < dim; d++) ag[d] += p * row[d];                                \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            for (int g = 0; g < group; g++) {                                                             \
                const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;                                 \
                T *o = out + ((size_t)b * heads + h * group + g) * dim;                                   \
                for (int d = 0; d < dim; d++) STORE(o + d, acc[g * dim + d] * inv);                       \
            }                                                                                             \
            free(scores);                                                                                 \
        }                                                                                                 \
    }

DEFINE_DECODE(portable_f32, float, f32_load, f32_store, KV_F32)
DEFINE_DECODE(portable_bf16, uint16_t, bf16_load, bf16_store, KV_BF16)
DEFINE_DECODE(portable_int8, uint16_t, bf16_load, bf16_store, KV_INT8)

#if defined(__AVX512F__)
#define MAX_BLOCK 64
#define MAX_QUERIES_PER_TASK 16

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

/* exp(x) for x <= 0 on 16 lanes: 2^t with t = x log2(e), split as 2^floor(t) * 2^frac(t), the second by a
   degree-6 polynomial (relative error ~2e-7); scalef applies the power of two and flushes to 0 below range. */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, fi);
}

/* Scores of one key row against the query heads of kv head HH, the key converted to float32 first. */
#define DOT_CONVERTED(LOAD16, KROW, HH, R)                                                              \
    {                                                                                                   \
        __m512 kr[MAX_DIM / 16];                                                                        \
        for (int c = 0; c < chunks; c++) kr[c] = LOAD16((KROW) + c * 16);                               \
        for (int g = 0; g < group; g++) {                                                               \
            const float *qg = qf + ((HH) * group + g) * dim;                                            \
            __m512 d0 = _mm512_mul_ps(_mm512_load_ps(qg), kr[0]);                                       \
            for (int c = 1; c < chunks; c++) d0 = _mm512_fmadd_ps(_mm512_load_ps(qg + c * 16), kr[c], d0); \
            s[((HH) * group + g) * MAX_BLOCK + (R)] = _mm512_reduce_add_ps(d0);                         \
        }                                                                                               \
    }

/* out[r] = sum of the 16 lanes of v[r], for 16 vectors at once (a transpose-and-add tree). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#if defined(__AVX512BF16__)
/* Scores of the 16-row stretches of a bf16 key block against one bf16 query (dim = 32 * CH): each row's
   dot-product vector is kept, and 16 rows are summed across lanes at once (reduce16). */
#define DEFINE_QK_ROWS(NAME, CH)                                                                        \
    static inline void NAME(const uint16_t *query, const uint16_t *keys, int rows, float scale, float *out) { \
        __m512bh qv[CH];                                                                                \
        for (int c = 0; c < CH; c++) qv[c] = (__m512bh)_mm512_loadu_si512(query + c * 32);              \
        for (int r0 = 0; r0 < rows; r0 += 16) {                                                         \
            __m512 d[16];                                                                               \
            for (int r = 0; r < 16; r++) {                                                              \
                __m512 x = _mm512_setzero_ps();                                                         \
                for (int c = 0; c < CH; c++)                                                            \
                    x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(keys + (size_t)(r0 + r) * 32 * CH + c * 32)); \
                d[r] = x;                                                                               \
            }                                                                                           \
            _mm512_storeu_ps(out + r0, _mm512_mul_ps(reduce16(d), _mm512_set1_ps(scale)));              \
        }                                                                                               \
    }
DEFINE_QK_ROWS(qk_rows_64, 2)
DEFINE_QK_ROWS(qk_rows_128, 4)

/* The scores of one kv head's query group against a whole key block, when the shapes allow the fast
   path (rows read in stretches of 16 need a block size that is a multiple of 16); 0 otherwise. */
static inline int qk_block_bf16(const uint16_t *queries, const uint16_t *keys, int rows, int dim, int group,
                                int block_size, float scale, float *scores) {
    if (block_size % 16 != 0 || (dim != 64 && dim != 128)) return 0;
    for (int g = 0; g < group; g++) {
        if (dim == 64) qk_rows_64(queries + g * dim, keys, rows, scale, scores + g * MAX_BLOCK);
        else qk_rows_128(queries + g * dim, keys, rows, scale, scores + g * MAX_BLOCK);
    }
    return 1;
}
#define FAST_QK_BF16(QUERIES, KEYS, ROWS, SCORES) \
    qk_block_bf16((const uint16_t *)(QUERIES), (const uint16_t *)(KEYS), ROWS, dim, group, block_size, scale, SCORES)
#else
#define FAST_QK_BF16(QUERIES, KEYS, ROWS, SCORES) 0
#endif
#define FAST_QK_NONE(QUERIES, KEYS, ROWS, SCORES) 0

/* acc[0:16*CHUNKS] += sum over rows r of p[r] * v[r]: the accumulators stay in registers across the rows. */
#define PV_FIXED(LOAD16, CHUNKS, ACC, P, VB, ROWS)                                                      \
    {                                                                                                   \
        __m512 a[CHUNKS];                                                                               \
        for (int c = 0; c < CHUNKS; c++) a[c] = _mm512_load_ps((ACC) + c * 16);                         \
        for (int r = 0; r < (ROWS); r++) {                                                              \
            const __m512 p = _mm512_set1_ps((P)[r]);                                                    \
            for (int c = 0; c < CHUNKS; c++)                                                            \
                a[c] = _mm512_fmadd_ps(p, LOAD16((VB) + (size_t)r * 16 * CHUNKS + c * 16), a[c]);        \
        }                                                                                               \
        for (int c = 0; c < CHUNKS; c++) _mm512_store_ps((ACC) + c * 16, a[c]);                         \
    }


/* Kv heads per task: as many as fit (whole blocks are read contiguously), fewer when that would leave too few
   tasks to keep every thread busy. */
static inline int heads_per_task(int batch, int kv_heads, int group, int threads) {
    int per_task = kv_heads;
    while ((per_task * group > MAX_QUERIES_PER_TASK || (long)batch * (kv_heads / per_task) < 4L * threads)
           && per_task % 2 == 0)
        per_task /= 2;
    return per_task * group > MAX_QUERIES_PER_TASK ? 1 : per_task;
}

/* The online softmax step of a block for the task's nq queries: each query's scores s (stride MAX_BLOCK,
   `rows` of them) become exp(score - new running max), its running max m and sum l are updated and its
   accumulator (dim floats) is rescaled to the new max. */
static inline void softmax_block(float *s, int nq, int rows, float *m, float *l, float *acc, int dim) {
    for (int i = 0; i < nq; i++) {
        float *si = s + i * MAX_BLOCK;
        float bm = m[i];
        for (int r = 0; r < rows; r++) bm = si[r] > bm ? si[r] : bm;
        const float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - bm);
        __m512 vsum = _mm512_setzero_ps();
        const __m512 vbm = _mm512_set1_ps(bm);
        for (int r = 0; r < rows; r += 16) {
            const __mmask16 mask = rows - r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (rows - r)) - 1u);
            __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, si + r), vbm));
            p = _mm512_maskz_mov_ps(mask, p);
            _mm512_storeu_ps(si + r, p);
            vsum = _mm512_add_ps(vsum, p);
        }
        l[i] = l[i] * alpha + _mm512_reduce_add_ps(vsum);
        m[i] = bm;
        if (alpha != 1.0f) {
            const __m512 va = _mm512_set1_ps(alpha);
            for (int c = 0; c < dim / 16; c++)
                _mm512_store_ps(acc + i * dim + c * 16, _mm512_mul_ps(_mm512_load_ps(acc + i * dim + c * 16), va));
        }
    }
}

#define DEFINE_DECODE_AVX512(NAME, T, LOAD16, STORE, FAST_QK)                                          \
static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables, const int32_t *lens, \
                 T *out, int batch, int heads, int kv_heads, int dim, int block_size, int max_blocks,    \
                 float scale) {                                                                         \
    const int group = heads / kv_heads, chunks = dim / 16;                                              \
    const int per_task = heads_per_task(batch, kv_heads, group, team_size()), splits = kv_heads / per_task; \
    const size_t region = (size_t)block_size * dim * sizeof(T);                                         \
    _Pragma("omp for schedule(dynamic, 1)")                                                             \
    for (int task = 0; task < batch * splits; task++) {                                                 \
        const int b = task / splits, h0 = (task % splits) * per_task, len = lens[b];                    \
        const int nq = per_task * group;                                                                \
        __attribute__((aligned(64))) float qf[MAX_QUERIES_PER_TASK * MAX_DIM];                          \
        __attribute__((aligned(64))) float acc[MAX_QUERIES_PER_TASK * MAX_DIM];                         \
        __attribute__((aligned(64))) float s[MAX_QUERIES_PER_TASK * MAX_BLOCK];                         \
        float m[MAX_QUERIES_PER_TASK], l[MAX_QUERIES_PER_TASK];                                         \
        const T *qraw = q + ((size_t)b * heads + h0 * group) * dim;                                     \
        (void)qraw; /* read by the 16-row bf16 path only */                                             \
        const __m512 vscale = _mm512_set1_ps(scale);                                                    \
        for (int i = 0; i < nq; i++) {                                                                  \
            const T *qi = q + ((size_t)b * heads + h0 * group + i) * dim;                               \
            for (int c = 0; c < chunks; c++) {                                                          \
                _mm512_store_ps(qf + i * dim + c * 16, _mm512_mul_ps(LOAD16(qi + c * 16), vscale));     \
                _mm512_store_ps(acc + i * dim + c * 16, _mm512_setzero_ps());                           \
            }                                                                                           \
            m[i] = -INFINITY;                                                                           \
            l[i] = 0.0f;                                                                                \
        }                                                                                               \
        for (int first = 0; first < len; first += block_size) {                                         \
            const size_t block = (size_t)tables[(size_t)b * max_blocks + first / block_size];           \
            const int rows = len - first < block_size ? len - first : block_size;                       \
            prefetch_blocks_ahead(k_cache, tables + (size_t)b * max_blocks, first, len, block_size,     \
                                  (size_t)kv_heads, (size_t)h0, (size_t)per_task, region);              \
            prefetch_blocks_ahead(v_cache, tables + (size_t)b * max_blocks, first, len, block_size,     \
                                  (size_t)kv_heads, (size_t)h0, (size_t)per_task, region);              \
            for (int hh = 0; hh < per_task; hh++) {                                                     \
                const T *kb = k_cache + ((block * kv_heads + h0 + hh) * block_size) * dim;              \
                if (FAST_QK(qraw + (size_t)hh * group * dim, kb, rows, s + hh * group * MAX_BLOCK)) continue; \
                for (int r = 0; r < rows; r++) DOT_CONVERTED(LOAD16, kb + (size_t)r * dim, hh, r)      \
            }                                                                                           \
            softmax_block(s, nq, rows, m, l, acc, dim);                                                 \
            for (int hh = 0; hh < per_task; hh++) {                                                     \
                const T *vb = v_cache + ((block * kv_heads + h0 + hh) * block_size) * dim;              \
                for (int g = 0; g < group; g++) {                                                       \
                    float *ag = acc + (hh * group + g) * dim;                                           \
                    const float *pg = s + (hh * group + g) * MAX_BLOCK;                                 \
                    if (dim == 64) PV_FIXED(LOAD16, 4, ag, pg, vb, rows)                                \
                    else if (dim == 128) PV_FIXED(LOAD16, 8, ag, pg, vb, rows)                          \
                    else {                                                                              \
                        for (int r = 0; r < rows; r++) {                                                \
                            const __m512 p = _mm512_set1_ps(pg[r]);                                     \
                            for (int c = 0; c < chunks; c++)                                            \
                                _mm512_store_ps(ag + c * 16, _mm512_fmadd_ps(p, LOAD16(vb + (size_t)r * dim + c * 16), _mm512_load_ps(ag + c * 16))); \
                        }                                                                               \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < nq; i++) {                                                                  \
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;                                         \
            T *o = out + ((size_t)b * heads + h0 * group + i) * dim;                                    \
            for (int d = 0; d < dim; d++) STORE(o + d, acc[i * dim + d] * inv);                         \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_DECODE_AVX512(avx512_f32, float, load16_f32, f32_store, FAST_QK_NONE)
DEFINE_DECODE_AVX512(avx512_bf16, uint16_t, load16_bf16, bf16_store, FAST_QK_BF16)

static inline __m512 load16_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Scores of a kv head's `group` queries (qf: float32, the softmax scale folded in) against the rows of an
   int8 key block: each row converted once for all of them, its scale applied to the dot products. Rows go
   16 at a time (summed across lanes together, reduce16) while whole stretches of 16 fit in the block. */
static inline __attribute__((always_inline)) void qk_int8(const float *qf, const int8_t *keys,
                                                           const uint16_t *kscale, int rows, int dim, int group,
                                                           int block_size, float *scores) {
    const int chunks = dim / 16;
    const int stretched = block_size % 16 == 0 ? rows : rows - rows % 16;
    int r0 = 0;
    for (; r0 < stretched; r0 += 16) {
        __m512 d[MAX_GROUP][16];
        for (int r = 0; r < 16; r++) {
            const int8_t *row = keys + (size_t)(r0 + r) * dim;
            __m512 kr[MAX_DIM / 16];
            for (int c = 0; c < chunks; c++) kr[c] = load16_int8(row + c * 16);
            for (int g = 0; g < group; g++) {
                const float *qg = qf + g * dim;
                __m512 x = _mm512_mul_ps(_mm512_load_ps(qg), kr[0]);
                for (int c = 1; c < chunks; c++) x = _mm512_fmadd_ps(_mm512_load_ps(qg + c * 16), kr[c], x);
                d[g][r] = x;
            }
        }
        const __m512 ks = load16_bf16(kscale + r0);
        for (int g = 0; g < group; g++) _mm512_storeu_ps(scores + g * MAX_BLOCK + r0, _mm512_mul_ps(reduce16(d[g]), ks));
    }
    for (; r0 < rows; r0++) {
        const int8_t *row = keys + (size_t)r0 * dim;
        const float ks = bf16_to_float(kscale[r0]);
        for (int g = 0; g < group; g++) {
            const float *qg = qf + g * dim;
            __m512 x = _mm512_mul_ps(_mm512_load_ps(qg), load16_int8(row));
            for (int c = 1; c < chunks; c++) x = _mm512_fmadd_ps(_mm512_load_ps(qg + c * 16), load16_int8(row + c * 16), x);
            scores[g * MAX_BLOCK + r0] = _mm512_reduce_add_ps(x) * ks;
        }
    }
}

/* acc (group rows of dim floats) += sum over the block's rows r of p[r] * vscale[r] * v[r], each int8 value
   row converted once for all the group's queries (p: their softmax weights, stride MAX_BLOCK). */
static inline __attribute__((always_inline)) void pv_int8(float *acc, const float *p, const int8_t *values,
                                                           const uint16_t *vscale, int rows, int dim, int group) {
    const int chunks = dim / 16;
    for (int r = 0; r < rows; r++) {
        const int8_t *row = values + (size_t)r * dim;
        const float vs = bf16_to_float(vscale[r]);
        __m512 vr[MAX_DIM / 16];
        for (int c = 0; c < chunks; c++) vr[c] = load16_int8(row + c * 16);
        for (int g = 0; g < group; g++) {
            const __m512 w = _mm512_set1_ps(p[g * MAX_BLOCK + r] * vs);
            float *ag = acc + g * dim;
            for (int c = 0; c < chunks; c++)
                _mm512_store_ps(ag + c * 16, _mm512_fmadd_ps(w, vr[c], _mm512_load_ps(ag + c * 16)));
        }
    }
}

/* bfloat16 queries over an int8 cache (KV_INT8), split into tasks as the function above does. */
static void avx512_int8(const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache, const int32_t *tables,
                        const int32_t *lens, uint16_t *out, int batch, int heads, int kv_heads, int dim,
                        int block_size, int max_blocks, float scale) {
    const int group = heads / kv_heads, chunks = dim / 16;
    const int per_task = heads_per_task(batch, kv_heads, group, team_size()), splits = kv_heads / per_task;
    const size_t region = region_bytes(KV_INT8, dim, block_size);
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < batch * splits; task++) {
        const int b = task / splits, h0 = (task % splits) * per_task, len = lens[b], nq = per_task * group;
        const int32_t *table = tables + (size_t)b * max_blocks;
        __attribute__((aligned(64))) float qf[MAX_QUERIES_PER_TASK * MAX_DIM];
        __attribute__((aligned(64))) float acc[MAX_QUERIES_PER_TASK * MAX_DIM];
        __attribute__((aligned(64))) float s[MAX_QUERIES_PER_TASK * MAX_BLOCK];
        float m[MAX_QUERIES_PER_TASK], l[MAX_QUERIES_PER_TASK];
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int i = 0; i < nq; i++) {
            const uint16_t *qi = q + ((size_t)b * heads + h0 * group + i) * dim;
            for (int c = 0; c < chunks; c++) {
                _mm512_store_ps(qf + i * dim + c * 16, _mm512_mul_ps(load16_bf16(qi + c * 16), vscale));
                _mm512_store_ps(acc + i * dim + c * 16, _mm512_setzero_ps());
            }
            m[i] = -INFINITY;
            l[i] = 0.0f;
        }
        for (int first = 0; first < len; first += block_size) {
            const size_t block = (size_t)table[first / block_size];
            const int rows = len - first < block_size ? len - first : block_size;
            prefetch_blocks_ahead(k_cache, table, first, len, block_size, (size_t)kv_heads, (size_t)h0,
                                  (size_t)per_task, region);
            prefetch_blocks_ahead(v_cache, table, first, len, block_size, (size_t)kv_heads, (size_t)h0,
                                  (size_t)per_task, region);
            for (int hh = 0; hh < per_task; hh++) {
                const int8_t *kb = k_cache + (block * kv_heads + h0 + hh) * region;
                const uint16_t *ks = int8_scales(kb, dim, block_size);
                float *sh = s + hh * group * MAX_BLOCK;
                const float *qh = qf + hh * group * dim;
                if (dim == 64) qk_int8(qh, kb, ks, rows, 64, group, block_size, sh);
                else if (dim == 128) qk_int8(qh, kb, ks, rows, 128, group, block_size, sh);
                else qk_int8(qh, kb, ks, rows, dim, group, block_size, sh);
            }
            softmax_block(s, nq, rows, m, l, acc, dim);
            for (int hh = 0; hh < per_task; hh++) {
                const int8_t *vb = v_cache + (block * kv_heads + h0 + hh) * region;
                const uint16_t *vs = int8_scales(vb, dim, block_size);
                float *ah = acc + hh * group * dim;
                const float *ph = s + hh * group * MAX_BLOCK;
                if (dim == 64) pv_int8(ah, ph, vb, vs, rows, 64, group);
                else if (dim == 128) pv_int8(ah, ph, vb, vs, rows, 128, group);
                else pv_int8(ah, ph, vb, vs, rows, dim, group);
            }
        }
        for (int i = 0; i < nq; i++) {
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            uint16_t *o = out + ((size_t)b * heads + h0 * group + i) * dim;
            for (int d = 0; d < dim; d++) bf16_store(o + d, acc[i * dim + d] * inv);
        }
    }
}
#endif

typedef void (*decode_fn)(const void *, const void *, const void *, const int32_t *, const int32_t *, void *, int,
                          int, int, int, int, int, float);

/* The implementation for this format (KV_*) and these shapes, to be called by every thread of a team; NULL
   when none takes them. */
static decode_fn choose_decode(int format, int allow_avx512, int heads, int kv_heads, int dim, int block_size) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim > MAX_DIM) return NULL;
    if (format == KV_INT8 && dim % 2 != 0) return NULL; /* the scales after the values are 2-byte aligned */
    decode_fn fn;
    switch (format) {
    case KV_F32: fn = (decode_fn)portable_f32; break;
    case KV_BF16: fn = (decode_fn)portable_bf16; break;
    case KV_INT8: fn = (decode_fn)portable_int8; break;
    default: return NULL;
    }
#if defined(__AVX512F__)
    if (allow_avx512 && dim % 16 == 0 && block_size <= MAX_BLOCK)
        fn = format == KV_F32 ? (decode_fn)avx512_f32 : format == KV_BF16 ? (decode_fn)avx512_bf16 : (decode_fn)avx512_int8;
#else
    (void)allow_avx512;
    (void)block_size;
#endif
    return fn;
}

static int dispatch(int dtype, int allow_avx512, const void *q, const void *k_cache, const void *v_cache,
                    const int32_t *tables, const int32_t *lens, void *out, int batch, int heads, int kv_heads,
                    int dim, int block_size, int max_blocks, float scale, int threads) {
    decode_fn fn = choose_decode(dtype, allow_avx512, heads, kv_heads, dim, block_size);
    if (fn == NULL) return -1;
#pragma omp parallel num_threads(threads)
    fn(q, k_cache, v_cache, tables, lens, out, batch, heads, kv_heads, dim, block_size, max_blocks, scale);
    return 0;
}

/* dtype: a KV_* format. Returns 0 on success, -1 for an unsupported shape or format. */
int llmserve_paged_decode(int dtype, const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *tables, const int32_t *lens, void *out, int batch, int heads,
                          int kv_heads, int dim, int block_size, int max_blocks, float scale, int threads) {
    return dispatch(dtype, 1, q, k_cache, v_cache, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                    max_blocks, scale, threads);
}

/* The portable implementation alone, so tests can check it on machines that have AVX-512. */
int llmserve_paged_decode_portable(int dtype, const void *q, const void *k_cache, const void *v_cache,
                                   const int32_t *tables, const int32_t *lens, void *out, int batch, int heads,
                                   int kv_heads, int dim, int block_size, int max_blocks, float scale,
                                   int threads) {
    return dispatch(dtype, 0, q, k_cache, v_cache, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                    max_blocks, scale, threads);
}
