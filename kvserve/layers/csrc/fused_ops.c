/* Fused memory-bound ops of a decoder layer for CPU, one call each instead of 6-15 framework ops.
 *
 * At batch 1 a step runs ~40 small torch ops per layer (casts, views, adds, cat, index_copy): each costs
 * a few microseconds of dispatch for nanoseconds of work. These kernels do the same arithmetic in one pass:
 *
 *   add_rms_norm   residual += x (optional); out = weight * to_dtype(r * rsqrt(mean(r^2) + eps))
 *                  (HF LlamaRMSNorm: the normalisation in float32, cast to the activation dtype, then
 *                  multiplied by the weight; Zhang & Sennrich 2019)
 *   silu_mul       out = silu(gate) * up, gate_up = [gate | up] along the last dim (SwiGLU; Shazeer 2020)
 *   rope_write_kv  q, k rotated in place (NeoX / HF rotate-half layout; Su et al. 2021), then k and v
 *                  written to their paged cache slots (vLLM's reshape_and_cache)
 *   rope_write_kv8 the same into an 8-bit cache: each k / v row quantized (kv8.h; kv_quant.py bit for bit)
 *
 * Activations are float32 or bfloat16 (dtype flag 0 / 1); math is float32; bf16 results are rounded to
 * nearest even after each op the reference rounds at. The torch code in layernorm.py / rotary.py /
 * attention.py / llama.py is the reference they are tested against.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx2_util.h"
#include "bf16.h"
#include "kv8.h"

/* Elements below which an op stays on the calling thread (a decode step's rows: the parallel region
 * would cost more than the work); above it (prefill chunks) OpenMP splits the rows. Rows are
 * independent and each is computed exactly as on one thread, so results do not depend on threads. */
#define PARALLEL_MIN 65536

__attribute__((simd("notinbranch"))) float expf(float);

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = bf16_narrow(f);
    else ((float *)p)[i] = f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same rows with AVX-512: bf16 widened exactly and rounded to nearest even as bf16_narrow does
 * (NaN kept quiet). */

/* e^x, 16 lanes: x = n ln2 + r (Cody-Waite, |r| <= ln2/2), e^r by its degree-6 Taylor polynomial
 * (truncation error <= 0.347^7/7! = 1.2e-7 relative), times 2^n by vscalefps (which saturates to 0 / inf
 * without integer tricks). Within ~3 ulp of expf; x clamped to [-104, 104] first (NaN kept: a NaN
 * operand is what min/max return when it is their second). 10 dependent vector ops where libmvec's
 * expf spends ~2x that on special cases. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(104.f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  /* ln2 split hi + lo */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) __m512i narrow16(__m512 f) { /* -> bf16 in each lane's low half */
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, __mmask16 k, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(k, (const float *)p + i);
}


static inline __attribute__((always_inline)) __m512 round16(__m512 f) { /* the float32 a bf16 would hold */
    return _mm512_castsi512_ps(_mm512_slli_epi32(narrow16(f), 16));
}

static inline __attribute__((always_inline)) void st16(void *p, int64_t i, __mmask16 k, __m512 f, int bf16) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, k, _mm512_cvtepi32_epi16(narrow16(f)));
    else _mm512_mask_storeu_ps((float *)p + i, k, f);
}

