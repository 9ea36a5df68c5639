/* Paged decode attention, AVX2 + FMA path (hosts without AVX-512) for head_dim a multiple of 64: the same
 * contract and math as `paged_decode_attention` (paged_attention.c, which calls it), float32 accumulation,
 * float32 or bfloat16 caches widened in registers. The scalar loops there are its reference in the tests.
 *
 * Items: whole sequences (every KV head; each block's rows are read whole, and stay in L1 across the heads)
 * when there are WHOLE_ROW_MIN_SEQS_PER_THREAD sequences or more per thread, else (sequence, KV head) so that
 * a few sequences still spread over the threads. Per item, block by block:
 *   scores: per KV head, query head of its group and 64-wide chunk of D, q's chunk held in 8 vectors; 4 keys
 *           at a time accumulate 4 vectors whose horizontal sums come out of one hadd tree (the scalar loop pays
 *           a full reduction per key and head);
 *   softmax: vector max, libmvec exp, sum;
 *   out:    per query head and 64-wide chunk, 8 accumulator vectors in registers over the block's keys.
 * The next block of the table is prefetched a row per key when it does not follow the current block in memory
 * (a block anywhere in the cache is where the hardware prefetchers lose the stream; prefetching blocks that do
 * follow measured slower). Zen 3, 2 threads, 64 sequences of 400 keys, SmolLM2's heads, 30 layers, against the
 * scalar loops: float32 cache 0.89-0.92x with every table in memory order, 0.96-1.07x with 80 % of the block
 * pairs adjacent (as in a served mixed workload), 1.3-1.4x scattered; bfloat16 cache 1.16-1.36x
 * (docs/performance.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_job.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef AVX2_DECODE
#include <immintrin.h>

/* glibc's libmvec has a vector expf; declaring it lets the softmax loop vectorize without -fopenmp. */
__attribute__((simd("notinbranch"))) float expf(float);

static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t off, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

