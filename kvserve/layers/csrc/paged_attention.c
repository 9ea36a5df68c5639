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
 * AVX2 builds (no AVX-512) take paged_attention_avx2.c for head_dim a multiple of 64; the AVX-512 path is below.
 * Reference: the plain softmax(q k^T / sqrt(d)) v of Vaswani et al. 2017; the paged layout of
 * Kwon et al. 2023 (vLLM). The torch path in attention.py is the oracle it is tested against.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_util.h"
#include "bf16.h"
#include "decode_job.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* glibc's libmvec has a vector expf; declaring it lets the softmax loop vectorize without -fopenmp. */
__attribute__((simd("notinbranch"))) float expf(float);

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

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512 path for head_dim 64 and 128: several times the loops above.
 *
 * Work items are (sequence, partition of PART keys) with every KV head of the sequence, so each item reads
 * whole cache rows ([num_kv_heads * head_dim] per token: one contiguous run per block) instead of one head's
 * slice of every row: on the Zen 4 hosts scattered 128-byte slices read at a third of the bandwidth of the
 * same bytes in runs. Long sequences split into several partitions (flash-decoding's split-K, Dao et al.
 * 2023), which also spreads a batch of one over the threads; the partitions' partial softmax results are
 * merged exactly afterwards (m = max m_p, l = sum e^(m_p - m) l_p, o = sum e^(m_p - m) o_p / l).
 *
 * Per item, 16 keys (a tile) at a time:
 *   scores: for each (KV head, query head of its group), one accumulator vector per key (D/16 FMAs, or
 *           D/32 `vdpbf16ps` when q and K are both exactly bfloat16 -- products of bf16 values are exact
 *           in float32, so only the summation order differs), the 16 horizontal sums done together by a
 *           shuffle tree; the tile's K rows stay in L1 across the heads, the next tile's are prefetched;
 *   softmax: running max with the scores, then exp and sum over the partition (unnormalised);
 *   out:     per KV head and chunk of query heads, out[g] += p[g, t] * v_t with the accumulators in
 *            registers (chunk x D/16 <= 24 vectors).
 * Accumulation is float32 throughout, like the scalar path. */
#define KEY_TILE 16
#define PART 256 /* keys per partition (a multiple of KEY_TILE) */
#define MAX_HG 64 /* query heads per item handled by this path */

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t off, int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + off);
}

/* sc[i] = scale * q . k(t0 + i) for the n <= 16 keys of a tile, one query head (q: float32 [D], or its
 * bf16 pairs qh when dp); k rows at kc + offs[i] + hD (elements). Returns the tile's max. */