static inline __attribute__((always_inline)) void silu_mul_row16(const void *gate_up, void *out, int64_t m,
                                                                  int64_t F, const int bf16) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < F; i += 16) {
        const __mmask16 k = F - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (F - i)) - 1u);
        const __m512 g = ld16(gate_up, m * 2 * F + i, k, bf16);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 sv = _mm512_div_ps(g, _mm512_add_ps(one, e));
        if (bf16) sv = _mm512_castsi512_ps(_mm512_slli_epi32(narrow16(sv), 16));
        const __m512 r = _mm512_mul_ps(sv, ld16(gate_up, m * 2 * F + F + i, k, bf16));
        if (bf16) _mm256_mask_storeu_epi16((uint16_t *)out + m * F + i, k, _mm512_cvtepi32_epi16(narrow16(r)));
        else _mm512_mask_storeu_ps((float *)out + m * F + i, k, r);
    }
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#if !defined(__AVX512F__)
#define AVX2_ROWS 1
#endif
/* The AVX-512 rows' twins for AVX2 builds, 8 lanes, the same roundings; tails (H, F not a multiple of 8) go
 * through the scalar ld / st. At batch 1 the scalar rows cost 0.6 ms of a 10 ms SmolLM2 step on Zen 3 (the
 * bf16 SiLU loop stays scalar: libmvec's expf does not vectorize past bf16_round's branch), while the other
 * OpenMP thread waits. */

/* e^x, 8 lanes: exp16's range reduction and polynomial; 2^n as two exact power-of-two factors
 * 2^(n>>1) * 2^(n - (n>>1)) (AVX2 has no vscalefps; each factor's exponent stays within [-75, 75], so the
 * integer construction never leaves the normal range, and the one rounding is the final product's). */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.f), _mm256_min_ps(_mm256_set1_ps(104.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187045e-06f)));
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 120.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 24.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f / 6.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

static inline __attribute__((always_inline)) __m128i narrow8(__m256 f) { /* -> 8 bf16, as bf16_narrow */
    const __m256i u = _mm256_castps_si256(f);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(r, q, nan); /* 16-bit results in each lane's low half */
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __attribute__((always_inline)) __m256 ld8(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) __m256 round8(__m256 f) { /* the float32 a bf16 would hold */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow8(f)), 16));
}

static inline __attribute__((always_inline)) void st8(void *p, int64_t i, __m256 f, int bf16) {
    if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), narrow8(f));
    else _mm256_storeu_ps((float *)p + i, f);
}

static inline __attribute__((always_inline)) void silu_mul_row8(const void *gate_up, void *out, int64_t m,
                                                                 int64_t F, const int bf16) {
    const __m256 one = _mm256_set1_ps(1.f);
    const int64_t g0 = m * 2 * F, u0 = g0 + F;
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) {
        const __m256 g = ld8(gate_up, g0 + i, bf16);
        __m256 sv = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        if (bf16) sv = round8(sv);
        st8(out, m * F + i, _mm256_mul_ps(sv, ld8(gate_up, u0 + i, bf16)), bf16);
    }
    for (; i < F; i++) {
        const float g = ld(gate_up, g0 + i, bf16);
        float sv = g / (1.f + expf(-g));
        if (bf16) sv = bf16_round(sv);
        st(out, m * F + i, sv * ld(gate_up, u0 + i, bf16), bf16);
    }
}
#endif

/* x, residual, out: [M, H]; weight: [H] (activation dtype). residual may be NULL (no add: the first
 * layer's input). With a residual: residual <- residual + x (rounded to the dtype, as torch's add), and
 * the norm is taken of the new residual. */
