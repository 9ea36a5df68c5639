/* Paged decode attention over an 8-bit KV cache (kv8.h: int8 codes with a float16 scale per 16 channels, or
 * fp8 e4m3fn codes with a float32 scale per token and KV head), float32 queries and outputs: the 8-bit twin of
 * paged_attention.c, dequantizing in registers or L1.
 *
 *   q            [num_seqs, num_kv_heads, group, head_dim]    float32
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, kv8_row_bytes(head_dim, fmt)]   bytes: codes then
 *                scales, per row
 *   block_tables [num_seqs, max_blocks] int64;  seq_lens [num_seqs] int64 (keys 0 .. seq_len-1 are attended)
 *   out          [num_seqs, num_kv_heads, group, head_dim]    float32
 *
 * fp8: the row's scale factors out of the dot products: s_t = scale * k_scale_t * (q . code_t), and
 * out = sum_t (p_t * v_scale_t) * code_t, so the inner loops only widen codes to float32 and FMA.
 * int8: a scale per 16 channels does not factor out of a whole row's dot product, so the codes are
 * dequantized (code x its group's scale, exact in float32) before the dot products: a K row once per KV head
 * (into L1), serving the group's query heads; a V row per 16-lane vector in registers (AVX-512) or once per
 * KV head into L1 (portable).
 *
 * Two paths, as paged_attention.c:
 *  - portable (any head_dim, any ISA; -ffast-math lets GCC vectorize the loops): work items (sequence,
 *    KV head), two passes (scores with a stable softmax, then p.v);
 *  - AVX-512 (head_dim 64 or 128): work items (sequence, partition of PART keys) over all KV heads, so each
 *    item reads whole cache rows; 16-key tiles, the 16 dot products of a tile reduced together (reduce16),
 *    partitions merged exactly afterwards (flash-decoding's split-K, Dao et al. 2023).
 * The torch path of attention.py (dequantize the gathered blocks, SDPA) is the reference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_util.h"
#include "kv8.h"
#ifdef _OPENMP
#include <omp.h>
#endif

__attribute__((simd("notinbranch"))) float expf(float);

typedef struct {
    const float *q;
    const uint8_t *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
} job8_t;

/* Portable item (sequence s, KV head h); DCONST = 0: any head_dim. T: the code type, WIDEN: code -> float.
 * GROUPED (int8): each K / V row is dequantized into rowbuf [D] first (code x its group's scale), then used by
 * the group's query heads; else (fp8) the row's scale is factored out of the dot products. */