static inline __attribute__((always_inline)) __m512 qk_tile(const __m512 *qv, const void *qh_, const void *kc,
                                                            int kbf16, const int64_t *offs, int64_t hD, int n,
                                                            int DV, int dp, __m512 sv, float *sc) {
    __m512 acc[KEY_TILE];
    for (int i = 0; i < KEY_TILE; i++) acc[i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (dp) {
        const __m512bh *qh = (const __m512bh *)qh_;
        for (int i = 0; i < n; i++) {
            const uint16_t *k = (const uint16_t *)kc + offs[i] + hD;
            for (int v = 0; v < DV / 2; v++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qh[v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
        }
    } else
#endif
    {
        (void)qh_;
        for (int i = 0; i < n; i++)
            for (int v = 0; v < DV; v++) acc[i] = _mm512_fmadd_ps(qv[v], load16(kc, offs[i] + hD + 16 * v, kbf16), acc[i]);
    }
    const __m512 r = _mm512_mul_ps(reduce16(acc), sv);
    _mm512_mask_storeu_ps(sc, (__mmask16)((1u << n) - 1u), r);
    return r;
}

/* o[g] += sum_i p[g][i] * v(i) over the n keys of a tile for GC query heads; o: float32 [GC][D] (in/out),
 * p rows of stride ps. A bfloat16 V row is widened 32 values at a time by interleaving its 16-bit words
 * with zeros (`vpunpcklwd` / `vpunpckhwd`: one instruction per 16 values, where zero-extend + shift take
 * two): exact, but the 16 floats of each vector are a fixed permutation of the row's order, so with a bf16
 * cache o is kept in that order across the tiles and put back by v_lanes_natural after the last one. Each
 * output element gets the same products in the same order as the float32 path (bitwise equal results). */
static inline __attribute__((always_inline)) void pv_tile(const float *p, int64_t ps, const void *vc, int vbf16,
                                                          const int64_t *offs, int64_t hD, int n, int DV, int GC,
                                                          float *o, int64_t D) {
    __m512 acc[6][8];
    for (int g = 0; g < GC; g++)
        for (int v = 0; v < DV; v++) acc[g][v] = _mm512_loadu_ps(o + g * D + 16 * v);
    for (int i = 0; i < n; i++) {
        __m512 vv[8];
        if (vbf16) { /* 32 values per load, widened exactly in lane-permuted order (see v_lanes_natural) */
            for (int v = 0; v < DV; v += 2) {
                const __m512i raw = _mm512_loadu_si512((const uint16_t *)vc + offs[i] + hD + 16 * v);
                vv[v] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), raw));
                vv[v + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), raw));
            }
        } else {
            for (int v = 0; v < DV; v++) vv[v] = load16(vc, offs[i] + hD + 16 * v, 0);
        }
        for (int g = 0; g < GC; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * ps + i]);
            for (int v = 0; v < DV; v++) acc[g][v] = _mm512_fmadd_ps(pg, vv[v], acc[g][v]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int v = 0; v < DV; v++) _mm512_storeu_ps(o + g * D + 16 * v, acc[g][v]);
}

/* Undo pv_tile's bf16 lane order in place for rows of D floats: within each 32-value group, vector 2c holds
 * values 8L + r (r < 4) at lane 4L + r and vector 2c + 1 holds 8L + 4 + r there (L = 0..3: 128-bit lanes). */
static inline void v_lanes_natural(float *o, int64_t rows, int64_t D) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D; c += 32) {
            float *x = o + r * D + c;
            const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
            _mm512_storeu_ps(x, _mm512_permutex2var_ps(a, lo_idx, b));
            _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(a, hi_idx, b));
        }
}

#define PV(DVC, GCC) pv_tile(sc + (h * G + g0) * PART + t0, PART, j->v_cache, kbf16, offs + t0, h * D, n, DVC, GCC, \
                             o + (h * G + g0) * D, D)

/* Keys [k0, k0 + len) of sequence s, all heads: o [H*G][D] unnormalised output, m / l [H*G] max and sum.
 * Scratch: sc [H*G][PART] floats, offs [PART] int64. D = 16 * DV, DV 4 or 8 (compile-time). */
static inline __attribute__((always_inline)) void part_avx512(const job_t *j, int64_t s, int64_t k0, int64_t len,
                                                              float *o, float *m, float *l, float *sc, int64_t *offs,
                                                              int kbf16, int DV) {
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size, D = 16 * DV, row = H * D, HG = H * G;
    const int64_t *table = j->block_tables + s * j->max_blocks;
    const float *q = j->q + s * HG * D;
    for (int64_t t = 0, b = k0 / BS, i = k0 % BS; t < len; b++, i = 0) { /* one division per item */
        const int64_t base = table[b] * BS;
        for (; i < BS && t < len; i++, t++) offs[t] = (base + i) * row;
    }
    int dp = 0;
#if defined(__AVX512BF16__)
    __m512bh qh[MAX_HG][4];
    if (kbf16) { /* q exactly representable in bf16 (a bf16 model's activations are) */
        uint32_t low = 0;
        for (int64_t i = 0; i < HG * D; i++) { uint32_t u; memcpy(&u, q + i, 4); low |= u & 0xffffu; }
        dp = low == 0;
        if (dp)
            for (int64_t x = 0; x < HG; x++)
                for (int v = 0; v < DV / 2; v++)
                    qh[x][v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + x * D + 32 * v + 16), _mm512_loadu_ps(q + x * D + 32 * v));
    }
