/* Paged prefill attention for CPU: causal attention of a step's prefill chunks (fresh prompts and chunks
 * continuing a cached prefix) over K/V read in place from the paged cache, flash-attention style.
 *
 *   q            [num_tokens, num_heads, head_dim]   rows q_row_stride elements apart (float32 or bfloat16)
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (float32 or bfloat16), or 8-bit
 *                [num_blocks, block_size, num_kv_heads, kv8_row_bytes(head_dim, fmt)] bytes per row: int8 codes
 *                then a float16 scale per 16 channels, or fp8 e4m3fn codes then a float32 scale (kv8.h)
 *   block_tables [num_seqs, max_blocks] int64
 *   q_start, q_len, offsets [num_seqs] int64: sequence s owns q rows q_start[s] .. q_start[s] + q_len[s] - 1;
 *                its query i sits at position offsets[s] + i (offsets = tokens already in the cache before
 *                this chunk, 0 for a fresh prompt) and attends keys 0 .. offsets[s] + i
 *   out          [num_tokens, num_heads * head_dim], q's dtype (rows of other tokens are not touched)
 *
 * GQA: query head hq reads KV head hq / group. One work item is R query rows (48 with AVX-512, else 32) of
 * one KV head, a row being a (query position, query head) pair flattened as i * group + g, so each K/V
 * tile read serves all `group` heads. The item walks the keys in tiles of TK = 64, never past its last
 * row's diagonal, with the online softmax of Milakov & Gimelshein 2018 as FlashAttention (Dao et al. 2022)
 * uses it: per row a running max m, a running sum l and an unnormalised output o; per tile
 *     m' = max(m, max_j s_j);  p_j = exp(s_j - m');  l = l e^(m - m') + sum_j p_j;  o = o e^(m - m') + sum_j p_j v_j
 * and out = o / l at the end. The n x L score matrix never exists; a tile's scores stay in L1. Keys above
 * a row's diagonal get s = -inf (only the tiles that cross the diagonal are masked).
 *
 * Layout: SIMD lanes run over the item's query rows. Q is transposed once per item (q^T[d][r]); each key
 * element is broadcast against it (s^T[j][r] += k[j][d] q^T[d][r]) and each value element against the
 * probabilities (o^T[d][r] += v[j][d] p^T[j][r]). The softmax is then lane-wise (no horizontal
 * reductions) and only o^T is transposed back, once per item (16 x 16 blocks in registers with AVX-512).
 * A tile's K (and in the portable path V) rows are copied to a contiguous buffer first, and the next
 * tile's rows prefetched: reading the scattered cache rows in the inner loop stalled it on L1 misses.
 * Items are ordered costliest sequence first (balance), a sequence's items together (its K/V stay in
 * cache), and taken dynamically by OpenMP threads (torch's libgomp: one pool).
 *
 * Two implementations of the same item:
 *  - AVX512-BF16 (bf16 q and cache, head_dim a multiple of 32): s = q.k with vdpbf16ps on the bf16 inputs
 *    (products exact, float32 accumulation), softmax in float32, p rounded to bf16 and p.v with vdpbf16ps
 *    over pairs of keys (the V tile interleaved pairwise once per tile), float32 accumulation.
 *  - Portable (everything else; GCC vector extensions, so AVX-512, AVX2 or SSE2 by -march): float32 math,
 *    bf16 inputs widened exactly; 8-bit K/V rows dequantized (code x its group's or row's scale) as the tile
 *    is copied to L1, so the cache itself is read once, in its 8-bit form.
 * Both specialised for head_dim 64 and 128 at compile time; any head_dim runs through the generic variant.
 * exp is 2^x with x = (s - m) * scale * log2(e): x rounded to an integer n and a fraction f in [-1/2, 1/2],
 * 2^f by its degree-6 Taylor polynomial in f ln 2 (relative error < 2e-7), times 2^n.
 * The torch path of attention.py (SDPA) is the reference it is tested against.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kv8.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* Query rows per work item (a multiple of the vector width: 3 x 16 with AVX-512, where 32 registers hold
 * 8 keys x 48 rows of scores; 32 with AVX2 / SSE2's 16 registers) and keys per tile. Measured on Zen 4,
 * bf16, head_dim 64, one thread: (R, TK) = (32, 32) 140, (32, 64) 144, (48, 32) 148, (48, 64) 148-163 GFLOP/s. */
#ifndef R
#if defined(__AVX512F__)
#define R 48
#else
#define R 32
#endif
#endif
#ifndef TK
#define TK 64
#endif
#define LOG2E 1.4426950408889634f
#define EXP_MIN (-126.f) /* exponents are clamped here: 2^-126 * p is as good as 0 next to the row max (2^0) */

/* Taylor coefficients of 2^f = e^(f ln 2): (ln 2)^k / k! */
#define C1 0.6931471805599453f
#define C2 0.2402265069591007f
#define C3 0.0555041086648216f
#define C4 0.0096181291076285f
#define C5 0.0013333558146428f
#define C6 0.0001540353039338f

