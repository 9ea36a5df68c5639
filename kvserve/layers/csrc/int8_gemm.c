/* int8-weight linear layer for CPU: out[M, N] = (x[M, K] quantized per row) @ w[N, K]^T (+ bias).
 *
 * Weights are symmetric int8 per output row (w[n, k] ~= q[n, k] * w_scale[n], computed at load by
 * kvserve/layers/int8.py); activations are quantized per row (token) at each call, the same way:
 *
 *     amax = max_k |x[m, k]|,  inv = 127 / amax (0 if amax == 0),  x_scale[m] = amax / 127
 *     xq[m, k] = clamp(round_half_even(x[m, k] * inv), -127, 127)
 *     acc[m, n] = sum_k xq[m, k] * q[n, k]                   (int32, exact)
 *     out[m, n] = (float)acc[m, n] * (x_scale[m] * w_scale[n]) + bias[n]      (float32, no FMA)
 *
 * so the result equals an integer reference plus that float epilogue bit for bit (int8.py's
 * int8_linear_reference; tests/unit/test_int8_gemm.py). A decode step reads 1 byte per weight instead of
 * bf16's 2, which is what makes batch-1 decode faster.
 *
 * Packed weight layout (one byte buffer, built by int8.py's pack_int8; Np = N rounded up to 16 rows,
 * Kp = K rounded up to 4), blocks of 16 output rows, within a block 4 consecutive k of each row:
 *
 *     codes  [Np / 16][Kp / 4][16 rows][4 k]  int8     byte (b, g, i, j) = q[16 b + i, 4 g + j]
 *     scales [Np] float32 (padding rows 0),  sums [Np] int32 (sum_k q[n, k], for the u8 offset below)
 *
 * One 64-byte vector of a block holds 4 k of its 16 rows: `vpdpbusd` of it with the token's 4 (u8) x
 * bytes broadcast to every lane adds those 4 products into each row's int32 lane, so accumulation is
 * vertical (no horizontal sums), and each thread streams its contiguous range of blocks sequentially.
 *
 * Paths (by the compile flags, -march=native by default):
 *   AVX512-VNNI: `vpdpbusd` multiplies unsigned x bytes by signed weights: x is stored as xq + 128 (u8) and
 *                128 * sums[n] is subtracted from the accumulator (exact).
 *   AVX2:        `vpmaddubsw(|xq|, sign(q, xq))` then `vpmaddwd` by 1: |xq|, |q| <= 127 so the int16 pair
 *                sums (<= 32,258) never saturate.
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
#elif defined(__AVX2__)
#define INT8_AVX2 1
#include <immintrin.h>
#endif

#define RB 16     /* output rows per block */
#define MT 8      /* tokens per group: accumulators held in registers */
/* sum_k u8 * s8 <= Kp * 255 * 127 must fit an int32 */
#define K_MAX 65536

static inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* Bytes of the packed buffer for an [N, K] weight (the layout above). */
int64_t int8_packed_nbytes(int64_t N, int64_t K) {
    const int64_t np = round_up(N, RB), kp = round_up(K, 4);
    return np * kp + np * (int64_t)(sizeof(float) + sizeof(int32_t));
}

/* Quantize the M rows of x (float32, or bfloat16 when x_bf16) to int8 codes q [M, Kp] (zero-padded past K)
 * and float32 scales [M], as in the header comment. */
void int8_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales) {
    for (int64_t m = 0; m < M; m++) {
        const float *xf = x_bf16 ? NULL : (const float *)x + m * K;
        const uint16_t *xh = x_bf16 ? (const uint16_t *)x + m * K : NULL;
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) {
            const float v = fabsf(xh ? bf16_widen(xh[k]) : xf[k]);
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[m] = amax / 127.f;
        int8_t *qr = q + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            float r = nearbyintf((xh ? bf16_widen(xh[k]) : xf[k]) * inv); /* ties to even (default mode) */
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            qr[k] = (int8_t)r;
        }
        for (int64_t k = K; k < Kp; k++) qr[k] = 0;
    }
}

/* acc[m][i] for rows 16 b + i of one block and tokens m0 .. m0 + mt - 1 (mt <= MT, a constant at each call). */
static inline __attribute__((always_inline)) void block_dot(const int8_t *codes, const uint8_t *xq, int64_t Kp,
                                                            int64_t m0, int mt, int32_t acc_out[MT][RB]) {
    const int64_t groups = Kp / 4;
#if defined(INT8_VNNI)
    __m512i acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const __m512i w = _mm512_loadu_si512(codes + g * 64);
        for (int m = 0; m < mt; m++) {
            int32_t x4;
            memcpy(&x4, xq + (m0 + m) * Kp + 4 * g, 4);
            acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(x4), w);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_si512(acc_out[m], acc[m]);
#elif defined(INT8_AVX2)
    __m256i lo[MT], hi[MT];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < mt; m++) lo[m] = hi[m] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(codes + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(codes + g * 64 + 32));
        for (int m = 0; m < mt; m++) {
            int32_t x4;
            memcpy(&x4, xq + (m0 + m) * Kp + 4 * g, 4);
            const __m256i xb = _mm256_set1_epi32(x4), ax = _mm256_sign_epi8(xb, xb);
            lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
            hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm256_storeu_si256((__m256i *)acc_out[m], lo[m]);
        _mm256_storeu_si256((__m256i *)(acc_out[m] + 8), hi[m]);
    }
