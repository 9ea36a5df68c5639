/* AVX2 helpers shared by the kernels (the AVX-512 ones are in avx512_util.h).
 *
 *   hsum8(v)   the sum of the 8 lanes of v: the two 128-bit halves added, then lanes 2-3 onto 0-1, then lane 1
 *              onto lane 0; one order everywhere, so every kernel rounds a horizontal sum the same way.
 */
#ifndef KVSERVE_AVX2_UTIL_H
#define KVSERVE_AVX2_UTIL_H

#if defined(__AVX2__)
#include <immintrin.h>

static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

#endif