typedef struct {
    const void *q;
    int64_t q_row;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *q_start, *q_len, *offsets;
    void *out;
    int64_t max_blocks, num_kv_heads, group, head_dim, block_size;
    int64_t kv_head; /* elements of one (token, KV head) cache row: head_dim, or kv8_row_bytes (8-bit) */
    float scale;
    int q_bf16;
} job_t;

typedef struct {
    int64_t seq, head, row0, cost; /* cost: the whole sequence's (rows x keys), the sort's first key */
} item_t;

/* What one item needs to know about its rows: the count, each lane's key limit (offset + position; lanes
 * past the count copy the last row's), and the smallest and largest limits. */
typedef struct {
    int64_t nr, lim_min, lim_max, qs, offset;
    int32_t lim[R];
} rows_t;

static void item_rows(const job_t *j, const item_t *it, rows_t *rw) {
    const int64_t G = j->group, s = it->seq;
    const int64_t total = j->q_len[s] * G;
    rw->nr = total - it->row0 < R ? total - it->row0 : R;
    rw->qs = j->q_start[s];
    rw->offset = j->offsets[s];
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = it->row0 + (r < rw->nr ? r : rw->nr - 1);
        rw->lim[r] = (int32_t)(rw->offset + row / G);
    }
    rw->lim_min = rw->lim[0];
    rw->lim_max = rw->lim[R - 1];
}

/* Prefetch the K and V rows (row_bytes each) of a tile whose element indices are idx[0 .. nk). */
static inline void prefetch_tile(const char *kc, const char *vc, const int64_t *idx, int64_t nk, size_t esz,
                                 size_t row_bytes) {
    for (int64_t t = 0; t < nk; t++)
        for (size_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(kc + (size_t)idx[t] * esz + b);
            __builtin_prefetch(vc + (size_t)idx[t] * esz + b);
        }
}

/* Element indices of the keys of one tile, [k0, k0 + nk), padded to TK with the tile's first key. */
static inline void tile_keys(const job_t *j, const int64_t *table, int64_t k0, int64_t nk, int64_t h,
                             int64_t *idx) {
    const int64_t bs = j->block_size, row = j->num_kv_heads * j->kv_head;
    int64_t b = k0 / bs, slot = k0 % bs;
    int64_t base = table[b] * bs * row + h * j->kv_head;
    for (int64_t t = 0; t < nk; t++) {
        idx[t] = base + slot * row;
        if (++slot == bs && t + 1 < nk) {
            slot = 0;
            base = table[++b] * bs * row + h * j->kv_head;
        }
    }
    for (int64_t t = nk; t < TK; t++) idx[t] = idx[0];
}

/* qt[d][r] = q of the item's row r, dimension d, widened to float32 (0 for rows past the item's count). */
static void pack_q(const job_t *j, const item_t *it, const rows_t *rw, float *qt, int64_t D) {
    const int64_t G = j->group;
    for (int64_t r = 0; r < R; r++) {
        if (r >= rw->nr) {
            for (int64_t d = 0; d < D; d++) qt[d * R + r] = 0.f;
            continue;
        }
        const int64_t row = it->row0 + r;
        const int64_t off = (rw->qs + row / G) * j->q_row + (it->head * G + row % G) * D;
        if (j->q_bf16)
            for (int64_t d = 0; d < D; d++) qt[d * R + r] = bf16_widen(((const uint16_t *)j->q)[off + d]);
        else
            for (int64_t d = 0; d < D; d++) qt[d * R + r] = ((const float *)j->q)[off + d];
    }
}

#if defined(__AVX512F__)
/* In-register transpose of a 16 x 16 matrix of 32-bit elements: x[i][j] -> x[j][i] (64 shuffles: pairs
 * within 128-bit lanes, then quads, then 128-bit lanes across registers). */