#define DEFINE_ITEM8(NAME, DCONST, T, WIDEN, GROUPED)                                                      \
static void NAME(const job8_t *j, int64_t item, float *scores, float *restrict rowbuf) {                  \
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size;                                   \
    const int64_t D = DCONST ? DCONST : j->head_dim, W = kv8_row_bytes(D, GROUPED ? KV8_INT8 : KV8_FP8);   \
    const int64_t s = item / H, h = item % H, row = H * W;                                                 \
    const int64_t len = j->seq_lens[s], num_blocks = (len + BS - 1) / BS;                                  \
    const int64_t *table = j->block_tables + s * j->max_blocks;                                            \
    const float *restrict q = j->q + (s * H + h) * G * D;                                                  \
    float *restrict o = j->out + (s * H + h) * G * D;                                                      \
    for (int64_t b = 0; b < num_blocks; b++) {                                                             \
        const uint8_t *kb = j->k_cache + table[b] * BS * row + h * W;                                      \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const T *restrict k = (const T *)(kb + i * row);                                               \
            float ks = j->scale;                                                                           \
            if (GROUPED) kv8_dequant_int8(rowbuf, (const int8_t *)k, D);                                   \
            else ks *= kv8_scale(k, D);                                                                    \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float *restrict qg = q + g * D;                                                      \
                float acc = 0.f;                                                                           \
                for (int64_t d = 0; d < D; d++) acc += qg[d] * (GROUPED ? rowbuf[d] : WIDEN(k[d]));        \
                scores[g * len + b * BS + i] = acc * ks;                                                   \
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
        const uint8_t *vb = j->v_cache + table[b] * BS * row + h * W;                                      \
        const int64_t n = len - b * BS < BS ? len - b * BS : BS;                                           \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const T *restrict v = (const T *)(vb + i * row);                                               \
            float vs = 1.f;                                                                                \
            if (GROUPED) kv8_dequant_int8(rowbuf, (const int8_t *)v, D);                                   \
            else vs = kv8_scale(v, D);                                                                     \
            for (int64_t g = 0; g < G; g++) {                                                              \
                const float p = scores[g * len + b * BS + i] * vs;                                         \
                float *restrict og = o + g * D;                                                            \
                for (int64_t d = 0; d < D; d++) og[d] += p * (GROUPED ? rowbuf[d] : WIDEN(v[d]));          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_ITEM8(item_int8_d64, 64, int8_t, int8_widen, 1)
DEFINE_ITEM8(item_int8_d128, 128, int8_t, int8_widen, 1)
DEFINE_ITEM8(item_int8_any, 0, int8_t, int8_widen, 1)
DEFINE_ITEM8(item_fp8_d64, 64, uint8_t, fp8_e4m3_widen, 0)
DEFINE_ITEM8(item_fp8_d128, 128, uint8_t, fp8_e4m3_widen, 0)
DEFINE_ITEM8(item_fp8_any, 0, uint8_t, fp8_e4m3_widen, 0)

static int decode_portable(const job8_t *j, int fmt, int nthreads) {
    int64_t max_len = 1;
    for (int64_t s = 0; s < j->num_seqs; s++) max_len = j->seq_lens[s] > max_len ? j->seq_lens[s] : max_len;
    const int64_t items = j->num_seqs * j->num_kv_heads, D = j->head_dim;
    int nt = nthreads > items ? (int)items : nthreads;
    if (nt < 1) nt = 1;
    /* per thread: scores [group][max_len], then a row buffer [D] (int8 rows dequantized), 16-float slots */
    const size_t rows_at = (size_t)(j->group * max_len + 16) / 16 * 16;
    const size_t per_thread = rows_at + (size_t)(D + 16) / 16 * 16;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)nt);
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t item = 0; item < items; item++) {
#ifdef _OPENMP
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *scores = scratch;
#endif
        float *rowbuf = scores + rows_at;
        if (fmt == KV8_INT8) {
            if (D == 64) item_int8_d64(j, item, scores, rowbuf);
            else if (D == 128) item_int8_d128(j, item, scores, rowbuf);
            else item_int8_any(j, item, scores, rowbuf);
        } else {
            if (D == 64) item_fp8_d64(j, item, scores, rowbuf);
            else if (D == 128) item_fp8_d128(j, item, scores, rowbuf);
            else item_fp8_any(j, item, scores, rowbuf);
        }
    }
    free(scratch);
    return 0;
}

#if defined(__AVX512F__)
#define KEY_TILE 16
#define PART 256  /* keys per partition (a multiple of KEY_TILE) */
#define MAX_HG 64 /* query heads per sequence handled by this path */

/* The DV (4 or 8) float16 scales of an int8 row (at p = row + D) widened into gs[0 .. DV-1]; reads exactly
 * the 2 DV scale bytes (the last row of a cache ends there). */
static inline __attribute__((always_inline)) void int8_scales16(const uint8_t *p, int DV, float *gs) {
    const __m128i h = DV == 4 ? _mm_loadl_epi64((const __m128i *)p) : _mm_loadu_si128((const __m128i *)p);
    _mm512_storeu_ps(gs, _mm512_cvtph_ps(_mm256_zextsi128_si256(h)));
}

/* Keys [k0, k0 + len) of sequence s, all heads: o [H*G][D] unnormalised output, m / l [H*G] max and sum.
 * Scratch: sc [H*G][PART] scores, kt [KEY_TILE][D] one head's K tile widened, offs [PART] int64 row
 * offsets. D = 16 * DV, DV 4 or 8, fp8: compile-time after inlining.
 * A tile's K codes of one head are widened once into kt (4-8 KiB, L1) and serve the head's `group` query
 * heads from there: widening them again per query head cost up to 1.5x the bf16 kernel's time (fp8, group
 * 6); V codes are widened in registers, once per key and chunk of 3 query heads. Each row's scales are read
 * with its codes, so the cache is streamed once. fp8: the row's scale goes into the tile's scale vector (K)
 * or into p (V). int8: one float16 scale per 16-lane vector, multiplied into the widened codes (K: as they
 * are stored to kt; V: in registers), so kt holds dequantized values and p stays unscaled. */
