/* Paged decode attention for CPU (float32 or bfloat16 caches, float32 queries and outputs): one query token per request, keys and values read in place
 * from the paged KV cache through the request's block table (no gather copy).
 *
 *   q            [num_seqs, num_kv_heads, group, head_dim]    (group = query heads per KV head)
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, max_blocks] int64
 *   seq_lens     [num_seqs] int64                             (keys 0 .. seq_len-1 are attended)
 *   out          [num_seqs, num_kv_heads, group, head_dim]
 *
 * Two passes per (sequence, KV head): scores = q.k * scale for every key (each key row read once for
 * all `group` query heads), a numerically stable softmax (max subtracted), then out = sum p * v.
 * Work items (sequence, KV head) are split over OpenMP threads (the runtime torch loaded: one pool).
 * A bfloat16 cache is widened to float32 as each K/V row is read (shift left 16); the math is float32.
 * Reference: the plain softmax(q k^T / sqrt(d)) v of Vaswani et al. 2017; the paged layout of
 * Kwon et al. 2023 (vLLM). The torch path in attention.py is the oracle it is tested against.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* glibc's libmvec has a vector expf; declaring it lets the softmax loop vectorize without -fopenmp. */
__attribute__((simd("notinbranch"))) float expf(float);

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
} job_t;

/* The hot loops with head_dim and the cache type known at compile time (so they vectorize fully);
 * D = 0 means "any". Loops run over the blocks of the table (no division per key); each K and V row
 * is read once for all `group` query heads. */
#define DEFINE_ITEM(NAME, DCONST, T, LOAD)                                                                 \
static void NAME(const job_t *j, int64_t item, float *scores) {                                           \
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size;                                   \
    const int64_t D = DCONST ? DCONST : j->head_dim;                                                       \
    const int64_t s = item / H, h = item % H, row = H * D;                                                 \
    const int64_t len = j->seq_lens[s], num_blocks = (len + BS - 1) / BS;                                  \
    const int64_t *table = j->block_tables + s * j->max_blocks;                                            \
    const float *restrict q = j->q + (s * H + h) * G * D;                                                  \
    float *restrict o = j->out + (s * H + h) * G * D;                                                      \
    const T *kc = (const T *)j->k_cache, *vc = (const T *)j->v_cache;                                      \
    for (int64_t b = 0; b < num_blocks; b++) {                                                             \
        const T *restrict kb = kc + table[b] * BS * row + h * D;                                           \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const T *restrict k = kb + i * row;                                                            \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float *restrict qg = q + g * D;                                                      \
                float acc = 0.f;                                                                           \
                for (int64_t d = 0; d < D; d++) acc += qg[d] * LOAD(k[d]);                                 \
                scores[g * len + b * BS + i] = acc * j->scale;                                             \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < G; g++) {                                                                      \
        float *restrict sc = scores + g * len;                                                             \
        float m = -INFINITY, sum = 0.f;                                                                    \
        for (int64_t t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;                                       \
        _Pragma("omp simd reduction(+:sum)")                                                               \
        for (int64_t t = 0; t < len; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }                       \
        const float inv = 1.f / sum;                                                                       \
        for (int64_t t = 0; t < len; t++) sc[t] *= inv;                                                    \
    }                                                                                                      \
    memset(o, 0, sizeof(float) * (size_t)(G * D));                                                         \
    for (int64_t b = 0; b < num_blocks; b++) {                                                             \
        const T *restrict vb = vc + table[b] * BS * row + h * D;                                           \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const T *restrict v = vb + i * row;                                                            \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float p = scores[g * len + b * BS + i];                                              \
                float *restrict og = o + g * D;                                                            \
                for (int64_t d = 0; d < D; d++) og[d] += p * LOAD(v[d]);                                   \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_widen(x)
DEFINE_ITEM(item_f32_d64, 64, float, LOAD_F32)
DEFINE_ITEM(item_f32_d128, 128, float, LOAD_F32)
DEFINE_ITEM(item_f32_any, 0, float, LOAD_F32)
DEFINE_ITEM(item_bf16_d64, 64, uint16_t, LOAD_BF16)
DEFINE_ITEM(item_bf16_d128, 128, uint16_t, LOAD_BF16)
DEFINE_ITEM(item_bf16_any, 0, uint16_t, LOAD_BF16)

/* kv_bf16: 0 = float32 caches, 1 = bfloat16 caches. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t items = num_seqs * num_kv_heads;
    const job_t j = {q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_kv_heads, group,
                     head_dim, block_size, max_blocks, scale};
    int nt = num_threads > 0 ? (int)num_threads : 1;
    if (nt > items) nt = (int)items;
    const size_t per_thread = (size_t)(group * max_len + 1);
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)nt);
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t item = 0; item < items; item++) {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
        if (kv_bf16) {
            if (head_dim == 64) item_bf16_d64(&j, item, scores);
            else if (head_dim == 128) item_bf16_d128(&j, item, scores);
            else item_bf16_any(&j, item, scores);
        } else {
            if (head_dim == 64) item_f32_d64(&j, item, scores);
            else if (head_dim == 128) item_f32_d128(&j, item, scores);
            else item_f32_any(&j, item, scores);
        }
    }
    free(scratch);
    return 0;
}