static inline void transpose16(__m512 x[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[4g + c], lane L: rows 4g..4g+3 of column 4L + c */
        u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        x[c] = _mm512_shuffle_f32x4(x0, y0, 0x88), x[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        x[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88), x[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}
#endif

/* out[row][d] = ot[d][r] * inv_l[r] for the item's valid rows, in q's dtype. */
static void store_out(const job_t *j, const item_t *it, const rows_t *rw, const float *ot, const float *inv_l,
                      int64_t D) {
    const int64_t G = j->group, hq = j->num_kv_heads * G;
    int64_t off[R];
    for (int64_t r = 0; r < rw->nr; r++) {
        const int64_t row = it->row0 + r;
        off[r] = ((rw->qs + row / G) * hq + it->head * G + row % G) * D;
    }
#if defined(__AVX512F__)
    if (D % 16 == 0) { /* 16 x 16 blocks transposed in registers */
        for (int64_t r0 = 0; r0 < rw->nr; r0 += 16)
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                __m512 x[16];
                for (int i = 0; i < 16; i++) x[i] = _mm512_loadu_ps(ot + (d0 + i) * R + r0);
                transpose16(x);
                for (int64_t i = 0; i < 16 && r0 + i < rw->nr; i++) {
                    const __m512 y = _mm512_mul_ps(x[i], _mm512_set1_ps(inv_l[r0 + i]));
                    if (!j->q_bf16) {
                        _mm512_storeu_ps((float *)j->out + off[r0 + i] + d0, y);
                        continue;
                    }
                    uint16_t *o = (uint16_t *)j->out + off[r0 + i] + d0;
#if HAVE_DPBF16
                    _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(y));
#else
                    float tmp[16];
                    _mm512_storeu_ps(tmp, y);
                    for (int k = 0; k < 16; k++) o[k] = bf16_narrow(tmp[k]);
#endif
                }
            }
        return;
    }
#endif
    for (int64_t r = 0; r < rw->nr; r++) {
        if (j->q_bf16) {
            uint16_t *o = (uint16_t *)j->out + off[r];
            for (int64_t d = 0; d < D; d++) o[d] = bf16_narrow(ot[d * R + r] * inv_l[r]);
        } else {
            float *o = (float *)j->out + off[r];
            for (int64_t d = 0; d < D; d++) o[d] = ot[d * R + r] * inv_l[r];
        }
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* Portable item: GCC vector extensions, float32 math.                                                   */

#if defined(__AVX512F__)
#define VW 16
#define KB_ 8 /* keys per register block of the score loop */
#define DB_ 8 /* head dims per register block of the p.v loop */
#elif defined(__AVX__)
#define VW 8
#define KB_ 2
#define DB_ 2
#else
#define VW 4
#define KB_ 1
#define DB_ 1
#endif
#ifndef KB
#define KB KB_
#endif
#ifndef DB
#define DB DB_
#endif
#define RV (R / VW)
_Static_assert(R % VW == 0 && R % 16 == 0 && TK % KB == 0 && TK % 8 == 0 && TK % 2 == 0,
               "R: whole vectors and 16-row transpose blocks; TK: whole key blocks of both items");

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf vld(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vst(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }

/* 2^t for t <= 0 (clamped at EXP_MIN). Round-to-nearest by the 1.5 * 2^23 trick (no -ffast-math here). */
static inline vf vexp2(vf t) {
    t = vmax(t, vsplat(EXP_MIN));
    const vf n = (t + 12582912.f) - 12582912.f;
    const vf f = t - n;
    vf p = vsplat(C6);
    p = p * f + C5, p = p * f + C4, p = p * f + C3, p = p * f + C2, p = p * f + C1, p = p * f + 1.f;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}

/* One cache row (D elements at src) widened to float32 at dst: float32 / bfloat16 elements, or 8-bit codes
 * times their scale (int8: each group of 16 channels' float16 scale; fp8: the row's float32 scale). */
#define ROW_F32(dst, src, D) for (int64_t d = 0; d < (D); d++) (dst)[d] = (src)[d]
#define ROW_BF16(dst, src, D) for (int64_t d = 0; d < (D); d++) (dst)[d] = bf16_widen((src)[d])
#define ROW_INT8(dst, src, D) kv8_dequant_int8(dst, src, D)
#define ROW_FP8(dst, src, D)                                                                                 \
    do {                                                                                                    \
        const float s_ = kv8_scale(src, D);                                                                 \
        for (int64_t d = 0; d < (D); d++) (dst)[d] = fp8_table[(src)[d]] * s_;                              \
    } while (0)

/* e4m3fn code -> float32, all 256 (1 KiB, L1): a load per element beats the branch-free bit manipulation of
 * fp8_e4m3_widen in this copy loop (measured, a 1,000-token prompt, 1 thread: 3.9x -> 1.5x the time over a
 * bf16 cache). */
static float fp8_table[256];

__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int b = 0; b < 256; b++) fp8_table[b] = fp8_e4m3_widen((uint8_t)b);
}

/* scratch floats per thread of the portable item: qt, ot [D][R]; st [TK][R]; kt, vt [TK][D] */
#define PORTABLE_SCRATCH(D) ((size_t)(2 * (D) * R + TK * R + 2 * TK * (D)))

/* The K and V rows of a tile copied (widened) to kt, vt [TK][D]: the inner loops then read L1-resident,
 * contiguous float32 rows. The next tile's rows are prefetched meanwhile. */
#define DEFINE_PORTABLE(NAME, DCONST, T, ROW)                                                              \
static void NAME(const job_t *j, const item_t *it, float *scratch) {                                        \
    const int64_t D = DCONST ? DCONST : j->head_dim;                                                        \
    float *qt = scratch, *ot = qt + D * R, *st = ot + D * R, *kt = st + TK * R, *vt = kt + TK * D;          \
    const T *kc = (const T *)j->k_cache, *vc = (const T *)j->v_cache;                                      \
    const int64_t *table = j->block_tables + it->seq * j->max_blocks;                                      \
    rows_t rw;                                                                                              \
    item_rows(j, it, &rw);                                                                                  \
    pack_q(j, it, &rw, qt, D);                                                                              \
    memset(ot, 0, sizeof(float) * (size_t)(D * R));                                                        \
    vf m[RV], l[RV];                                                                                        \
    vi lim[RV];                                                                                             \
    for (int v = 0; v < RV; v++) {                                                                          \
        m[v] = vsplat(-INFINITY), l[v] = vsplat(0.f);                                                       \
        memcpy(&lim[v], rw.lim + v * VW, sizeof lim[v]);                                                    \
    }                                                                                                       \
    const float c = j->scale * LOG2E;                                                                       \
    int64_t kidx[2][TK];                                                                                    \
    tile_keys(j, table, 0, rw.lim_max + 1 < TK ? rw.lim_max + 1 : TK, it->head, kidx[0]);                  \
    for (int64_t k0 = 0, cur = 0; k0 <= rw.lim_max; k0 += TK, cur ^= 1) {                                   \
        const int64_t nk = rw.lim_max + 1 - k0 < TK ? rw.lim_max + 1 - k0 : TK;                             \
        const int64_t *idx = kidx[cur];                                                                     \
        const int64_t nkb = (nk + KB - 1) / KB * KB;                                                        \
        for (int64_t t = 0; t < nkb; t++)                                                                   \
            ROW(kt + t * D, kc + idx[t], D);                                                                \
        for (int64_t t = 0; t < nk; t++)                                                                    \
            ROW(vt + t * D, vc + idx[t], D);                                                                \
        if (k0 + TK <= rw.lim_max) {                                                                        \
            const int64_t nn = rw.lim_max + 1 - k0 - TK < TK ? rw.lim_max + 1 - k0 - TK : TK;               \
            tile_keys(j, table, k0 + TK, nn, it->head, kidx[cur ^ 1]);                                      \
            prefetch_tile((const char *)kc, (const char *)vc, kidx[cur ^ 1], nn, sizeof(T),                \
                          sizeof(T) * (size_t)j->kv_head);                                                  \
        }                                                                                                   \
        /* scores s^T[t][r] = k_t . q_r, KB keys x R rows per register block */                            \
        for (int64_t t0 = 0; t0 < nk; t0 += KB) {                                                          \
            vf acc[KB][RV];                                                                                 \
            for (int b = 0; b < KB; b++)                                                                    \
                for (int v = 0; v < RV; v++) acc[b][v] = vsplat(0.f);                                       \
            const float *kr = kt + t0 * D;                                                                  \
            for (int64_t d = 0; d < D; d++) {                                                               \
                vf qv[RV];                                                                                  \
                for (int v = 0; v < RV; v++) qv[v] = vld(qt + d * R + v * VW);                              \
                _Pragma("GCC unroll 8")                                                                     \
                for (int b = 0; b < KB; b++) {                                                              \
                    const float kv = kr[b * D + d];                                                         \
                    for (int v = 0; v < RV; v++) acc[b][v] += kv * qv[v];                                   \
                }                                                                                           \
            }                                                                                               \
            for (int b = 0; b < KB; b++)                                                                    \
                for (int v = 0; v < RV; v++) vst(st + (t0 + b) * R + v * VW, acc[b][v]);                   \
        }                                                                                                   \
        /* online softmax, lane-wise; keys above a row's diagonal get p = 0 */                              \
        const int masked = k0 + nk - 1 > rw.lim_min;                                                        \
        for (int v = 0; v < RV; v++) {                                                                      \
            vf mx = m[v];                                                                                   \
            for (int64_t t = 0; t < nk; t++) {                                                              \
                vf s = vld(st + t * R + v * VW);                                                            \
                if (masked) s = vsel(lim[v] >= (int32_t)(k0 + t), s, vsplat(-INFINITY));                   \
                mx = vmax(mx, s);                                                                           \
            }                                                                                               \
            const vf alpha = vexp2((m[v] - mx) * c), mc = mx * c;                                           \
            vf sum = vsplat(0.f);                                                                           \
            for (int64_t t = 0; t < nk; t++) {                                                              \
                vf p = vexp2(vld(st + t * R + v * VW) * c - mc);                                            \
                if (masked) p = (vf)((vi)p & (lim[v] >= (int32_t)(k0 + t)));                                \
                sum += p;                                                                                   \
                vst(st + t * R + v * VW, p);                                                                \
            }                                                                                               \
            l[v] = l[v] * alpha + sum, m[v] = mx;                                                           \
            for (int64_t d = 0; d < D; d++) vst(ot + d * R + v * VW, vld(ot + d * R + v * VW) * alpha);    \
        }                                                                                                   \
        /* o^T[d][r] += v_t[d] p^T[t][r], DB dims x R rows per register block */                            \
        int64_t d0 = 0;                                                                                     \
        for (; d0 + DB <= D; d0 += DB) {                                                                    \
            vf acc[DB][RV];                                                                                 \
            for (int b = 0; b < DB; b++)                                                                    \
                for (int v = 0; v < RV; v++) acc[b][v] = vld(ot + (d0 + b) * R + v * VW);                   \
            for (int64_t t = 0; t < nk; t++) {                                                              \
                vf pv[RV];                                                                                  \
                for (int v = 0; v < RV; v++) pv[v] = vld(st + t * R + v * VW);                              \
                const float *vr = vt + t * D + d0;                                                          \
                _Pragma("GCC unroll 8")                                                                     \
                for (int b = 0; b < DB; b++)                                                                \
                    for (int v = 0; v < RV; v++) acc[b][v] += vr[b] * pv[v];                                \
            }                                                                                               \
            for (int b = 0; b < DB; b++)                                                                    \
                for (int v = 0; v < RV; v++) vst(ot + (d0 + b) * R + v * VW, acc[b][v]);                   \
        }                                                                                                   \
        for (; d0 < D; d0++) {                                                                              \
            vf acc[RV];                                                                                     \
            for (int v = 0; v < RV; v++) acc[v] = vld(ot + d0 * R + v * VW);                                \
            for (int64_t t = 0; t < nk; t++)                                                                \
                for (int v = 0; v < RV; v++) acc[v] += vt[t * D + d0] * vld(st + t * R + v * VW);           \
            for (int v = 0; v < RV; v++) vst(ot + d0 * R + v * VW, acc[v]);                                 \
        }                                                                                                   \
    }                                                                                                       \
    float inv_l[R];                                                                                         \
    for (int v = 0; v < RV; v++) vst(inv_l + v * VW, 1.f / l[v]);                                          \
    store_out(j, it, &rw, ot, inv_l, D);                                                                    \
}

DEFINE_PORTABLE(portable_f32_d64, 64, float, ROW_F32)
DEFINE_PORTABLE(portable_f32_d128, 128, float, ROW_F32)
DEFINE_PORTABLE(portable_f32_any, 0, float, ROW_F32)
DEFINE_PORTABLE(portable_bf16_d64, 64, uint16_t, ROW_BF16)
DEFINE_PORTABLE(portable_bf16_d128, 128, uint16_t, ROW_BF16)
DEFINE_PORTABLE(portable_bf16_any, 0, uint16_t, ROW_BF16)
DEFINE_PORTABLE(portable_int8_d64, 64, int8_t, ROW_INT8)
DEFINE_PORTABLE(portable_int8_d128, 128, int8_t, ROW_INT8)
DEFINE_PORTABLE(portable_int8_any, 0, int8_t, ROW_INT8)
DEFINE_PORTABLE(portable_fp8_d64, 64, uint8_t, ROW_FP8)
DEFINE_PORTABLE(portable_fp8_d128, 128, uint8_t, ROW_FP8)
DEFINE_PORTABLE(portable_fp8_any, 0, uint8_t, ROW_FP8)

/* ---------------------------------------------------------------------------------------------------- */
/* AVX512-BF16 item: bf16 q and cache, head_dim a multiple of 32.                                       */

#if HAVE_DPBF16
#define RV16 (R / 16)
#define EXP_MIN_512 (-200.f) /* scalef by 2^-200 underflows to exactly 0: a masked score (-inf) gives p = 0 */

static inline __m512 exp2_512(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(EXP_MIN_512));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512i bcast_pair(const uint16_t *p) { /* two adjacent bf16 values into every 32-bit lane */
    int32_t x;
    memcpy(&x, p, 4);
    return _mm512_set1_epi32(x);
}

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* scratch bytes per thread of the bf16 item: qp [D/2][R] u32, st [TK][R] f32, pp [TK/2][R] u32,
 * vp [TK/2][D] u32, ot [D][R] f32, kt [TK][D] bf16 */
#define BF16_SCRATCH(D) ((size_t)4 * (size_t)((D) / 2 * R + TK * R + TK / 2 * R + TK / 2 * (D) + (D) * R + TK * (D) / 2))

/* Per tile: K rows copied to kt (contiguous, L1) and the next tile's rows prefetched; scores s^T = K q^T
 * with the diagonal mask and the row max applied as they leave the registers; V interleaved by pairs of
 * keys; p = 2^(s c - m c) packed to bf16 pairs; o^T = o^T alpha + V^T p^T. */
#define DEFINE_DPBF16(NAME, DCONST)                                                                         \
static void NAME(const job_t *j, const item_t *it, float *scratch) {                                        \
    const int64_t D = DCONST ? DCONST : j->head_dim;                                                        \
    uint32_t *qp = (uint32_t *)scratch;                                                                     \
    float *st = (float *)(qp + D / 2 * R);                                                                  \
    uint32_t *pp = (uint32_t *)(st + TK * R);                                                               \
    uint32_t *vp = pp + TK / 2 * R;                                                                         \
    float *ot = (float *)(vp + TK / 2 * D);                                                                 \
    uint16_t *kt = (uint16_t *)(ot + D * R);                                                                \
    const uint16_t *kc = (const uint16_t *)j->k_cache, *vc = (const uint16_t *)j->v_cache;                 \
    const int64_t *table = j->block_tables + it->seq * j->max_blocks;                                      \
    rows_t rw;                                                                                              \
    item_rows(j, it, &rw);                                                                                  \
    /* q pairs, transposed: qp[d/2][r] = (q[r][d], q[r][d+1]), 16 rows x 16 pairs per in-register block */ \
    const int64_t G = j->group;                                                                             \
    const uint16_t *qrow[R];                                                                                \
    for (int64_t r = 0; r < rw.nr; r++) {                                                                   \
        const int64_t row = it->row0 + r;                                                                   \
        qrow[r] = (const uint16_t *)j->q + (rw.qs + row / G) * j->q_row + (it->head * G + row % G) * D;     \
    }                                                                                                       \
    for (int64_t r0 = 0; r0 < R; r0 += 16)                                                                  \
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {                                                        \
            __m512 x[16];                                                                                   \
            for (int i = 0; i < 16; i++)                                                                    \
                x[i] = r0 + i < rw.nr ? _mm512_loadu_ps((const float *)(qrow[r0 + i] + 2 * p0))             \
                                      : _mm512_setzero_ps();                                                \
            transpose16(x);                                                                                 \
            for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(qp + (p0 + i) * R + r0), x[i]);         \
        }                                                                                                   \
    memset(ot, 0, sizeof(float) * (size_t)(D * R));                                                        \
    __m512 m[RV16], l[RV16];                                                                                \
    __m512i lim[RV16];                                                                                      \
    for (int v = 0; v < RV16; v++) {                                                                        \
        m[v] = _mm512_set1_ps(-INFINITY), l[v] = _mm512_setzero_ps();                                       \
        lim[v] = _mm512_loadu_si512(rw.lim + 16 * v);                                                       \
    }                                                                                                       \
    const __m512 c = _mm512_set1_ps(j->scale * LOG2E), ninf = _mm512_set1_ps(-INFINITY);                    \
    /* pair interleaves: p of keys t, t+1 (cvtne2ps puts t in the low half) and rows of V */               \
    const __m512i pidx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,     \
                                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);          \
    const __m512i vlo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,      \
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);           \
    const __m512i vhi = _mm512_add_epi16(vlo, _mm512_set1_epi16(16));                                       \
    int64_t kidx2[2][TK];                                                                                   \
    tile_keys(j, table, 0, rw.lim_max + 1 < TK ? rw.lim_max + 1 : TK, it->head, kidx2[0]);                 \
    for (int64_t k0 = 0, cur = 0; k0 <= rw.lim_max; k0 += TK, cur ^= 1) {                                   \
        const int64_t nk = rw.lim_max + 1 - k0 < TK ? rw.lim_max + 1 - k0 : TK;                             \
        const int64_t nk8 = (nk + 7) / 8 * 8, npair = (nk + 1) / 2;                                         \
        const int64_t *kidx = kidx2[cur];                                                                   \
        for (int64_t t = 0; t < nk8; t++)                                                                   \
            for (int64_t d = 0; d < D; d += 32)                                                             \
                _mm512_store_si512(kt + t * D + d, _mm512_loadu_si512(kc + kidx[t] + d));                   \
        if (k0 + TK <= rw.lim_max) {                                                                        \
            const int64_t nn = rw.lim_max + 1 - k0 - TK < TK ? rw.lim_max + 1 - k0 - TK : TK;               \
            tile_keys(j, table, k0 + TK, nn, it->head, kidx2[cur ^ 1]);                                     \
            prefetch_tile((const char *)kc, (const char *)vc, kidx2[cur ^ 1], nn, 2, 2 * (size_t)D);       \
        }                                                                                                   \
        /* scores: 8 keys x R rows per register block, over pairs of dims; keys past a row's diagonal   */ \
        /* (or past the tile) become -inf, and the running max takes the rest                           */ \
        const int masked = k0 + nk8 - 1 > rw.lim_min;                                                       \
        __m512 mx[RV16];                                                                                    \
        for (int v = 0; v < RV16; v++) mx[v] = m[v];                                                        \
        for (int64_t t0 = 0; t0 < nk; t0 += 8) {                                                           \
            __m512 acc[8][RV16];                                                                            \
            const uint16_t *kr[8];                                                                          \
            for (int b = 0; b < 8; b++) {                                                                   \
                kr[b] = kt + (t0 + b) * D;                                                                  \
                for (int v = 0; v < RV16; v++) acc[b][v] = _mm512_setzero_ps();                             \
            }                                                                                               \
            for (int64_t p = 0; p < D / 2; p++) {                                                           \
                __m512i qv[RV16];                                                                           \
                for (int v = 0; v < RV16; v++) qv[v] = _mm512_load_si512(qp + p * R + 16 * v);              \
                _Pragma("GCC unroll 8")                                                                     \
                for (int b = 0; b < 8; b++) {                                                               \
                    const __m512i kv = bcast_pair(kr[b] + 2 * p);                                           \
                    for (int v = 0; v < RV16; v++) acc[b][v] = dp(acc[b][v], kv, qv[v]);                    \
                }                                                                                           \
            }                                                                                               \
            for (int b = 0; b < 8; b++)                                                                     \
                for (int v = 0; v < RV16; v++) {                                                            \
                    __m512 s = acc[b][v];                                                                   \
                    if (masked) {                                                                           \
                        const __m512i key = _mm512_set1_epi32((int)(k0 + t0 + b));                          \
                        __mmask16 ok = _mm512_cmpge_epi32_mask(lim[v], key);                                \
                        if (t0 + b >= nk) ok = 0;                                                           \
                        s = _mm512_mask_mov_ps(ninf, ok, s);                                                \
                    }                                                                                       \
                    mx[v] = _mm512_max_ps(mx[v], s);                                                        \
                    _mm512_store_ps(st + (t0 + b) * R + 16 * v, s);                                         \
                }                                                                                           \
        }                                                                                                   \
        /* V rows interleaved by pairs of keys: vp[t/2][d] = (v_t[d], v_{t+1}[d]); a missing key is 0 */    \
        for (int64_t t = 0; t < nk; t += 2) {                                                               \
            const uint16_t *va = vc + kidx[t], *vb = vc + kidx[t + 1];                                      \
            const int two = t + 1 < nk;                                                                     \
            for (int64_t d = 0; d < D; d += 32) {                                                           \
                const __m512i x = _mm512_loadu_si512(va + d);                                               \
                const __m512i y = two ? _mm512_loadu_si512(vb + d) : _mm512_setzero_si512();                \
                _mm512_store_si512(vp + t / 2 * D + d, _mm512_permutex2var_epi16(x, vlo, y));              \
                _mm512_store_si512(vp + t / 2 * D + d + 16, _mm512_permutex2var_epi16(x, vhi, y));         \
            }                                                                                               \
        }                                                                                                   \
        /* p = 2^(s c - m c) (exactly 0 where s = -inf), summed in float32, packed to bf16 pairs */         \
        __m512 alpha[RV16];                                                                                 \
        for (int v = 0; v < RV16; v++) {                                                                    \
            alpha[v] = exp2_512(_mm512_mul_ps(_mm512_sub_ps(m[v], mx[v]), c));                              \
            const __m512 mc = _mm512_mul_ps(mx[v], c);                                                      \
            __m512 sum = _mm512_setzero_ps();                                                               \
            for (int64_t t2 = 0; t2 < npair; t2++) {                                                        \
                const __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st + 2 * t2 * R + 16 * v), c, mc));  \
                const __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st + (2 * t2 + 1) * R + 16 * v), c, mc)); \
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));                                            \
                const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);                                \
                _mm512_store_si512(pp + t2 * R + 16 * v, _mm512_permutexvar_epi16(pidx, packed));          \
            }                                                                                               \
            l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum), m[v] = mx[v];                                      \
        }                                                                                                   \
        /* o^T[d][r] = o^T alpha + sum over key pairs of (v_t[d], v_t+1[d]) . (p_t[r], p_t+1[r]) */        \
        for (int64_t d0 = 0; d0 < D; d0 += 8) {                                                             \
            __m512 acc[8][RV16];                                                                            \
            for (int b = 0; b < 8; b++)                                                                     \
                for (int v = 0; v < RV16; v++)                                                              \
                    acc[b][v] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + b) * R + 16 * v), alpha[v]);        \
            for (int64_t t2 = 0; t2 < npair; t2++) {                                                        \
                __m512i pv[RV16];                                                                           \
                for (int v = 0; v < RV16; v++) pv[v] = _mm512_load_si512(pp + t2 * R + 16 * v);             \
                _Pragma("GCC unroll 8")                                                                     \
                for (int b = 0; b < 8; b++) {                                                               \
                    const __m512i x = _mm512_set1_epi32((int)vp[t2 * D + d0 + b]);                          \
                    for (int v = 0; v < RV16; v++) acc[b][v] = dp(acc[b][v], x, pv[v]);                     \
                }                                                                                           \
            }                                                                                               \
            for (int b = 0; b < 8; b++)                                                                     \
                for (int v = 0; v < RV16; v++) _mm512_store_ps(ot + (d0 + b) * R + 16 * v, acc[b][v]);      \
        }                                                                                                   \
    }                                                                                                       \
    float inv_l[R];                                                                                         \
    for (int v = 0; v < RV16; v++) _mm512_storeu_ps(inv_l + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), l[v])); \
    store_out(j, it, &rw, ot, inv_l, D);                                                                    \
}