static inline __attribute__((always_inline)) void part_kv8(const job8_t *j, int64_t s, int64_t k0, int64_t len,
                                                           float *o, float *m, float *l, float *sc, float *kt,
                                                           int64_t *offs, int fp8, int DV) {
    const int64_t G = j->group, H = j->num_kv_heads, BS = j->block_size, D = 16 * DV;
    const int64_t W = kv8_row_bytes(D, fp8 ? KV8_FP8 : KV8_INT8);
    const int64_t row = H * W, HG = H * G;
    const int64_t *table = j->block_tables + s * j->max_blocks;
    const float *q = j->q + s * HG * D;
    for (int64_t t = 0, b = k0 / BS, i = k0 % BS; t < len; b++, i = 0) {
        const int64_t base = table[b] * BS;
        for (; i < BS && t < len; i++, t++) offs[t] = (base + i) * row;
    }
    __m512 mx[MAX_HG];
    for (int64_t x = 0; x < HG; x++) mx[x] = _mm512_set1_ps(-INFINITY);
    const int64_t lines = (row + 63) / 64;
    for (int64_t t0 = 0; t0 < len; t0 += KEY_TILE) {
        const int n = len - t0 < KEY_TILE ? (int)(len - t0) : KEY_TILE;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        /* the next tile's K rows (after the last tile: the first V rows), a slice per head pass */
        const uint8_t *nb = t0 + KEY_TILE < len ? j->k_cache : j->v_cache;
        const int64_t n0 = t0 + KEY_TILE < len ? t0 + KEY_TILE : 0;
        const int64_t nn = len - n0 < KEY_TILE ? len - n0 : KEY_TILE, nlines = nn * lines;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t c = h * nlines / H; c < (h + 1) * nlines / H; c++)
                _mm_prefetch((const char *)nb + offs[n0 + c / lines] + 64 * (c % lines), _MM_HINT_T0);
            float ksc[KEY_TILE];
            for (int i = 0; i < n; i++) {
                const uint8_t *k = j->k_cache + offs[t0 + i] + h * W;
                if (fp8) {
                    ksc[i] = kv8_scale(k, D) * KV8_FP8_UNIT * j->scale;
                    for (int v = 0; v < DV; v++) _mm512_store_ps(kt + i * D + 16 * v, kv8_load16_fp8(k + 16 * v));
                } else {
                    float gs[16];
                    int8_scales16(k + D, DV, gs);
                    for (int v = 0; v < DV; v++)
                        _mm512_store_ps(kt + i * D + 16 * v, _mm512_mul_ps(kv8_load16_int8(k + 16 * v),
                                                                           _mm512_set1_ps(gs[v])));
                }
            }
            const __m512 kscale = fp8 ? _mm512_maskz_loadu_ps(live, ksc) : _mm512_set1_ps(j->scale);
            for (int64_t g = 0; g < G; g++) {
                const int64_t x = h * G + g;
                __m512 qv[8], acc[KEY_TILE];
                for (int v = 0; v < DV; v++) qv[v] = _mm512_loadu_ps(q + x * D + 16 * v);
                for (int i = 0; i < KEY_TILE; i++) acc[i] = _mm512_setzero_ps();
                for (int i = 0; i < n; i++)
                    for (int v = 0; v < DV; v++) acc[i] = _mm512_fmadd_ps(qv[v], _mm512_load_ps(kt + i * D + 16 * v), acc[i]);
                const __m512 r = _mm512_mul_ps(reduce16(acc), kscale);
                _mm512_mask_storeu_ps(sc + x * PART + t0, live, r);
                mx[x] = _mm512_mask_max_ps(mx[x], live, mx[x], r);
            }
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
    for (int64_t t0 = 0; t0 < len; t0 += KEY_TILE) {
        const int n = len - t0 < KEY_TILE ? (int)(len - t0) : KEY_TILE;
        const int64_t n0 = t0 + KEY_TILE, nn = len - n0 < KEY_TILE ? len - n0 : KEY_TILE;
        const int64_t nlines = nn > 0 ? nn * lines : 0;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t c = h * nlines / H; c < (h + 1) * nlines / H; c++)
                _mm_prefetch((const char *)j->v_cache + offs[n0 + c / lines] + 64 * (c % lines), _MM_HINT_T0);
            /* o[g] += p'[g][i] * code(v_i) for the group's heads, 3 at a time (3 x 8 accumulators at D 128) */
            for (int64_t g0 = 0; g0 < G; g0 += 3) {
                const int64_t gc = G - g0 < 3 ? G - g0 : 3;
                __m512 acc[3][8];
                float *og = o + (h * G + g0) * D;
                for (int64_t g = 0; g < gc; g++)
                    for (int v = 0; v < DV; v++) acc[g][v] = _mm512_loadu_ps(og + g * D + 16 * v);
                for (int i = 0; i < n; i++) {
                    const uint8_t *vr = j->v_cache + offs[t0 + i] + h * W;
                    float vsi = 1.f;
                    __m512 vv[8];
                    if (fp8) {
                        vsi = kv8_scale(vr, D) * KV8_FP8_UNIT;
                        for (int v = 0; v < DV; v++) vv[v] = kv8_load16_fp8(vr + 16 * v);
                    } else {
                        float gs[16];
                        int8_scales16(vr + D, DV, gs);
                        for (int v = 0; v < DV; v++)
                            vv[v] = _mm512_mul_ps(kv8_load16_int8(vr + 16 * v), _mm512_set1_ps(gs[v]));
                    }
                    for (int64_t g = 0; g < gc; g++) {
                        const __m512 pg = _mm512_set1_ps(sc[(h * G + g0 + g) * PART + t0 + i] * vsi);
                        for (int v = 0; v < DV; v++) acc[g][v] = _mm512_fmadd_ps(pg, vv[v], acc[g][v]);
                    }
                }
                for (int64_t g = 0; g < gc; g++)
                    for (int v = 0; v < DV; v++) _mm512_storeu_ps(og + g * D + 16 * v, acc[g][v]);
            }
        }
    }
}