static inline __attribute__((always_inline)) void add_rms_norm_row(const void *x, void *residual,
                                                                    const void *weight, void *out, int64_t m,
                                                                    int64_t H, float eps, const int bf16) {
    float ss = 0.f;
    for (int64_t i = 0; i < H; i++) {
        float v = ld(x, m * H + i, bf16);
        if (residual) {
            v = v + ld(residual, m * H + i, bf16);
            if (bf16) v = bf16_round(v);
            st(residual, m * H + i, v, bf16);
        }
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    const void *src = residual ? residual : x;
    for (int64_t i = 0; i < H; i++) {
        float v = ld(src, m * H + i, bf16) * inv;
        if (bf16) v = bf16_round(v);
        st(out, m * H + i, ld(weight, i, bf16) * v, bf16);
    }
}

#if defined(__AVX512F__)
/* add_rms_norm_row with AVX-512: the same roundings, 16 lanes at a time; the sum of squares is kept in
 * 16 partial sums (reduced at the end), so it differs from the scalar row in summation order only. */
static inline __attribute__((always_inline)) void add_rms_norm_row16(const void *x, void *residual,
                                                                      const void *weight, void *out, int64_t m,
                                                                      int64_t H, float eps, const int bf16) {
    __m512 acc = _mm512_setzero_ps();
    const int64_t base = m * H;
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 k = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
        __m512 v = ld16(x, base + i, k, bf16);
        if (residual) {
            v = _mm512_add_ps(v, ld16(residual, base + i, k, bf16));
            st16(residual, base + i, k, v, bf16);
            if (bf16) v = round16(v);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    const void *src = residual ? residual : x;
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 k = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
        __m512 v = _mm512_mul_ps(ld16(src, base + i, k, bf16), vinv);
        if (bf16) v = round16(v);
        st16(out, base + i, k, _mm512_mul_ps(ld16(weight, i, k, bf16), v), bf16);
    }
}
#define NORM_ROW add_rms_norm_row16
#elif defined(AVX2_ROWS)
/* add_rms_norm_row with AVX2: 8 partial sums of squares (reduced at the end), the same roundings. */
static inline __attribute__((always_inline)) void add_rms_norm_row8(const void *x, void *residual,
                                                                     const void *weight, void *out, int64_t m,
                                                                     int64_t H, float eps, const int bf16) {
    const int64_t base = m * H, hv = H / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    float ss = 0.f;
    for (int64_t i = 0; i < hv; i += 8) {
        __m256 v = ld8(x, base + i, bf16);
        if (residual) {
            v = _mm256_add_ps(v, ld8(residual, base + i, bf16));
            st8(residual, base + i, v, bf16);
            if (bf16) v = round8(v);
        }
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    for (int64_t i = hv; i < H; i++) {
        float v = ld(x, base + i, bf16);
        if (residual) {
            v = v + ld(residual, base + i, bf16);
            if (bf16) v = bf16_round(v);
            st(residual, base + i, v, bf16);
        }
        ss += v * v;
    }
    const float inv = 1.f / sqrtf((hsum8(acc) + ss) / (float)H + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    const void *src = residual ? residual : x;
    for (int64_t i = 0; i < hv; i += 8) {
        __m256 v = _mm256_mul_ps(ld8(src, base + i, bf16), vinv);
        if (bf16) v = round8(v);
        st8(out, base + i, _mm256_mul_ps(ld8(weight, i, bf16), v), bf16);
    }
    for (int64_t i = hv; i < H; i++) {
        float v = ld(src, base + i, bf16) * inv;
        if (bf16) v = bf16_round(v);
        st(out, base + i, ld(weight, i, bf16) * v, bf16);
    }
}
#define NORM_ROW add_rms_norm_row8
#else
#define NORM_ROW add_rms_norm_row
#endif

void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t M, int64_t H,
                  float eps, int bf16) {
    /* rows are independent: threads split them (prefill); a decode step's few rows stay on one thread */
#pragma omp parallel for schedule(static) if (M * H >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) {
        if (bf16) NORM_ROW(x, residual, weight, out, m, H, eps, 1);
        else NORM_ROW(x, residual, weight, out, m, H, eps, 0);
    }
}

/* gate_up: [M, 2F]; out: [M, F]. silu(g) = g / (1 + exp(-g)); torch rounds silu(g) to the dtype before
 * the multiply. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate_up, void *out, int64_t m,
                                                                int64_t F, const int bf16) {
#pragma omp simd
    for (int64_t i = 0; i < F; i++) {
        const float g = ld(gate_up, m * 2 * F + i, bf16);
        float s = g / (1.f + expf(-g));
        if (bf16) s = bf16_round(s);
        st(out, m * F + i, s * ld(gate_up, m * 2 * F + F + i, bf16), bf16);
    }
}

#if defined(__AVX512F__)
#define SILU_ROW silu_mul_row16
#elif defined(AVX2_ROWS)
#define SILU_ROW silu_mul_row8
#else
#define SILU_ROW silu_mul_row
#endif

void silu_mul(const void *gate_up, void *out, int64_t M, int64_t F, int bf16) {
#pragma omp parallel for schedule(static) if (M * F >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) {
        if (bf16) SILU_ROW(gate_up, out, m, F, 1);
        else SILU_ROW(gate_up, out, m, F, 0);
    }
}

/* One head vector of D values rotated in place: out[i] = x[i]*cos[i] - x[i+D/2]*sin[i],
 * out[i+D/2] = x[i+D/2]*cos[i+D/2] + x[i]*sin[i+D/2]. cos/sin rows are float32 [D] holding values of the
 * dtype (rope_heads rounds them to bf16 first, as the reference casts its tables; the products and the sum
 * are rounded as torch rounds them). */
static inline __attribute__((always_inline)) void rope_vec(void *x, int64_t off, const float *c, const float *s, int64_t D, int bf16) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = ld(x, off + i, bf16), b = ld(x, off + i + h, bf16);
        const float c0 = c[i], s0 = s[i], c1 = c[i + h], s1 = s[i + h];
        float r0, r1;
        if (bf16) {
            r0 = bf16_round(bf16_round(a * c0) + bf16_round(-b * s0));
            r1 = bf16_round(bf16_round(b * c1) + bf16_round(a * s1));
        } else {
            r0 = a * c0 - b * s0;
            r1 = b * c1 + a * s1;
        }
        st(x, off + i, r0, bf16);
        st(x, off + i + h, r1, bf16);
    }
}