DEFINE_DPBF16(dpbf16_d64, 64)
DEFINE_DPBF16(dpbf16_d128, 128)
DEFINE_DPBF16(dpbf16_any, 0)
#endif

/* ---------------------------------------------------------------------------------------------------- */

/* Bits of the paths compiled in: 1 = 512-bit vectors in the portable item, 2 = the AVX512-BF16 item. */
int prefill_attention_features(void) { return (VW == 16 ? 1 : 0) | (HAVE_DPBF16 ? 2 : 0); }

/* Costliest sequences first (balance across threads), and within a sequence its items together, KV head by
 * KV head, costliest (last) query rows first: consecutive items read the same K/V, still in cache. */
static int item_order(const void *a, const void *b) {
    const item_t *x = (const item_t *)a, *y = (const item_t *)b;
    if (x->cost != y->cost) return x->cost < y->cost ? 1 : -1;
    if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return (x->row0 < y->row0) - (x->row0 > y->row0);
}

/* q_bf16: 0 = float32, 1 = bfloat16 (q and out share a dtype); kv_fmt: 0 = float32, 1 = bfloat16, 2 = int8,
 * 3 = fp8 e4m3fn (8-bit rows of kv8_row_bytes(head_dim, kv_fmt) bytes, kv8.h). Returns 0; -1 when memory could
 * not be allocated; -2 for arguments out of range (a sequence's rows past num_tokens, its keys past its
 * block table, a negative length or offset, num_heads not a multiple of num_kv_heads). */