#else
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < RB; i++) acc_out[m][i] = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = codes + g * 64;
        for (int m = 0; m < mt; m++) {
            const int8_t *x = (const int8_t *)xq + (m0 + m) * Kp + 4 * g;
            for (int i = 0; i < RB; i++)
                acc_out[m][i] += x[0] * w[4 * i] + x[1] * w[4 * i + 1] + x[2] * w[4 * i + 2] + x[3] * w[4 * i + 3];
        }
    }
#endif
}

/* Integer sums -> out rows (float32 or bfloat16), the epilogue of the header comment. */
static inline void block_store(int32_t acc[MT][RB], int mt, int64_t m0, int64_t n0, int64_t N, const int32_t *sums,
                               const float *w_scales, const float *x_scales, const float *bias, void *out,
                               int out_bf16) {
    const int nr = N - n0 < RB ? (int)(N - n0) : RB;
    for (int m = 0; m < mt; m++) {
        const float xs = x_scales[m0 + m];
        for (int i = 0; i < nr; i++) {
#if defined(INT8_VNNI)
            const int32_t a = acc[m][i] - 128 * sums[n0 + i];
#else
            const int32_t a = acc[m][i];
            (void)sums;
#endif
            float v = (float)a * (xs * w_scales[n0 + i]);
            if (bias) v = v + bias[n0 + i];
            if (out_bf16) ((uint16_t *)out)[(m0 + m) * N + n0 + i] = bf16_narrow(v);
            else ((float *)out)[(m0 + m) * N + n0 + i] = v;
        }
    }
}

#define BLOCK_CASE(T)                                                                                      \
    do {                                                                                                   \
        block_dot(codes, xq, Kp, m0, T, acc);                                                              \
        block_store(acc, T, m0, n0, N, sums, w_scales, x_scales, bias, out, x_bf16);                       \
    } while (0)

/* The entry point. x: [M, K] float32 (x_bf16 0) or bfloat16 (1), contiguous; packed: the layout above;
 * bias: float32 [N] or NULL; out: [M, N] in x's dtype. Returns 0; -1 when scratch memory could not be
 * allocated; -2 when K exceeds K_MAX (the int32 accumulator could overflow). */
int int8_gemm(const void *x, int x_bf16, const uint8_t *packed, const float *bias, void *out, int64_t M, int64_t N,
              int64_t K, int64_t num_threads) {
    if (K > K_MAX) return -2;
    const int nthreads = num_threads > 0 ? (int)num_threads : 1;
    const int64_t np = round_up(N, RB), kp = round_up(K, 4), blocks = np / RB;
    const int8_t *codes_all = (const int8_t *)packed;
    const float *w_scales = (const float *)(packed + np * kp);
    const int32_t *sums = (const int32_t *)(packed + np * kp + np * (int64_t)sizeof(float));
    uint8_t *xq = (uint8_t *)malloc((size_t)(M * kp) + 64);
    float *x_scales = (float *)malloc(sizeof(float) * (size_t)M);
    if (xq == NULL || x_scales == NULL) {
        free(xq), free(x_scales);
        return -1;
    }
    int8_quantize_rows(x, x_bf16, M, K, kp, (int8_t *)xq, x_scales);
#if defined(INT8_VNNI)
    for (int64_t i = 0; i < M * kp; i++) xq[i] ^= 0x80u; /* xq + 128 as u8 */
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *codes = codes_all + b * RB * kp;
        const int64_t n0 = b * RB;
        int32_t acc[MT][RB];
        const int64_t Kp = kp;
        int64_t m0 = 0;
        for (; m0 + MT <= M; m0 += MT) BLOCK_CASE(MT);
        switch (M - m0) {
        case 1: BLOCK_CASE(1); break;
        case 2: BLOCK_CASE(2); break;
        case 3: BLOCK_CASE(3); break;
        case 4: BLOCK_CASE(4); break;
        case 5: BLOCK_CASE(5); break;
        case 6: BLOCK_CASE(6); break;
        case 7: BLOCK_CASE(7); break;
        default: break;
        }
    }
    free(xq), free(x_scales);
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
