/* 8-bit KV cache rows (layers/kv_quant.py): one (token, KV head) row is D 8-bit codes, then its scales.
 *
 *   int8 (KV8_INT8): byte 0 .. D-1 codes; then G = ceil(D / 16) float16 scales, one per 16 consecutive
 *                    channels (the last group shorter when 16 does not divide D):  value[d] = code[d] * s[d / 16]
 *                    (row: D + 2G bytes; 72 at D = 64, 144 at D = 128)
 *   fp8  (KV8_FP8):  byte 0 .. D-1 float8 e4m3fn codes (s eeee mmm, bias 7, no infinities); byte D .. D+3 one
 *                    float32 scale:  value[d] = e4m3(code[d]) * scale  (row: D + 4 bytes)
 *
 * Formats, as the kernels' `kv_fmt` flags: 0 float32, 1 bfloat16 (no scale), KV8_INT8 = 2, KV8_FP8 = 3.
 *
 *   kv8_row_bytes(D, fmt)    bytes of a row of either format
 *   kv8_scale(row, D)        an fp8 row's float32 scale
 *   kv8_group_scale(row, D, g)  an int8 row's scale of channels 16g .. 16g+15, widened to float32
 *   kv8_dequant_int8(dst, row, D)  an int8 row -> D floats (code * its group's scale: exact); AVX-512: a group
 *                            is one 16-lane vector
 *   f16_widen(h)             float16 bits -> float32, exact, branch-free for finite values (no F16C needed)
 *   f16_scale_up(s)          0 < s: the smallest float16 >= s, capped at 65504 (float16's largest finite)
 *   fp8_e4m3_widen(b)        exact e4m3fn -> float32, branch-free (normal: exponent rebased by 120;
 *                            subnormal e = 0: m * 2^-9), so it vectorizes and needs no denormal support
 *   fp8_e4m3_narrow(f)       float32 with |f| <= 448 -> e4m3fn, round to nearest even (as torch's cast)
 *   kv8_quantize_row(x, D, fmt, dst)   D floats -> one row (kv_quant.quantize, bit for bit): int8 per group
 *                            scale = f16_scale_up(amax / 127) (1 for an all-zero group), codes round(x / scale)
 *                            against that float16 value, clamped to +-127; fp8 scale = amax / 448 per row
 *   kv8_load16_int8(p)       AVX-512: 16 int8 codes -> 16 floats (exact)
 *   kv8_load16_fp8(p)        AVX-512: 16 e4m3fn codes -> 16 floats / 256 (exact): the code's 7 magnitude bits
 *                            placed as a half-float's exponent and top mantissa bits (bias 15 instead of 7,
 *                            so 2^-8 times the value; subnormals stay subnormals) and widened by vcvtph2ps;
 *                            callers fold the 256 into the scale (KV8_FP8_UNIT)
 */
#ifndef KVSERVE_KV8_H
#define KVSERVE_KV8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define KV8_INT8 2
#define KV8_FP8 3
#define KV8_INT8_GROUP 16      /* channels per int8 scale */
#define KV8_FP8_SCALE_BYTES 4  /* one float32 per fp8 row */
#define KV8_FP8_UNIT 256.f     /* kv8_load16_fp8 returns value / 256 */

static inline int64_t kv8_groups(int64_t D) { return (D + KV8_INT8_GROUP - 1) / KV8_INT8_GROUP; }

static inline int64_t kv8_row_bytes(int64_t D, int fmt) {
    return fmt == KV8_INT8 ? D + 2 * kv8_groups(D) : D + KV8_FP8_SCALE_BYTES;
}

static inline float kv8_scale(const void *row, int64_t D) {
    float s;
    memcpy(&s, (const uint8_t *)row + D, 4);
    return s;
}

static inline float f16_widen(uint16_t h) {
    const uint32_t e = (h >> 10) & 31u, m = h & 1023u;
    uint32_t u = ((e + 112u) << 23) | (m << 13);
    float normal;
    memcpy(&normal, &u, 4);
    const float mag = e ? normal : (float)m * 0x1p-24f;
    return (h & 0x8000u) ? -mag : mag;
}