#if defined(__AVX2__)
/* rope_vec 8 pairs at a time (D / 2 a multiple of 8), the same roundings in the same order. */
static inline __attribute__((always_inline)) void rope_vec8(void *x, int64_t off, const float *c, const float *s, int64_t D,
                                                            const int bf16) {
    const int64_t h = D / 2;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < h; i += 8) {
        const __m256 a = ld8(x, off + i, bf16), b = ld8(x, off + i + h, bf16);
        const __m256 c0 = _mm256_loadu_ps(c + i), s0 = _mm256_loadu_ps(s + i);
        const __m256 c1 = _mm256_loadu_ps(c + i + h), s1 = _mm256_loadu_ps(s + i + h);
        __m256 r0, r1;
        if (bf16) {
            r0 = round8(_mm256_add_ps(round8(_mm256_mul_ps(a, c0)), round8(_mm256_mul_ps(_mm256_xor_ps(b, sign), s0))));
            r1 = round8(_mm256_add_ps(round8(_mm256_mul_ps(b, c1)), round8(_mm256_mul_ps(a, s1))));
        } else {
            r0 = _mm256_sub_ps(_mm256_mul_ps(a, c0), _mm256_mul_ps(b, s0));
            r1 = _mm256_add_ps(_mm256_mul_ps(b, c1), _mm256_mul_ps(a, s1));
        }
        st8(x, off + i, r0, bf16);
        st8(x, off + i + h, r1, bf16);
    }
}
#define ROPE_VEC(x, off, c, s, D, bf16) ((D) % 16 == 0 ? rope_vec8(x, off, c, s, D, bf16) : rope_vec(x, off, c, s, D, bf16))
#else
#define ROPE_VEC rope_vec
#endif

/* The H heads of one token at x + base rotated at one position (cos/sin rows c, s: float32 [D]). bf16 rounds the
 * two rows to bf16 once for all heads (was once per head: 15x per token for SmolLM2's 9 + 3 + 3). */
static inline void rope_heads(void *x, int64_t base, const float *c, const float *s, int64_t H, int64_t D, int bf16) {
    if (bf16) {
        float cr[D], sr[D];
        for (int64_t i = 0; i < D; i++) cr[i] = bf16_round(c[i]), sr[i] = bf16_round(s[i]);
        for (int64_t h = 0; h < H; h++) ROPE_VEC(x, base + h * D, cr, sr, D, 1);
    } else {
        for (int64_t h = 0; h < H; h++) ROPE_VEC(x, base + h * D, c, s, D, 0);
    }
}