#else
    char qh[1][1];
#endif
    const __m512 sv = _mm512_set1_ps(j->scale);
    __m512 mx[MAX_HG];
    for (int64_t x = 0; x < HG; x++) mx[x] = _mm512_set1_ps(-INFINITY);
    const int64_t esz = kbf16 ? 2 : 4, lines = (row * esz + 63) / 64;
    for (int64_t t0 = 0; t0 < len; t0 += KEY_TILE) {
        const int n = len - t0 < KEY_TILE ? (int)(len - t0) : KEY_TILE;
        /* the next tile's K rows (after the last tile: the first V rows), prefetched a slice per head pass:
         * issued in one burst they fill the miss buffers and stall the pipeline (measured: a third of the
         * kernel's time in the prefetch loop) */
        const char *nb = t0 + KEY_TILE < len ? (const char *)j->k_cache : (const char *)j->v_cache;
        const int64_t n0 = t0 + KEY_TILE < len ? t0 + KEY_TILE : 0;
        const int64_t nn = len - n0 < KEY_TILE ? len - n0 : KEY_TILE, nlines = nn * lines;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        for (int64_t h = 0; h < H; h++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t x = h * G + g;
                for (int64_t c = x * nlines / HG; c < (x + 1) * nlines / HG; c++)
                    _mm_prefetch(nb + offs[n0 + c / lines] * esz + 64 * (c % lines), _MM_HINT_T0);
                __m512 qv[8];
                for (int v = 0; v < DV; v++) qv[v] = _mm512_loadu_ps(q + x * D + 16 * v);
                const __m512 r = qk_tile(qv, qh[dp ? x : 0], j->k_cache, kbf16, offs + t0, h * D, n, DV, dp, sv,
                                         sc + x * PART + t0);
                mx[x] = _mm512_mask_max_ps(mx[x], live, mx[x], r);
            }
    }
    for (int64_t x = 0; x < HG; x++) {
        float *restrict p = sc + x * PART;
        const float mm = _mm512_reduce_max_ps(mx[x]);
        float sum = 0.f;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t t = 0; t < len; t++) { p[t] = expf(p[t] - mm); sum += p[t]; }
        m[x] = mm;
        l[x] = sum;
    }
    memset(o, 0, sizeof(float) * (size_t)(HG * D));
    const int64_t gmax = DV == 4 ? 6 : 3;
    for (int64_t t0 = 0; t0 < len; t0 += KEY_TILE) {
        const int n = len - t0 < KEY_TILE ? (int)(len - t0) : KEY_TILE;
        const int64_t n0 = t0 + KEY_TILE, nn = len - n0 < KEY_TILE ? len - n0 : KEY_TILE;
        const int64_t nlines = nn > 0 ? nn * lines : 0;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t c = h * nlines / H; c < (h + 1) * nlines / H; c++) /* the next tile's V rows, a slice per head */
                _mm_prefetch((const char *)j->v_cache + offs[n0 + c / lines] * esz + 64 * (c % lines), _MM_HINT_T0);
            for (int64_t g0 = 0; g0 < G; g0 += gmax) {
                const int64_t gc = G - g0 < gmax ? G - g0 : gmax;
                if (DV == 4) {
                    switch (gc) {
                    case 1: PV(4, 1); break;
                    case 2: PV(4, 2); break;
                    case 3: PV(4, 3); break;
                    case 4: PV(4, 4); break;
                    case 5: PV(4, 5); break;
                    default: PV(4, 6); break;
                    }
                } else {
                    switch (gc) {
                    case 1: PV(8, 1); break;
                    case 2: PV(8, 2); break;
                    default: PV(8, 3); break;
                    }
                }
            }
        }
    }
    if (kbf16) v_lanes_natural(o, HG, D);
}

