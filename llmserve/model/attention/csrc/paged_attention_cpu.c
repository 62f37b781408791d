/*
 * Paged-attention decode on the CPU: one query token per sequence, keys and values read straight from
 * their cache blocks through the block table (no gathered copy), one pass over each sequence's KV.
 *
 * Cache layout [num_blocks, kv_heads, block_size, head_dim]. Work is split over (sequence, kv head);
 * the `group` query heads that share a kv head are scored together, so each key/value row is loaded
 * once. Scores and accumulators are float32 whatever the storage type.
 *
 * Built on first use by llmserve/model/attention/cpu_kernels.py with the system C compiler and called
 * through ctypes with raw pointers, so it needs no PyTorch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

static inline float f32_load(const float *p) { return *p; }
static inline float bf16_load(const uint16_t *p) { return bf16_to_float(*p); }
static inline void f32_store(float *p, float v) { *p = v; }
static inline void bf16_store(uint16_t *p, float v) { *p = float_to_bf16(v); }

#define MAX_GROUP 16
#define MAX_DIM 256

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                             \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables,               \
                     const int32_t *lens, T *out, int batch, int heads, int kv_heads, int dim,             \
                     int block_size, int max_blocks, float scale, int threads) {                           \
        const int group = heads / kv_heads;                                                               \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                              \
        for (int task = 0; task < batch * kv_heads; task++) {                                             \
            const int b = task / kv_heads, h = task % kv_heads, len = lens[b];                            \
            float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], row[MAX_DIM];                         \
            float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(len > 0 ? len : 1));  \
            for (int g = 0; g < group; g++)                                                               \
                for (int d = 0; d < dim; d++)                                                             \
                    qf[g * dim + d] = LOAD(q + ((size_t)b * heads + h * group + g) * dim + d) * scale;     \
            float maxs[MAX_GROUP];                                                                        \
            for (int g = 0; g < group; g++) maxs[g] = -INFINITY;                                          \
            for (int first = 0; first < len; first += block_size) {                                       \
                const T *kblock = k_cache + ((size_t)tables[(size_t)b * max_blocks + first / block_size] * kv_heads + h) \
                                  * block_size * dim;                                                     \
                const int rows = len - first < block_size ? len - first : block_size;                     \
                for (int r = 0; r < rows; r++) {                                                          \
                    _Pragma("omp simd")                                                                   \
                    for (int d = 0; d < dim; d++) row[d] = LOAD(kblock + (size_t)r * dim + d);            \
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
                const T *vblock = v_cache + ((size_t)tables[(size_t)b * max_blocks + first / block_size] * kv_heads + h) \
                                  * block_size * dim;                                                     \
                const int rows = len - first < block_size ? len - first : block_size;                     \
                for (int r = 0; r < rows; r++) {                                                          \
                    _Pragma("omp simd")                                                                   \
                    for (int d = 0; d < dim; d++) row[d] = LOAD(vblock + (size_t)r * dim + d);            \
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

DEFINE_DECODE(decode_f32, float, f32_load, f32_store)
DEFINE_DECODE(decode_bf16, uint16_t, bf16_load, bf16_store)

/* dtype: 0 float32, 1 bfloat16. Returns 0 on success, -1 for an unsupported shape or dtype. */
int llmserve_paged_decode(int dtype, const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *tables, const int32_t *lens, void *out, int batch, int heads,
                          int kv_heads, int dim, int block_size, int max_blocks, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim > MAX_DIM) return -1;
    if (dtype == 0)
        decode_f32((const float *)q, (const float *)k_cache, (const float *)v_cache, tables, lens, (float *)out,
                   batch, heads, kv_heads, dim, block_size, max_blocks, scale, threads);
    else if (dtype == 1)
        decode_bf16((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, tables, lens,
                    (uint16_t *)out, batch, heads, kv_heads, dim, block_size, max_blocks, scale, threads);
    else
        return -1;
    return 0;
}