/* qkv: [T, row_stride] holding q [Hq*D], k [Hk*D], v [Hk*D] at column offsets 0, Hq*D, (Hq+Hk)*D;
 * q and k rotated in place at positions[t]; then k and v written to slot slot_mapping[t] of
 * k_cache / v_cache ([num_slots, Hk, D]): copied when the cache has qkv's dtype (kv_bf16 == bf16), else
 * converted as torch's `.to()` converts (float32 -> bfloat16 rounded to nearest even, bfloat16 -> float32
 * exact). cos/sin: float32 [max_position, D]. */
void rope_write_kv(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                   int64_t T, int64_t Hq, int64_t Hk, int64_t D, int bf16, int kv_bf16) {
    const size_t esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T * row_stride >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        const int64_t base = t * row_stride;
        rope_heads(qkv, base, c, s, Hq + Hk, D, bf16);
        const char *row = (const char *)qkv + (size_t)base * esz;
        const int64_t n = Hk * D, slot = slot_mapping[t];
        if (kv_bf16 == bf16) {
            const size_t kv_bytes = (size_t)n * esz;
            memcpy((char *)k_cache + (size_t)slot * kv_bytes, row + (size_t)(Hq * D) * esz, kv_bytes);
            memcpy((char *)v_cache + (size_t)slot * kv_bytes, row + (size_t)((Hq + Hk) * D) * esz, kv_bytes);
        } else if (kv_bf16) { /* float32 activations, bfloat16 cache */
            const float *k = (const float *)row + Hq * D, *v = k + n;
            uint16_t *kd = (uint16_t *)k_cache + slot * n, *vd = (uint16_t *)v_cache + slot * n;
            for (int64_t i = 0; i < n; i++) kd[i] = bf16_narrow(k[i]), vd[i] = bf16_narrow(v[i]);
        } else { /* bfloat16 activations, float32 cache */
            const uint16_t *k = (const uint16_t *)row + Hq * D, *v = k + n;
            float *kd = (float *)k_cache + slot * n, *vd = (float *)v_cache + slot * n;
            for (int64_t i = 0; i < n; i++) kd[i] = bf16_widen(k[i]), vd[i] = bf16_widen(v[i]);
        }
    }
}

/* rope_write_kv for 8-bit caches k_cache / v_cache [num_slots, Hk, kv8_row_bytes(D, kv_fmt)] (kv_fmt: KV8_INT8 or
 * KV8_FP8): q and k rotated in place as above, then each k and v row (float32, or bf16 widened exactly)
 * quantized into its slot: D codes, then the float16 scale of each group of 16 channels (int8) or the row's
 * float32 scale (fp8). Returns 0, or -2 for head_dim > KV8_MAX_D (the row buffer) or an unknown kv_fmt. */
#define KV8_MAX_D 1024
int rope_write_kv8(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                   int64_t T, int64_t Hq, int64_t Hk, int64_t D, int bf16, int kv_fmt) {
    if (D > KV8_MAX_D || D < 1 || (kv_fmt != KV8_INT8 && kv_fmt != KV8_FP8)) return -2;
    const int64_t W = kv8_row_bytes(D, kv_fmt);
#pragma omp parallel for schedule(static) if (T * row_stride >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        const int64_t base = t * row_stride;
        rope_heads(qkv, base, c, s, Hq + Hk, D, bf16);
        float row[KV8_MAX_D];
        for (int64_t h = 0; h < 2 * Hk; h++) { /* k heads, then v heads */
            const int64_t off = base + (Hq + h) * D;
            for (int64_t d = 0; d < D; d++) row[d] = ld(qkv, off + d, bf16);
            uint8_t *dst = (uint8_t *)(h < Hk ? k_cache : v_cache) + (slot_mapping[t] * Hk + h % Hk) * W;
            kv8_quantize_row(row, D, kv_fmt, dst);
        }
    }
    return 0;
}