/* The AVX-512 entry (head_dim 64 or 128, num_kv_heads * group <= MAX_HG). Returns 0, or -1 on allocation failure. */
static int decode_attention_avx512(const job_t *j, int kv_bf16, int nthreads) {
    const int64_t B = j->num_seqs, HG = j->num_kv_heads * j->group, D = j->head_dim;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first item of each sequence */
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < B; s++) first[s + 1] = first[s] + (j->seq_lens[s] + PART - 1) / PART;
    const int64_t items = first[B];
    /* per item: o [HG][D], m [HG], l [HG]; per thread: sc [HG][PART] floats + offs [PART] int64 */
    const size_t per_item = (size_t)(HG * (D + 2)), per_thread = (size_t)(HG * PART + 2 * PART + 16);
    int nt = nthreads > items ? (int)items : nthreads;
    float *part = (float *)malloc(sizeof(float) * (per_item * (size_t)items + per_thread * (size_t)nt));
    int64_t *item_seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)items);
    if (part == NULL || item_seq == NULL) { free(first); free(part); free(item_seq); return -1; }
    for (int64_t s = 0; s < B; s++)
        for (int64_t i = first[s]; i < first[s + 1]; i++) item_seq[i] = s;
    float *thread_scratch = part + per_item * (size_t)items;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        float *sc = thread_scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *sc = thread_scratch;
#endif
        int64_t *offs = (int64_t *)(((uintptr_t)(sc + HG * PART) + 63) & ~(uintptr_t)63);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = item_seq[it], k0 = (it - first[s]) * PART;
            const int64_t len = j->seq_lens[s] - k0 < PART ? j->seq_lens[s] - k0 : PART;
            float *o = part + per_item * (size_t)it, *m = o + HG * D, *l = m + HG;
            if (D == 64) { if (kv_bf16) part_avx512(j, s, k0, len, o, m, l, sc, offs, 1, 4); else part_avx512(j, s, k0, len, o, m, l, sc, offs, 0, 4); }
            else { if (kv_bf16) part_avx512(j, s, k0, len, o, m, l, sc, offs, 1, 8); else part_avx512(j, s, k0, len, o, m, l, sc, offs, 0, 8); }
        }
        /* merge each sequence's partitions (exact: a rescaled sum of the partial softmaxes) */
#pragma omp for schedule(static)
        for (int64_t s = 0; s < B; s++) {
            float *out = j->out + s * HG * D;
            for (int64_t x = 0; x < HG; x++) {
                float mm = -INFINITY, ll = 0.f;
                for (int64_t it = first[s]; it < first[s + 1]; it++) {
                    const float mi = part[per_item * (size_t)it + HG * D + x];
                    mm = mi > mm ? mi : mm;
                }
                __m512 acc[8];
                for (int64_t v = 0; v < D / 16; v++) acc[v] = _mm512_setzero_ps();
                for (int64_t it = first[s]; it < first[s + 1]; it++) {
                    const float *o = part + per_item * (size_t)it;
                    const float w = expf(o[HG * D + x] - mm);
                    ll += w * o[HG * D + HG + x];
                    for (int64_t v = 0; v < D / 16; v++)
                        acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(o + x * D + 16 * v), acc[v]);
                }
                const __m512 inv = _mm512_set1_ps(1.f / ll);
                for (int64_t v = 0; v < D / 16; v++) _mm512_storeu_ps(out + x * D + 16 * v, _mm512_mul_ps(acc[v], inv));
            }
        }
    }
    free(part);
    free(item_seq);
    free(first);
    return 0;
}
#endif

/* kv_bf16: 0 = float32 caches, 1 = bfloat16 caches. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
    const job_t j = {q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_kv_heads, group,
                     head_dim, block_size, max_blocks, scale};
#if defined(__AVX512F__)
    if ((head_dim == 64 || head_dim == 128) && num_kv_heads * group <= MAX_HG)
        return decode_attention_avx512(&j, kv_bf16, num_threads > 0 ? (int)num_threads : 1);
#endif
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    int nt = num_threads > 0 ? (int)num_threads : 1;
#ifdef AVX2_DECODE
    if (head_dim % 64 == 0) return decode_attention_avx2(&j, kv_bf16, max_len, nt);
#endif
    const int64_t items = num_seqs * num_kv_heads;
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