int paged_prefill_attention(const void *q, int64_t q_row_stride, int q_bf16, const void *k_cache,
                            const void *v_cache, int kv_fmt, const int64_t *block_tables, int64_t max_blocks,
                            const int64_t *q_start, const int64_t *q_len, const int64_t *offsets,
                            int64_t num_seqs, int64_t num_tokens, void *out, int64_t num_kv_heads, int64_t group,
                            int64_t head_dim, int64_t block_size, float scale, int64_t num_threads) {
    if (num_kv_heads < 1 || group < 1 || head_dim < 1 || block_size < 1 || kv_fmt < 0 || kv_fmt > KV8_FP8)
        return -2;
    int64_t num_items = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_len[s] < 0 || offsets[s] < 0 || q_start[s] < 0 || q_start[s] + q_len[s] > num_tokens
            || offsets[s] + q_len[s] > max_blocks * block_size)
            return -2;
        num_items += (q_len[s] * group + R - 1) / R * num_kv_heads;
    }
    if (num_items == 0) return 0;
    item_t *items = (item_t *)malloc(sizeof(item_t) * (size_t)num_items);
    if (items == NULL) return -1;
    int64_t n_it = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = q_len[s], cost = n * offsets[s] + n * (n + 1) / 2;
        for (int64_t row0 = 0; row0 < n * group; row0 += R)
            for (int64_t h = 0; h < num_kv_heads; h++) items[n_it++] = (item_t){s, h, row0, cost};
    }
    qsort(items, (size_t)num_items, sizeof(item_t), item_order);
    const job_t j = {q, q_row_stride, k_cache, v_cache, block_tables, q_start, q_len, offsets, out, max_blocks,
                     num_kv_heads, group, head_dim, block_size, kv_fmt >= KV8_INT8 ? kv8_row_bytes(head_dim, kv_fmt) : head_dim,
                     scale, q_bf16};
    const int use_dpbf16 = HAVE_DPBF16 && q_bf16 && kv_fmt == 1 && head_dim % 32 == 0;
    size_t scratch_bytes = sizeof(float) * PORTABLE_SCRATCH(head_dim);
