/* int8-weight linear layer for CPU: out[M, N] = (x[M, K] quantized per token and group) @ w[N, K]^T (+ bias).
 *
 * Weights are symmetric int8 per output row (w[n, k] ~= q[n, k] * w_scale[n], computed at load by
 * kvserve/layers/int8.py); activations are quantized at each call per token and per group of GS = 32
 * consecutive k (as llama.cpp's Q8_0 blocks; per whole row, SmolLM2's outlier channels cost +3.2 % perplexity
 * against +0.5 % per group of 32, docs/quantization.md):
 *
 *     amax = max_{k in g} |x[m, k]|,  inv = 127 / amax (0 if amax == 0),  x_scale[m, g] = amax / 127
 *     xq[m, k] = clamp(round_half_even(x[m, k] * inv), -127, 127)
 *     acc[m, n, g] = sum_{k in g} xq[m, k] * q[n, k]                     (int32, exact)
 *     s[m, n] = sum_g (float)acc[m, n, g] * x_scale[m, g]               (float32, g in order, no FMA)
 *     out[m, n] = s[m, n] * w_scale[n] + bias[n]
 *
 * so the result equals an integer reference plus that float epilogue bit for bit (int8.py's
 * int8_linear_reference; tests/unit/test_int8_gemm.py). A decode step reads ~1 byte per weight instead of
 * bf16's 2, which is what makes batch-1 decode faster.
 *
 * Packed weight layout (one byte buffer, built by int8.py's pack_int8; Np = N rounded up to 16 rows,
 * Kp = K rounded up to GS), blocks of 16 output rows, within a block 4 consecutive k of each row:
 *
 *     codes  [Np / 16][Kp / 4][16 rows][4 k]  uint8 = q + 128      byte (b, c, i, j) <- q[16 b + i, 4 c + j]
 *     scales [Np] float32 (padding rows 0)
 *
 * One 64-byte vector of a block holds 4 k of its 16 rows: `vpdpbusd` of it with the token's 4 x codes
 * broadcast to every lane adds those 4 products into each row's int32 lane, so accumulation is vertical (no
 * horizontal sums), and each thread streams its contiguous range of blocks sequentially.
 *
 * Paths (by the compile flags, -march=native by default):
 *   AVX512-VNNI: `vpdpbusd` multiplies the unsigned weight bytes (q + 128) by the signed x codes; the offset's
 *                share, 128 * sum_{k in g} xq[m, k], is one subtraction per token and group (exact).
 *   AVX2:        q = byte ^ 0x80, then `vpmaddubsw(|xq|, sign(q, xq))` and `vpmaddwd` by 1: |xq|, |q| <= 127
 *                so the int16 pair sums (<= 32,258) never saturate.
 *   portable C:  the same sums in scalar code (any other CPU).
 * Threads: OpenMP over blocks of 16 rows (see small_gemm.c for the shared libgomp pool).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_VNNI 1
#include <immintrin.h>
#define MT 8 /* tokens per group: 2 x 8 accumulators of 32 registers */
#elif defined(__AVX2__)
#define INT8_AVX2 1
#include <immintrin.h>
#define MT 2 /* 16 registers: 2 x 4 accumulators per token, weights, x */
#else
#define MT 4
#endif

#define RB 16 /* output rows per block */
#define GS 32 /* k per activation scale group */
#define K_MAX (1 << 24)

static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* Bytes of the packed buffer for an [N, K] weight (the layout above). */
int64_t int8_packed_nbytes(int64_t N, int64_t K) {
    const int64_t np = round_up(N, RB);
    return np * round_up(K, GS) + np * (int64_t)sizeof(float);
}

/* Quantize the M rows of x (float32, or bfloat16 when x_bf16) per group of GS: codes q [M, Kp] (zero past K),
 * float32 scales [M, Kp / GS] and int32 code sums [M, Kp / GS] (xsum may be NULL), as in the header comment. */