static inline uint16_t f16_scale_up(float s) {
    if (!(s < 65504.f)) return 0x7bffu; /* 65504 */
    uint32_t u;
    memcpy(&u, &s, 4);
    if (u >= 0x38800000u) { /* s >= 2^-14: a normal float16; truncate the mantissa to 10 bits, up if inexact */
        const uint32_t h = ((((u >> 23) - 112u) << 10) | ((u >> 13) & 1023u)) + ((u & 0x1fffu) != 0);
        return (uint16_t)h;
    }
    return (uint16_t)ceilf(s * 0x1p24f); /* subnormal steps of 2^-24 (1024 steps = 0x400 = 2^-14 itself) */
}

static inline float kv8_group_scale(const void *row, int64_t D, int64_t g) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)row + D + 2 * g, 2);
    return f16_widen(h);
}

static inline float fp8_e4m3_widen(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    uint32_t u = ((e + 120u) << 23) | (m << 20);
    float normal;
    memcpy(&normal, &u, 4);
    const float mag = e ? normal : (float)m * 0x1p-9f;
    return (b & 0x80u) ? -mag : mag;
}

static inline float int8_widen(int8_t c) { return (float)c; }

static inline uint8_t fp8_e4m3_narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, 4);
    if (u < 0x3c800000u) /* below 2^-6, e4m3's smallest normal: code = round(a / 2^-9), 8 being 2^-6 itself */
        return (uint8_t)(sign | (uint8_t)nearbyintf(a * 512.f));
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the 23-bit mantissa to 3 bits, ties to even */
    return (uint8_t)(sign | (uint8_t)((u >> 20) - (120u << 3)));
}

static inline void kv8_quantize_row(const float *x, int64_t D, int fmt, uint8_t *dst) {
    if (fmt == KV8_INT8) {
        for (int64_t g = 0, d0 = 0; d0 < D; g++, d0 += KV8_INT8_GROUP) {
            const int64_t n = D - d0 < KV8_INT8_GROUP ? D - d0 : KV8_INT8_GROUP;
            float amax = 0.f;
            for (int64_t d = d0; d < d0 + n; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
            const uint16_t h = amax > 0.f ? f16_scale_up(amax / 127.f) : 0x3c00u; /* 0x3c00: 1.0 */
            const float scale = f16_widen(h);
            for (int64_t d = d0; d < d0 + n; d++) {
                float y = x[d] / scale;
                y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
                dst[d] = (uint8_t)(int8_t)nearbyintf(y);
            }
            memcpy(dst + D + 2 * g, &h, 2);
        }
        return;
    }
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / scale;
        y = y < -448.f ? -448.f : (y > 448.f ? 448.f : y);
        dst[d] = fp8_e4m3_narrow(y);
    }
    memcpy(dst + D, &scale, 4);
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 kv8_load16_int8(const void *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __attribute__((always_inline)) __m512 kv8_load16_fp8(const void *p) {
    /* t = code << 7: magnitude bits at 13..7 (the half's exponent low 4 bits and top 3 mantissa bits), the sign
     * at bit 14; adding bit 14 to itself carries the sign to bit 15 */
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
}
#endif

/* an int8 row -> D floats, code x its group's scale (exact in float32) */
static inline void kv8_dequant_int8(float *restrict dst, const int8_t *restrict row, int64_t D) {
    const int64_t full = D / KV8_INT8_GROUP * KV8_INT8_GROUP;
    for (int64_t d0 = 0; d0 < full; d0 += KV8_INT8_GROUP) { /* a 16-wide group: one vector (AVX-512) */
        const float s = kv8_group_scale(row, D, d0 / KV8_INT8_GROUP);
#if defined(__AVX512F__)
        _mm512_storeu_ps(dst + d0, _mm512_mul_ps(kv8_load16_int8(row + d0), _mm512_set1_ps(s)));
#else /* (without the pragma GCC left this loop scalar in the prefill tile copy: 1.3-1.4x its time, AVX2) */
        _Pragma("omp simd")
        for (int d = 0; d < KV8_INT8_GROUP; d++) dst[d0 + d] = (float)row[d0 + d] * s;
#endif
    }
    if (full < D) {
        const float s = kv8_group_scale(row, D, full / KV8_INT8_GROUP);
        for (int64_t d = full; d < D; d++) dst[d] = (float)row[d] * s;
    }
}

#endif