/* [sum a, sum b, sum c, sum d] */
static inline __attribute__((always_inline)) __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline __attribute__((always_inline)) float hsum1(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

/* Heads h0 .. h1-1 of sequence s; scores: [(h1 - h0) * G, len] scratch. */
static inline __attribute__((always_inline)) void item_avx2(const job_t *j, int64_t s, int64_t h0, int64_t h1,
                                                            float *scores, int bf16) {
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size, D = j->head_dim;
    const int64_t row = H * D, esz = bf16 ? 2 : 4, rbytes = D * esz;
    const int64_t len = j->seq_lens[s], num_blocks = (len + BS - 1) / BS;
    const int64_t *table = j->block_tables + s * j->max_blocks;
    const char *kc = (const char *)j->k_cache, *vc = (const char *)j->v_cache;
    const __m128 sv = _mm_set1_ps(j->scale);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t kb = table[b] * BS * row + h * D; /* elements */
            /* the next block to read, unless it follows this one in memory (the hardware prefetchers have it) */
            const char *next = b + 1 < num_blocks ? (table[b + 1] == table[b] + 1 ? NULL
                                                     : kc + (table[b + 1] * BS * row + h * D) * esz)
                                                  : vc + (table[0] * BS * row + h * D) * esz;
            const float *q = j->q + (s * H + h) * G * D;
            for (int64_t g = 0; g < G; g++) {
                float *sc = scores + ((h - h0) * G + g) * len + b * BS;
                for (int64_t i = 0; i < n; i++) sc[i] = 0.f;
                for (int64_t c0 = 0; c0 < D; c0 += 64) {
                    __m256 qv[8];
                    for (int c = 0; c < 8; c++) qv[c] = _mm256_loadu_ps(q + g * D + c0 + 8 * c);
                    const int pf = next != NULL && g == 0 && c0 == 0;
                    int64_t i = 0;
                    for (; i + 4 <= n; i += 4) {
                        if (pf)
                            for (int r = 0; r < 4; r++) prefetch_row(next + (i + r) * row * esz, rbytes);
                        const int64_t k0 = kb + i * row + c0;
                        __m256 a0 = _mm256_mul_ps(qv[0], load8(kc, k0, bf16));
                        __m256 a1 = _mm256_mul_ps(qv[0], load8(kc, k0 + row, bf16));
                        __m256 a2 = _mm256_mul_ps(qv[0], load8(kc, k0 + 2 * row, bf16));
                        __m256 a3 = _mm256_mul_ps(qv[0], load8(kc, k0 + 3 * row, bf16));
                        for (int c = 1; c < 8; c++) {
                            a0 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 8 * c, bf16), a0);
                            a1 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + row + 8 * c, bf16), a1);
                            a2 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 2 * row + 8 * c, bf16), a2);
                            a3 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 3 * row + 8 * c, bf16), a3);
                        }
                        _mm_storeu_ps(sc + i, _mm_add_ps(_mm_loadu_ps(sc + i), hsum4(a0, a1, a2, a3)));
                    }
                    for (; i < n; i++) {
                        if (pf) prefetch_row(next + i * row * esz, rbytes);
                        const int64_t k0 = kb + i * row + c0;
                        __m256 a = _mm256_mul_ps(qv[0], load8(kc, k0, bf16));
                        for (int c = 1; c < 8; c++) a = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 8 * c, bf16), a);
                        sc[i] += hsum1(a);
                    }
                }
                int64_t i = 0;
                for (; i + 4 <= n; i += 4) _mm_storeu_ps(sc + i, _mm_mul_ps(_mm_loadu_ps(sc + i), sv));
                for (; i < n; i++) sc[i] *= j->scale;
            }
        }
    }
    for (int64_t r = 0; r < (h1 - h0) * G; r++) {
        float *restrict sc = scores + r * len;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; t < len; t++) m = sc[t] > m ? sc[t] : m;
        float sum = 0.f;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t u = 0; u < len; u++) { sc[u] = expf(sc[u] - m); sum += sc[u]; }
        const float inv = 1.f / sum;
        for (int64_t u = 0; u < len; u++) sc[u] *= inv;
    }
    for (int64_t h = h0; h < h1; h++) memset(j->out + (s * H + h) * G * D, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t vb = table[b] * BS * row + h * D;
            const char *next = b + 1 < num_blocks && table[b + 1] != table[b] + 1
                                   ? vc + (table[b + 1] * BS * row + h * D) * esz : NULL;
            for (int64_t g = 0; g < G; g++) {
                const float *p = scores + ((h - h0) * G + g) * len + b * BS;
                for (int64_t c0 = 0; c0 < D; c0 += 64) {
                    float *og = j->out + ((s * H + h) * G + g) * D + c0;
                    __m256 acc[8];
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(og + 8 * c);
                    const int pf = next != NULL && g == 0 && c0 == 0;
                    for (int64_t i = 0; i < n; i++) {
                        if (pf) prefetch_row(next + i * row * esz, rbytes);
                        const __m256 pv = _mm256_broadcast_ss(p + i);
                        const int64_t v0 = vb + i * row + c0;
                        for (int c = 0; c < 8; c++)
                            acc[c] = _mm256_fmadd_ps(pv, load8(vc, v0 + 8 * c, bf16), acc[c]);
                    }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(og + 8 * c, acc[c]);
                }
            }
        }
    }
}

static void item_avx2_f32(const job_t *j, int64_t s, int64_t h0, int64_t h1, float *scores) {
    item_avx2(j, s, h0, h1, scores, 0);
}
static void item_avx2_bf16(const job_t *j, int64_t s, int64_t h0, int64_t h1, float *scores) {
    item_avx2(j, s, h0, h1, scores, 1);
}

/* The item split (see the top of the file); whole rows vs (sequence, head) items measured within noise at
 * batch 4-64 on Zen 3. */
#ifndef WHOLE_ROW_MIN_SEQS_PER_THREAD
#define WHOLE_ROW_MIN_SEQS_PER_THREAD 4
#endif
int decode_attention_avx2(const job_t *j, int kv_bf16, int64_t max_len, int nt) {
    const int whole = j->num_seqs >= (int64_t)WHOLE_ROW_MIN_SEQS_PER_THREAD * nt;
    const int64_t hp = whole ? j->num_kv_heads : 1, items = j->num_seqs * (j->num_kv_heads / hp);
    if (nt > items) nt = (int)items;
    const size_t per_thread = (size_t)(hp * j->group * max_len + 8);
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)nt);
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t item = 0; item < items; item++) {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
        const int64_t s = whole ? item : item / j->num_kv_heads, h0 = whole ? 0 : item % j->num_kv_heads;
        if (kv_bf16) item_avx2_bf16(j, s, h0, h0 + hp, scores);
        else item_avx2_f32(j, s, h0, h0 + hp, scores);
    }
    free(scratch);
    return 0;
}
#endif