void int8_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales,
                        int32_t *xsum, int64_t num_threads) {
    const int64_t groups = Kp / GS;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? (int)num_threads : 1) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *xf = x_bf16 ? NULL : (const float *)x + m * K;
        const uint16_t *xh = x_bf16 ? (const uint16_t *)x + m * K : NULL;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * GS, k1 = k0 + GS < K ? k0 + GS : K;
            float v[GS], amax = 0.f;
            for (int64_t k = k0; k < k1; k++) {
                v[k - k0] = xh ? bf16_widen(xh[k]) : xf[k];
                const float a = fabsf(v[k - k0]);
                amax = a > amax ? a : amax;
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            scales[m * groups + g] = amax / 127.f;
            int8_t *qr = q + m * Kp + k0;
            int32_t sum = 0;
            for (int64_t k = k0; k < k1; k++) {
                float r = nearbyintf(v[k - k0] * inv); /* ties to even (the default rounding mode) */
                r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
                qr[k - k0] = (int8_t)r;
                sum += (int32_t)r;
            }
            for (int64_t k = k1; k < k0 + GS; k++) qr[k - k0] = 0;
            if (xsum) xsum[m * groups + g] = sum;
        }
    }
}

/* Float sums s[m][i] = sum_g (float)acc[m, 16 b + i, g] * x_scale[m, g] for one block (codes: its first byte)
 * and tokens m0 .. m0 + mt - 1 (mt <= MT, a constant at each call). */
static inline __attribute__((always_inline)) void block_dot(const uint8_t *codes, const int8_t *xq,
                                                            const float *xs, const int32_t *xsum, int64_t Kp,
                                                            int64_t m0, int mt, float out[MT][RB]) {
    const int64_t groups = Kp / GS;
#if defined(INT8_VNNI)
    __m512 accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MT];
        for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_si512();
        for (int c = 0; c < GS / 4; c++) {
            const __m512i w = _mm512_loadu_si512(codes + (g * (GS / 4) + c) * 64);
            for (int m = 0; m < mt; m++) {
                int32_t x4;
                memcpy(&x4, xq + (m0 + m) * Kp + g * GS + 4 * c, 4);
                acc[m] = _mm512_dpbusd_epi32(acc[m], w, _mm512_set1_epi32(x4));
            }
        }
        for (int m = 0; m < mt; m++) {
            const int64_t i = (m0 + m) * groups + g;
            const __m512i a = _mm512_sub_epi32(acc[m], _mm512_set1_epi32(128 * xsum[i]));
            accf[m] = _mm512_add_ps(accf[m], _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs[i])));
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out[m], accf[m]);
#elif defined(INT8_AVX2)
    (void)xsum;
    __m256 flo[MT], fhi[MT];
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int m = 0; m < mt; m++) flo[m] = fhi[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i lo[MT], hi[MT];
        for (int m = 0; m < mt; m++) lo[m] = hi[m] = _mm256_setzero_si256();
        for (int c = 0; c < GS / 4; c++) {
            const uint8_t *wp = codes + (g * (GS / 4) + c) * 64;
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wp), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wp + 32)), flip);
            for (int m = 0; m < mt; m++) {
                int32_t x4;
                memcpy(&x4, xq + (m0 + m) * Kp + g * GS + 4 * c, 4);
                const __m256i xb = _mm256_set1_epi32(x4), ax = _mm256_sign_epi8(xb, xb);
                lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
                hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
            }
        }
        for (int m = 0; m < mt; m++) {
            const __m256 sc = _mm256_set1_ps(xs[(m0 + m) * groups + g]);
            flo[m] = _mm256_add_ps(flo[m], _mm256_mul_ps(_mm256_cvtepi32_ps(lo[m]), sc));
            fhi[m] = _mm256_add_ps(fhi[m], _mm256_mul_ps(_mm256_cvtepi32_ps(hi[m]), sc));
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm256_storeu_ps(out[m], flo[m]);
        _mm256_storeu_ps(out[m] + 8, fhi[m]);
    }
