/* 8-bit KV cache rows (layers/kv_quant.py): one (token, KV head) row is D 8-bit codes, then its float32 scale.
 *
 *   byte 0 .. D-1: codes (int8, or float8 e4m3fn: s eeee mmm, bias 7, no infinities)   byte D .. D+3: scale
 *   value[d] = decode(code[d]) * scale
 *
 * Formats, as the kernels' `kv_fmt` flags: 0 float32, 1 bfloat16 (no scale), KV8_INT8 = 2, KV8_FP8 = 3.
 *
 *   kv8_scale(row, D)        the row's scale
 *   fp8_e4m3_widen(b)        exact e4m3fn -> float32, branch-free (normal: exponent rebased by 120;
 *                            subnormal e = 0: m * 2^-9), so it vectorizes and needs no denormal support
 *   fp8_e4m3_narrow(f)       float32 with |f| <= 448 -> e4m3fn, round to nearest even (as torch's cast)
 *   kv8_quantize_row(x, D, fmt, dst)   D floats -> one row: codes, then scale = amax / 127 (int8) or
 *                            amax / 448 (fp8), 1 for an all-zero row (kv_quant.quantize, bit for bit)
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
#define KV8_SCALE_BYTES 4
#define KV8_FP8_UNIT 256.f /* kv8_load16_fp8 returns value / 256 */

static inline float kv8_scale(const void *row, int64_t D) {
    float s;
    memcpy(&s, (const uint8_t *)row + D, 4);
    return s;
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
    const float qmax = fmt == KV8_INT8 ? 127.f : 448.f;
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float scale = amax > 0.f ? amax / qmax : 1.f;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / scale;
        y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
        dst[d] = fmt == KV8_INT8 ? (uint8_t)(int8_t)nearbyintf(y) : fp8_e4m3_narrow(y);
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

#endif
