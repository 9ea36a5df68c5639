/* Paged decode attention for CPU (float32): one query token per request, keys and values read in place
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
 * Work items (sequence, KV head) are split over `num_threads` POSIX threads.
 * Reference: the plain softmax(q k^T / sqrt(d)) v of Vaswani et al. 2017; the paged layout of
 * Kwon et al. 2023 (vLLM). The torch path in attention.py is the oracle it is tested against.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's libmvec has a vector expf; declaring it lets the softmax loop vectorize without -fopenmp. */
__attribute__((simd("notinbranch"))) float expf(float);

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
    int64_t item_begin, item_end;
    int64_t max_seq_len;
} job_t;

/* The hot loops with head_dim known at compile time (so they vectorize fully); D = 0 means "any".
 * Loops run over the blocks of the table (no division per key); each K and V row is read once for all
 * `group` query heads. */
#define DEFINE_ITEM(NAME, DCONST)                                                                          \
static void NAME(const job_t *j, int64_t item, float *scores) {                                           \
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size;                                   \
    const int64_t D = DCONST ? DCONST : j->head_dim;                                                       \
    const int64_t s = item / H, h = item % H, row = H * D;                                                 \
    const int64_t len = j->seq_lens[s], num_blocks = (len + BS - 1) / BS;                                  \
    const int64_t *table = j->block_tables + s * j->max_blocks;                                            \
    const float *restrict q = j->q + (s * H + h) * G * D;                                                  \
    float *restrict o = j->out + (s * H + h) * G * D;                                                      \
    for (int64_t b = 0; b < num_blocks; b++) {                                                             \
        const float *restrict kb = j->k_cache + table[b] * BS * row + h * D;                               \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const float *restrict k = kb + i * row;                                                        \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float *restrict qg = q + g * D;                                                      \
                float acc = 0.f;                                                                           \
                for (int64_t d = 0; d < D; d++) acc += qg[d] * k[d];                                       \
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
        const float *restrict vb = j->v_cache + table[b] * BS * row + h * D;                               \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const float *restrict v = vb + i * row;                                                        \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float p = scores[g * len + b * BS + i];                                              \
                float *restrict og = o + g * D;                                                            \
                for (int64_t d = 0; d < D; d++) og[d] += p * v[d];                                         \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_ITEM(item_d64, 64)
DEFINE_ITEM(item_d128, 128)
DEFINE_ITEM(item_any, 0)

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(j->group * j->max_seq_len + 1));
    for (int64_t item = j->item_begin; item < j->item_end; item++) {
        if (j->head_dim == 64) item_d64(j, item, scores);
        else if (j->head_dim == 128) item_d128(j, item, scores);
        else item_any(j, item, scores);
    }
    free(scores);
    return NULL;
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, const int64_t *seq_lens, float *out,
                               int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const int64_t items = num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = items;
    if (num_threads > 64) num_threads = 64;
    job_t jobs[64];
    pthread_t threads[64];
    for (int64_t i = 0; i < num_threads; i++) {
        job_t j = {q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_kv_heads, group, head_dim,
                   block_size, max_blocks, scale, items * i / num_threads, items * (i + 1) / num_threads, max_len};
        jobs[i] = j;
    }
    for (int64_t i = 1; i < num_threads; i++)
        if (pthread_create(&threads[i], NULL, run, &jobs[i]) != 0) return -1;
    run(&jobs[0]);
    for (int64_t i = 1; i < num_threads; i++) pthread_join(threads[i], NULL);
    return 0;
}
