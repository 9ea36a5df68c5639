/* AVX-512 helpers shared by the kernels.
 *
 *   reduce16(a)   r[j] = the sum of the 16 lanes of a[j], j = 0..15: a shuffle tree (45 shuffles/adds
 *                 for 16 horizontal sums instead of ~6 each), lanes put back in order by one permute.
 */
#ifndef KVSERVE_AVX512_UTIL_H
#define KVSERVE_AVX512_UTIL_H

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    /* the tree leaves input perm[l] in lane l; perm is its own inverse */
    const __m512i perm = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
    return _mm512_permutexvar_ps(perm, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));
}
#endif

#endif