static int decode_avx512(const job8_t *j, int fmt, int nthreads) {
    const int64_t B = j->num_seqs, H = j->num_kv_heads, HG = H * j->group, D = j->head_dim;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first item of each sequence */
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < B; s++) first[s + 1] = first[s] + (j->seq_lens[s] + PART - 1) / PART;
    const int64_t items = first[B];
    /* per item: o [HG][D], m [HG], l [HG]; per thread: sc [HG][PART], kt [KEY_TILE][D] floats, offs [PART]
     * int64 (and slack to align kt and offs to 64 bytes) */
    const size_t per_item = (size_t)(HG * (D + 2));
    const size_t per_thread = (size_t)(HG * PART + KEY_TILE * D + 2 * PART + 48);
    int nt = nthreads > items ? (int)items : nthreads;
    if (nt < 1) nt = 1;
    float *part = (float *)malloc(sizeof(float) * (per_item * (size_t)items + per_thread * (size_t)nt));
    int64_t *item_seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)(items > 0 ? items : 1));
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
        float *kt = (float *)(((uintptr_t)(sc + HG * PART) + 63) & ~(uintptr_t)63);
        int64_t *offs = (int64_t *)(((uintptr_t)(kt + KEY_TILE * D) + 63) & ~(uintptr_t)63);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = item_seq[it], k0 = (it - first[s]) * PART;
            const int64_t len = j->seq_lens[s] - k0 < PART ? j->seq_lens[s] - k0 : PART;
            float *o = part + per_item * (size_t)it, *m = o + HG * D, *l = m + HG;
            const int fp8 = fmt == KV8_FP8;
            if (D == 64) { if (fp8) part_kv8(j, s, k0, len, o, m, l, sc, kt, offs, 1, 4); else part_kv8(j, s, k0, len, o, m, l, sc, kt, offs, 0, 4); }
            else { if (fp8) part_kv8(j, s, k0, len, o, m, l, sc, kt, offs, 1, 8); else part_kv8(j, s, k0, len, o, m, l, sc, kt, offs, 0, 8); }
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

/* Bits of the 8-bit attention variants compiled in: 1 = decode, 2 = prefill (prefill_attention.c takes
 * kv_fmt 2 / 3), 4 = the AVX-512 decode path (head_dim 64 / 128). */
int kv8_attention_features(void) {
#if defined(__AVX512F__)
    return 1 | 2 | 4;
#else
    return 1 | 2;
#endif
}

/* kv_fmt: KV8_INT8 (2) or KV8_FP8 (3). Returns 0; -1 when scratch memory could not be allocated; -2 for an
 * unknown format or a non-positive size. */
int paged_decode_attention_kv8(const float *q, const void *k_cache, const void *v_cache, int kv_fmt,
                               const int64_t *block_tables, const int64_t *seq_lens, float *out,
                               int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
    if ((kv_fmt != KV8_INT8 && kv_fmt != KV8_FP8) || num_kv_heads < 1 || group < 1 || head_dim < 1 || block_size < 1)
        return -2;
    if (num_seqs < 1) return 0;
    const job8_t j = {q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, block_tables, seq_lens, out,
                      num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks, scale};
    const int nt = num_threads > 0 ? (int)num_threads : 1;
#if defined(__AVX512F__)
    if ((head_dim == 64 || head_dim == 128) && num_kv_heads * group <= MAX_HG)
        return decode_avx512(&j, kv_fmt, nt);
#endif
    return decode_portable(&j, kv_fmt, nt);
}
