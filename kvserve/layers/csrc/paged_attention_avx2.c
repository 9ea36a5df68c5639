/* Paged decode attention, AVX2 + FMA path (hosts without AVX-512) for head_dim a multiple of 64: the same
 * contract and math as `paged_decode_attention` (paged_attention.c, which calls it), float32 accumulation,
 * float32 or bfloat16 caches widened in registers. The scalar loops there are its reference in the tests.
 *
 * Items: whole sequences (every KV head; each block's rows are read whole, and stay in L1 across the heads)
 * when there are WHOLE_ROW_MIN_SEQS_PER_THREAD sequences or more per thread, else partitions of a sequence's
 * blocks (every KV head), merged afterwards, so that a few sequences still spread over the threads (see
 * decode_attention_avx2). Per item, block by block:
 *   scores: per KV head, query head of its group and 64-wide chunk of D, q's chunk held in 8 vectors; 4 keys
 *           at a time accumulate 4 vectors whose horizontal sums come out of one hadd tree (the scalar loop pays
 *           a full reduction per key and head);
 *   softmax: vector max, libmvec exp, sum;
 *   out:    per query head and 64-wide chunk, 8 accumulator vectors in registers over the block's keys.
 * A bfloat16 cache is widened 16 values at a time without a shuffle (load16_eo: a shift gives the even ones, a
 * mask the odd ones), against queries deinterleaved the same way once per item; the output accumulates
 * deinterleaved and is put back in order at the end (as small_gemm's bf16 rows). Against widening 8 values with
 * a zero-extend and a shift: 0.77-0.84x the time with the blocks in L2, 0.89-1.03x (median ~0.93x) from memory
 * (Zen 3, 2 threads, 64 sequences x 400 keys, 30 layers).
 * The next block of the table is prefetched a row per key when it does not follow the current block in memory
 * (a block anywhere in the cache is where the hardware prefetchers lose the stream; prefetching blocks that do
 * follow measured slower). Zen 3, 2 threads, 64 sequences of 400 keys, SmolLM2's heads, 30 layers, against the
 * scalar loops: float32 cache 0.89-0.92x with every table in memory order, 0.96-1.07x with 80 % of the block
 * pairs adjacent (as in a served mixed workload), 1.3-1.4x scattered; bfloat16 cache 1.16-1.36x
 * (docs/performance-log.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_util.h"
#include "decode_job.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef AVX2_DECODE
#include <immintrin.h>

/* glibc's libmvec has a vector expf; declaring it lets the softmax loop vectorize without -fopenmp. */
__attribute__((simd("notinbranch"))) float expf(float);

/* 8 float32 values at base + off (elements) */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t off) {
    return _mm256_loadu_ps((const float *)base + off);
}

/* 16 bfloat16 values at base + off (elements) as two float32 vectors without a shuffle: the even elements
 * (0, 2, .., 14: each 32-bit lane's low half shifted up) and the odd ones (1, 3, .., 15: the lane's high half,
 * masked). Dot products pair them with a query deinterleaved the same way (deinterleave16); accumulated values
 * come out deinterleaved and are put back in order by interleave16. */
static inline __attribute__((always_inline)) void load16_eo(const void *base, int64_t off, __m256 *even, __m256 *odd) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* dst[16c + i] = src[16c + 2i], dst[16c + 8 + i] = src[16c + 2i + 1] for each group c of 16 (n a multiple of 16) */
static inline void deinterleave16(float *restrict dst, const float *restrict src, int64_t n) {
    for (int64_t c = 0; c < n; c += 16)
        for (int i = 0; i < 8; i++) {
            dst[c + i] = src[c + 2 * i];
            dst[c + 8 + i] = src[c + 2 * i + 1];
        }
}

