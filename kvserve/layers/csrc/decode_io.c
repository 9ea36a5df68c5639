/* The two ends of a greedy decode step on CPU, for the runner's native decode path (worker/greedy_decode.py):
 *
 *   embed_rows   out[m] = table[ids[m]] (the embedding lookup; a bfloat16 table widened exactly to float32
 *                activations, or copied in its own dtype), so a step needs no torch ops before the layers
 *   argmax_rows  out[m] = the first index of the largest value of row m (float32 or bfloat16), with
 *                torch.argmax's rules: a NaN counts as larger than anything (the first NaN wins); among
 *                equal values (0.0 and -0.0 too) the first index wins
 *
 * torch.argmax over one 49,152-entry row of logits took 43-85 us on the 2-vCPU Zen 4 host (more than the
 * rest of the sampler); this takes a few microseconds (two vector passes: the maximum and any NaN, then the
 * first index holding it; AVX-512 and AVX2 builds, a scalar loop elsewhere). The torch calls are the reference they are tested
 * against (tests/unit/test_greedy_decode.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Rows of `table` ([V, H], bf16 if t_bf16 else float32) picked by ids[M] into out ([M, H], bf16 if out_bf16
 * else float32). A bf16 table into float32 rows is widened (exact); float32 into bf16 is not supported.
 * Returns 0, -1 for an id outside [0, V), -2 for an unsupported dtype pair. */
int embed_rows(const void *table, int t_bf16, int64_t V, const int64_t *ids, int64_t M, int64_t H, void *out,
               int out_bf16) {
    if (!t_bf16 && out_bf16) return -2;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= V) return -1;
    for (int64_t m = 0; m < M; m++) {
        if (t_bf16 == out_bf16) {
            const size_t row = (size_t)H * (t_bf16 ? 2 : 4);
            memcpy((char *)out + (size_t)m * row, (const char *)table + (size_t)ids[m] * row, row);
        } else { /* bf16 -> float32 */
            const uint16_t *src = (const uint16_t *)table + ids[m] * H;
            float *dst = (float *)out + m * H;
            for (int64_t h = 0; h < H; h++) dst[h] = bf16_widen(src[h]);
        }
    }
    return 0;
}

static inline float load_value(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_widen(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* The vector halves of argmax_row's two passes, per ISA: max_lanes folds the whole vectors of x[0, n) into *best
 * and returns 1 if one of them is a NaN (unordered with itself; *best is then left alone); first_equal_lanes
 * returns the first index of those vectors holding best (==: 0.0 and -0.0 match, as in torch), or -1. Both set
 * *end to where the whole vectors stop. */
#if defined(__AVX512F__)
#define VECTOR_ARGMAX 1
static inline __m512 load16(const void *x, int64_t i, int bf16) { /* 16 values from i, as float32 */
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static int max_lanes(const void *x, int bf16, int64_t n, float *best, int64_t *end) {
    __m512 vmax = _mm512_set1_ps(*best);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, i, bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, v);
    }
    *end = i;
    if (nan) return 1;
    *best = _mm512_reduce_max_ps(vmax);
    return 0;
}

static int64_t first_equal_lanes(const void *x, int bf16, int64_t n, float best, int64_t *end) {
    const __m512 b = _mm512_set1_ps(best);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(load16(x, j, bf16), b, _CMP_EQ_OQ);
        if (eq) return j + __builtin_ctz((unsigned)eq);
    }
    *end = j;
    return -1;
}
#elif defined(__AVX2__)
/* (the scalar loop's compare and branch per value took ~40 us per 49,152-entry row on Zen 3: 2.4 ms of a
 * batch-64 decode step; these 8-lane passes 9 us) */
#define VECTOR_ARGMAX 1
static inline __m256 load8(const void *x, int64_t i, int bf16) { /* 8 values from i, as float32 */
    if (!bf16) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static int max_lanes(const void *x, int bf16, int64_t n, float *best, int64_t *end) {
    __m256 vmax = _mm256_set1_ps(*best), unord = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, bf16);
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
    }
    *end = i;
    if (_mm256_movemask_ps(unord)) return 1;
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int k = 0; k < 8; k++) *best = lanes[k] > *best ? lanes[k] : *best;
    return 0;
}

static int64_t first_equal_lanes(const void *x, int bf16, int64_t n, float best, int64_t *end) {
    const __m256 b = _mm256_set1_ps(best);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, j, bf16), b, _CMP_EQ_OQ));
        if (eq) return j + __builtin_ctz((unsigned)eq);
    }
    *end = j;
    return -1;
}
#endif

/* argmax of one row of n values: the first NaN if there is one, else the first index of the maximum. */
static int64_t argmax_row(const void *x, int bf16, int64_t n) {
    if (n <= 0) return 0;
    float best = load_value(x, 0, bf16);
    if (best != best) return 0;
#ifdef VECTOR_ARGMAX
    /* pass 1: the maximum, and whether there is a NaN; pass 2: the first index holding the maximum */
    int64_t i = 0;
    int nan = max_lanes(x, bf16, n, &best, &i);
    for (; !nan && i < n; i++) {
        const float v = load_value(x, i, bf16);
        if (v != v) nan = 1;
        else if (v > best) best = v;
    }
    if (!nan) {
        int64_t j = 0;
        const int64_t hit = first_equal_lanes(x, bf16, n, best, &j);
        if (hit >= 0) return hit;
        for (; j < n; j++)
            if (load_value(x, j, bf16) == best) return j;
    }
    for (int64_t j = 0; j < n; j++) /* a NaN somewhere: torch returns the first one */
        if (load_value(x, j, bf16) != load_value(x, j, bf16)) return j;
    return 0; /* (unreachable) */
#else
    int64_t arg = 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = load_value(x, i, bf16);
        if (v != v) return i;
        if (v > best) best = v, arg = i;
    }
    return arg;
#endif
}

/* out[m] = argmax of row m of x ([M, N], bf16 if x_bf16 else float32, rows contiguous). */
void argmax_rows(const void *x, int x_bf16, int64_t M, int64_t N, int64_t *out) {
    for (int64_t m = 0; m < M; m++)
        out[m] = argmax_row(x_bf16 ? (const void *)((const uint16_t *)x + m * N) : (const void *)((const float *)x + m * N),
                            x_bf16, N);
}