#if HAVE_DPBF16
    if (use_dpbf16) scratch_bytes = BF16_SCRATCH(head_dim);
#endif
    scratch_bytes = (scratch_bytes + 63) / 64 * 64;
    int nt = num_threads > 0 ? (int)num_threads : 1;
    if (nt > num_items) nt = (int)num_items;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *scratch = (float *)aligned_alloc(64, scratch_bytes);
        if (scratch == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            if (scratch == NULL) continue;
            const item_t *it = items + i;
#if HAVE_DPBF16
            if (use_dpbf16) {
                if (head_dim == 64) dpbf16_d64(&j, it, scratch);
                else if (head_dim == 128) dpbf16_d128(&j, it, scratch);
                else dpbf16_any(&j, it, scratch);
                continue;
            }
#endif
            if (kv_fmt == KV8_INT8) {
                if (head_dim == 64) portable_int8_d64(&j, it, scratch);
                else if (head_dim == 128) portable_int8_d128(&j, it, scratch);
                else portable_int8_any(&j, it, scratch);
            } else if (kv_fmt == KV8_FP8) {
                if (head_dim == 64) portable_fp8_d64(&j, it, scratch);
                else if (head_dim == 128) portable_fp8_d128(&j, it, scratch);
                else portable_fp8_any(&j, it, scratch);
            } else if (kv_fmt == 1) {
                if (head_dim == 64) portable_bf16_d64(&j, it, scratch);
                else if (head_dim == 128) portable_bf16_d128(&j, it, scratch);
                else portable_bf16_any(&j, it, scratch);
            } else {
                if (head_dim == 64) portable_f32_d64(&j, it, scratch);
                else if (head_dim == 128) portable_f32_d128(&j, it, scratch);
                else portable_f32_any(&j, it, scratch);
            }
        }
        free(scratch);
    }
    (void)use_dpbf16;
    free(items);
    return failed ? -1 : 0;
}