#else
    (void)xsum;
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < RB; i++) out[m][i] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        for (int m = 0; m < mt; m++) {
            int32_t acc[RB] = {0};
            for (int c = 0; c < GS / 4; c++) {
                const uint8_t *w = codes + (g * (GS / 4) + c) * 64;
                const int8_t *x = xq + (m0 + m) * Kp + g * GS + 4 * c;
                for (int i = 0; i < RB; i++)
                    for (int j = 0; j < 4; j++) acc[i] += x[j] * ((int32_t)w[4 * i + j] - 128);
            }
            const float sc = xs[(m0 + m) * groups + g];
            for (int i = 0; i < RB; i++) out[m][i] = out[m][i] + (float)acc[i] * sc;
        }
    }
#endif
}

/* Float sums -> out rows (float32 or bfloat16): out = s * w_scale + bias. */
static inline void block_store(float s[MT][RB], int mt, int64_t m0, int64_t n0, int64_t N, const float *w_scales,
                               const float *bias, void *out, int out_bf16) {
    const int nr = N - n0 < RB ? (int)(N - n0) : RB;
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < nr; i++) {
            float v = s[m][i] * w_scales[n0 + i];
            if (bias) v = v + bias[n0 + i];
            if (out_bf16) ((uint16_t *)out)[(m0 + m) * N + n0 + i] = bf16_narrow(v);
            else ((float *)out)[(m0 + m) * N + n0 + i] = v;
        }
}

#define BLOCK_CASE(T)                                                                                      \
    do {                                                                                                   \
        block_dot(codes, xq, x_scales, xsum, kp, m0, T, acc);                                              \
        block_store(acc, T, m0, n0, N, w_scales, bias, out, x_bf16);                                       \
    } while (0)

/* The entry point. x: [M, K] float32 (x_bf16 0) or bfloat16 (1), contiguous; packed: the layout above;
 * bias: float32 [N] or NULL; out: [M, N] in x's dtype. Returns 0; -1 when scratch memory could not be
 * allocated; -2 when K exceeds K_MAX. */
int int8_gemm(const void *x, int x_bf16, const uint8_t *packed, const float *bias, void *out, int64_t M, int64_t N,
              int64_t K, int64_t num_threads) {
    if (K > K_MAX) return -2;
    const int nthreads = num_threads > 0 ? (int)num_threads : 1;
    const int64_t np = round_up(N, RB), kp = round_up(K, GS), blocks = np / RB, groups = kp / GS;
    const float *w_scales = (const float *)(packed + np * kp);
    int8_t *xq = (int8_t *)malloc((size_t)(M * kp) + 64);
    float *x_scales = (float *)malloc(sizeof(float) * (size_t)(M * groups));
    int32_t *xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * groups));
    if (xq == NULL || x_scales == NULL || xsum == NULL) {
        free(xq), free(x_scales), free(xsum);
        return -1;
    }
    int8_quantize_rows(x, x_bf16, M, K, kp, xq, x_scales, xsum, nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *codes = packed + b * RB * kp;
        const int64_t n0 = b * RB;
        float acc[MT][RB];
        int64_t m0 = 0;
        for (; m0 + MT <= M; m0 += MT) BLOCK_CASE(MT);
        switch (M - m0) {
        case 1: BLOCK_CASE(1); break;
#if MT > 2
        case 2: BLOCK_CASE(2); break;
        case 3: BLOCK_CASE(3); break;
#endif
#if MT > 4
        case 4: BLOCK_CASE(4); break;
        case 5: BLOCK_CASE(5); break;
        case 6: BLOCK_CASE(6); break;
        case 7: BLOCK_CASE(7); break;
#endif
        default: break;
        }
    }
    free(xq), free(x_scales), free(xsum);
    return 0;
}

/* Which path this build has: 1 = AVX512-VNNI (vpdpbusd), 2 = AVX2 (vpmaddubsw), 0 = portable C. */
int int8_gemm_features(void) {
#if defined(INT8_VNNI)
    return 1;
#elif defined(INT8_AVX2)
    return 2;
#else
    return 0;
#endif
}