/* the inverse of deinterleave16, in place */
static inline void interleave16(float *x, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        const __m256 e = _mm256_loadu_ps(x + c), o = _mm256_loadu_ps(x + c + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
        _mm256_storeu_ps(x + c, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(x + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

/* [sum a, sum b, sum c, sum d] */
static inline __attribute__((always_inline)) __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

/* Heads h0 .. h1-1 of sequence s over its keys [lo, hi) (lo a multiple of the block size); scores:
 * [(h1 - h0) * G, hi - lo] scratch. With ml NULL the keys are the whole sequence and the normalized output goes
 * to j->out; otherwise the unnormalized partial output goes to o_part [(h1 - h0) * G, D], the rows' score maxima
 * to ml[0 .. (h1-h0)G) and their sums of exp(score - max) to ml[(h1-h0)G ..), for merge_parts. */
static inline __attribute__((always_inline)) void item_avx2(const job_t *j, int64_t s, int64_t h0, int64_t h1,
                                                            int64_t lo, int64_t hi, float *scores, float *o_part,
                                                            float *ml, float *qd, int bf16) {
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size, D = j->head_dim;
    const int64_t row = H * D, esz = bf16 ? 2 : 4, rbytes = D * esz;
    const int64_t len = hi - lo, num_blocks = (len + BS - 1) / BS;
    const int64_t *table = j->block_tables + s * j->max_blocks + lo / BS;
    float *obase = ml ? o_part : j->out + (s * H + h0) * G * D;
    const char *kc = (const char *)j->k_cache, *vc = (const char *)j->v_cache;
    const __m128 sv = _mm_set1_ps(j->scale);
    if (bf16) deinterleave16(qd, j->q + (s * H + h0) * G * D, (h1 - h0) * G * D);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t kb = table[b] * BS * row + h * D; /* elements */
            /* the next block to read, unless it follows this one in memory (the hardware prefetchers have it) */
            const char *next = b + 1 < num_blocks ? (table[b + 1] == table[b] + 1 ? NULL
                                                     : kc + (table[b + 1] * BS * row + h * D) * esz)
                                                  : vc + (table[0] * BS * row + h * D) * esz;
            const float *q = bf16 ? qd + (h - h0) * G * D : j->q + (s * H + h) * G * D;
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
                        __m256 a0, a1, a2, a3;
                        if (bf16) {
                            a0 = a1 = a2 = a3 = _mm256_setzero_ps();
                            for (int c = 0; c < 8; c += 2) {
                                __m256 e, o;
                                load16_eo(kc, k0 + 8 * c, &e, &o);
                                a0 = _mm256_fmadd_ps(qv[c + 1], o, _mm256_fmadd_ps(qv[c], e, a0));
                                load16_eo(kc, k0 + row + 8 * c, &e, &o);
                                a1 = _mm256_fmadd_ps(qv[c + 1], o, _mm256_fmadd_ps(qv[c], e, a1));
                                load16_eo(kc, k0 + 2 * row + 8 * c, &e, &o);
                                a2 = _mm256_fmadd_ps(qv[c + 1], o, _mm256_fmadd_ps(qv[c], e, a2));
                                load16_eo(kc, k0 + 3 * row + 8 * c, &e, &o);
                                a3 = _mm256_fmadd_ps(qv[c + 1], o, _mm256_fmadd_ps(qv[c], e, a3));
                            }
                        } else {
                            a0 = _mm256_mul_ps(qv[0], load8(kc, k0));
                            a1 = _mm256_mul_ps(qv[0], load8(kc, k0 + row));
                            a2 = _mm256_mul_ps(qv[0], load8(kc, k0 + 2 * row));
                            a3 = _mm256_mul_ps(qv[0], load8(kc, k0 + 3 * row));
                            for (int c = 1; c < 8; c++) {
                                a0 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 8 * c), a0);
                                a1 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + row + 8 * c), a1);
                                a2 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 2 * row + 8 * c), a2);
                                a3 = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 3 * row + 8 * c), a3);
                            }
                        }
                        _mm_storeu_ps(sc + i, _mm_add_ps(_mm_loadu_ps(sc + i), hsum4(a0, a1, a2, a3)));
                    }
                    for (; i < n; i++) {
                        if (pf) prefetch_row(next + i * row * esz, rbytes);
                        const int64_t k0 = kb + i * row + c0;
                        __m256 a = _mm256_setzero_ps();
                        if (bf16)
                            for (int c = 0; c < 8; c += 2) {
                                __m256 e, o;
                                load16_eo(kc, k0 + 8 * c, &e, &o);
                                a = _mm256_fmadd_ps(qv[c + 1], o, _mm256_fmadd_ps(qv[c], e, a));
                            }
                        else
                            for (int c = 0; c < 8; c++) a = _mm256_fmadd_ps(qv[c], load8(kc, k0 + 8 * c), a);
                        sc[i] += hsum8(a);
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
        if (ml) {
            ml[r] = m;
            ml[(h1 - h0) * G + r] = sum;
        } else {
            const float inv = 1.f / sum;
            for (int64_t u = 0; u < len; u++) sc[u] *= inv;
        }
    }
    memset(obase, 0, sizeof(float) * (size_t)((h1 - h0) * G * D));
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t vb = table[b] * BS * row + h * D;
            const char *next = b + 1 < num_blocks && table[b + 1] != table[b] + 1
                                   ? vc + (table[b + 1] * BS * row + h * D) * esz : NULL;
            for (int64_t g = 0; g < G; g++) {
                const float *p = scores + ((h - h0) * G + g) * len + b * BS;
                for (int64_t c0 = 0; c0 < D; c0 += 64) {
                    float *og = obase + ((h - h0) * G + g) * D + c0;
                    __m256 acc[8];
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(og + 8 * c);
                    const int pf = next != NULL && g == 0 && c0 == 0;
                    for (int64_t i = 0; i < n; i++) {
                        if (pf) prefetch_row(next + i * row * esz, rbytes);
                        const __m256 pv = _mm256_broadcast_ss(p + i);
                        const int64_t v0 = vb + i * row + c0;
                        if (bf16)
                            for (int c = 0; c < 8; c += 2) {
                                __m256 e, o;
                                load16_eo(vc, v0 + 8 * c, &e, &o);
                                acc[c] = _mm256_fmadd_ps(pv, e, acc[c]);
                                acc[c + 1] = _mm256_fmadd_ps(pv, o, acc[c + 1]);
                            }
                        else
                            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(pv, load8(vc, v0 + 8 * c), acc[c]);
                    }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(og + 8 * c, acc[c]);
                }
            }
        }
    }
    if (bf16) interleave16(obase, (h1 - h0) * G * D);
}

static void item_avx2_f32(const job_t *j, int64_t s, int64_t h0, int64_t h1, int64_t lo, int64_t hi, float *scores,
                          float *o_part, float *ml) {
    item_avx2(j, s, h0, h1, lo, hi, scores, o_part, ml, NULL, 0);
}
/* qd: [(h1 - h0) * G * D] scratch for the deinterleaved queries */
static void item_avx2_bf16(const job_t *j, int64_t s, int64_t h0, int64_t h1, int64_t lo, int64_t hi, float *scores,
                           float *o_part, float *ml, float *qd) {
    item_avx2(j, s, h0, h1, lo, hi, scores, o_part, ml, qd, 1);
}

/* out rows of sequence s from its n partitions (each [HG, D] unnormalized, then HG maxima, HG sums): exact, the
 * partial softmaxes rescaled to the common maximum (the flash-decoding merge). */
static void merge_parts(const job_t *j, int64_t s, const float *parts, int64_t n) {
    const int64_t HG = j->num_kv_heads * j->group, D = j->head_dim, per = HG * (D + 2);
    float *out = j->out + s * HG * D;
    for (int64_t x = 0; x < HG; x++) {
        float mm = -INFINITY, ll = 0.f;
        for (int64_t p = 0; p < n; p++) mm = parts[p * per + HG * D + x] > mm ? parts[p * per + HG * D + x] : mm;
        float *o = out + x * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t p = 0; p < n; p++) {
            const float *part = parts + p * per;
            const float w = expf(part[HG * D + x] - mm);
            ll += w * part[HG * D + HG + x];
            for (int64_t d = 0; d < D; d++) o[d] += w * part[x * D + d];
        }
        const float inv = 1.f / ll;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Items (see the top of the file): with WHOLE_ROW_MIN_SEQS_PER_THREAD sequences per thread or more (or one thread),
 * whole sequences; below, each sequence's keys are cut into partitions of whole blocks, every KV head per item,
 * about PART_ITEMS_PER_THREAD items per thread in all, the partitions merged by merge_parts. A partition reads
 * its blocks' rows whole, in the table's order, where a (sequence, KV head) item reads a head's 1/H of each
 * row: at batch 1 (SmolLM2's 3 KV heads, 2 threads) that split gave one thread 2 of the 3 items. */
#ifndef WHOLE_ROW_MIN_SEQS_PER_THREAD
#define WHOLE_ROW_MIN_SEQS_PER_THREAD 4
#endif
#ifndef PART_ITEMS_PER_THREAD
#define PART_ITEMS_PER_THREAD 2
#endif
int decode_attention_avx2(const job_t *j, int kv_bf16, int64_t max_len, int nt) {
    const int64_t B = j->num_seqs, H = j->num_kv_heads, HG = H * j->group, BS = j->block_size;
    const int64_t per_part = HG * (j->head_dim + 2);
    int64_t part = (max_len + BS - 1) / BS * BS; /* keys per item, whole blocks */
    if (nt > 1 && B < (int64_t)WHOLE_ROW_MIN_SEQS_PER_THREAD * nt) {
        int64_t total = 0;
        for (int64_t s = 0; s < B; s++) total += j->seq_lens[s];
        const int64_t want = (int64_t)PART_ITEMS_PER_THREAD * nt;
        const int64_t p = ((total + want - 1) / want + BS - 1) / BS * BS;
        part = p < part ? p : part;
    }
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first item of each sequence */
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < B; s++) first[s + 1] = first[s] + (j->seq_lens[s] + part - 1) / part;
    const int64_t items = first[B];
    int64_t *item_seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)items);
    if (nt > items) nt = (int)items;
    const size_t per_thread = (size_t)(HG * part + 8 + (kv_bf16 ? HG * j->head_dim : 0)); /* scores, then qd */
    const int split = items > B; /* some sequence has more than one partition */
    float *scratch = (float *)malloc(sizeof(float) * (per_thread * (size_t)nt + (split ? (size_t)(per_part * items) : 0)));
    if (scratch == NULL || item_seq == NULL) { free(first); free(item_seq); free(scratch); return -1; }
    for (int64_t s = 0; s < B; s++)
        for (int64_t i = first[s]; i < first[s + 1]; i++) item_seq[i] = s;
    float *parts = scratch + per_thread * (size_t)nt;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = item_seq[it], lo = (it - first[s]) * part;
            const int64_t hi = j->seq_lens[s] - lo < part ? j->seq_lens[s] : lo + part;
            float *o = first[s + 1] - first[s] > 1 ? parts + per_part * it : NULL, *ml = o ? o + HG * j->head_dim : NULL;
            if (kv_bf16) item_avx2_bf16(j, s, 0, H, lo, hi, scores, o, ml, scores + HG * part + 8);
            else item_avx2_f32(j, s, 0, H, lo, hi, scores, o, ml);
        }
        if (split) {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < B; s++)
                if (first[s + 1] - first[s] > 1) merge_parts(j, s, parts + per_part * first[s], first[s + 1] - first[s]);
        }
    }
    free(scratch);
    free(item_seq);
    free(first);
    return 0;
}
#endif
