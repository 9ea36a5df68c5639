/* The per-format inner loops of gguf_gemm.c: one "tile" = 16 output rows (a row block) x mt tokens x all of K.
 *
 * Each tile turns a group of 32 weights of each of its 16 rows into 8 vectors of unsigned codes (vector c: 4
 * consecutive k of each row, k = 4c .. 4c + 3 of the group, one row per 32-bit lane), takes their integer dot
 * products with the token's int8 activation codes of that group, and adds the group's float term to the row's
 * float32 sum (gguf_gemm.c's header has the formulas and the layout). Three builds:
 *
 *   AVX512-VNNI  `vpdpbusd`: unsigned code bytes x signed activation bytes, 4 products into each row's int32
 *                lane; nibbles split with one shift and mask; Q5_0's fifth bits set by `vptestmb` masks.
 *   AVX2         `vpmaddubsw` + `vpmaddwd`: codes <= 63 and |x| <= 127 keep the int16 pair sums <= 16,002 (no
 *                saturation); Q8_0 (q + 128 up to 255) multiplies |q| (up to 128) by sign(x, q) instead
 *                (pair sums <= 32,512).
 *   portable C   the same integer sums, scalar (gguf_gemm.c).
 */
#ifndef KVSERVE_GGUF_TILES_H
#define KVSERVE_GGUF_TILES_H

#define AI static inline __attribute__((always_inline))

#ifndef PF_DIST
#define PF_DIST 4096
#endif
/* Software prefetch of the bytes [p, p + n) (one line per 64 bytes) into L1: a thread streaming its row blocks
 * keeps misses in flight PF_DIST bytes ahead of the loads, which the hardware prefetchers alone did not (one thread
 * read 18-27 GB/s from memory where the same loop runs at 40-70 GB/s from L2). */
AI void prefetch(const uint8_t *p, int n) {
    for (int i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
}

#if defined(GG_VNNI)
typedef __m512i gv;

AI gv gv_ld(const uint8_t *p) { return _mm512_loadu_si512(p); }
AI __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
AI gv lo_nib(gv v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
AI gv hi_nib(gv v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }

AI void zero_acc(gv acc[MT], int mt) {
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_si512();
}

/* acc[m] = the dot products of n vectors of codes w[c] (4 k of each row) with token m's activation codes of
 * chunks c0 + c (4 k each; xg: the token group's interleaved codes). At mt <= 2 the products go to two dependency
 * chains per token (even and odd c): one chain of n `vpdpbusd` would bound batch 1 by their latency. */
AI void dotn(gv acc[MT], const gv *w, int n, const int8_t *xg, int64_t c0, int mt) {
    gv acc2[MT];
    zero_acc(acc, mt);
    zero_acc(acc2, mt);
#pragma GCC unroll 8
    for (int c = 0; c < n; c++)
        for (int m = 0; m < mt; m++) {
            int32_t x4;
            memcpy(&x4, xg + (c0 + c) * (4 * mt) + 4 * m, 4); /* the group's mt tokens interleaved per 4 k */
            const __m512i xb = _mm512_set1_epi32(x4);
            if (mt <= 2 && (c & 1)) acc2[m] = _mm512_dpbusd_epi32(acc2[m], w[c], xb);
            else acc[m] = _mm512_dpbusd_epi32(acc[m], w[c], xb);
        }
    if (mt <= 2)
        for (int m = 0; m < mt; m++) acc[m] = _mm512_add_epi32(acc[m], acc2[m]);
}

/* accf[m] += float(acc[m] - off * xsum) * (scale * x_scale): the usual group term. */
AI void term(__m512 accf[MT], const gv acc[MT], __m512 scale, int32_t off, const acts_t *a, int64_t m0, int mt,
             int64_t g) {
    for (int m = 0; m < mt; m++) {
        const int64_t i = (m0 + m) * a->G + g;
        const gv v = off ? _mm512_sub_epi32(acc[m], _mm512_set1_epi32(off * a->sum[i])) : acc[m];
        accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(scale, _mm512_set1_ps(a->s[i])), accf[m]);
    }
}

/* accf[m] += min_row * (x_scale * xsum): Q4_1's and Q4_K's offset term (negated by the caller's sign). */
AI void min_term(__m512 accf[MT], __m512 mn, const acts_t *a, int64_t m0, int mt, int64_t g) {
    for (int m = 0; m < mt; m++) {
        const int64_t i = (m0 + m) * a->G + g;
        accf[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->s[i] * (float)a->sum[i]), accf[m]);
    }
}

/* Q4_0, Q4_1, Q5_0, Q8_0: blocks of 32, one group each. */
AI void tile_q32(int fmt, const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t G = a->G;
    /* one block of 16 rows every TB bytes: codes (QS bytes), qh (Q5_0: 64), d (32), m (Q4_1: 32) */
    const int64_t TB = RB * block_bytes(fmt), QS = fmt == Q8_0 ? 512 : 256, DO = fmt == Q5_0 ? 320 : QS;
    const int32_t off = fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    __m512 accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = _mm512_setzero_ps();
    /* Q5_0: byte b of qh (bits 8b .. 8b + 7) copied to the 4 bytes of each lane, then bit 4 (c % 2) + j tested */
    const __m512i bcast0 = _mm512_set1_epi32(0x00000000), bcast1 = _mm512_set1_epi32(0x01010101);
    const __m512i bcast2 = _mm512_set1_epi32(0x02020202), bcast3 = _mm512_set1_epi32(0x03030303);
    const __m512i lane = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __m512i sel0 = _mm512_set1_epi32(0x08040201), sel1 = _mm512_set1_epi32((int)0x80402010);
    const __m512i b16 = _mm512_set1_epi8(16);
    for (int64_t g = 0; g < G; g++) {
        prefetch(rb + g * TB + PF_DIST, (int)TB);
        gv w[8];
        if (fmt == Q8_0) {
            #pragma GCC unroll 16
            for (int c = 0; c < 8; c++) w[c] = gv_ld(rb + g * TB + 64 * c);
        } else {
            #pragma GCC unroll 16
            for (int c = 0; c < 4; c++) {
                const gv v = gv_ld(rb + g * TB + 64 * c);
                w[c] = lo_nib(v), w[c + 4] = hi_nib(v);
            }
            if (fmt == Q5_0) {
                const gv qh = gv_ld(rb + g * TB + 256);
                const gv b[4] = {_mm512_shuffle_epi8(qh, _mm512_add_epi8(lane, bcast0)),
                                 _mm512_shuffle_epi8(qh, _mm512_add_epi8(lane, bcast1)),
                                 _mm512_shuffle_epi8(qh, _mm512_add_epi8(lane, bcast2)),
                                 _mm512_shuffle_epi8(qh, _mm512_add_epi8(lane, bcast3))};
                #pragma GCC unroll 16
                for (int c = 0; c < 4; c++) {
                    const gv sel = c & 1 ? sel1 : sel0;
                    w[c] = _mm512_mask_add_epi8(w[c], _mm512_test_epi8_mask(b[c >> 1], sel), w[c], b16);
                    w[c + 4] = _mm512_mask_add_epi8(w[c + 4], _mm512_test_epi8_mask(b[2 + (c >> 1)], sel), w[c + 4], b16);
                }
            }
        }
        gv acc[MT];
        dotn(acc, w, 8, xr, 8 * g, mt);
        term(accf, acc, half16(rb + g * TB + DO), off, a, m0, mt, g);
        if (fmt == Q4_1) min_term(accf, half16(rb + g * TB + 288), a, m0, mt, g);
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out[m], accf[m]);
}

/* Q4_K: super-blocks of 256 = 8 groups with 6-bit scales and mins. */
AI void tile_q4k(const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t S = a->G / 8;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    __m512 accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = _mm512_setzero_ps();
    const gv m6 = _mm512_set1_epi8(0x3F), m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const gv ff = _mm512_set1_epi32(0xFF);
    for (int64_t s = 0; s < S; s++) {
        /* 12 scale bytes per row as 3 words; the 8 scales and 8 mins as bytes of 2 + 2 words (Q4_K's packing) */
        const uint8_t *sb = rb + s * 2304; /* a super-block of 16 rows: scales 192, d 32, dmin 32, qs 2048 */
        const gv w0 = gv_ld(sb), w1 = gv_ld(sb + 64), w2 = gv_ld(sb + 128);
        const gv sc[2] = {_mm512_and_si512(w0, m6),
                          _mm512_or_si512(_mm512_and_si512(w2, m4), _mm512_and_si512(_mm512_srli_epi32(w0, 2), m30))};
        const gv mn[2] = {_mm512_and_si512(w1, m6),
                          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), m4),
                                          _mm512_and_si512(_mm512_srli_epi32(w1, 2), m30))};
        const __m512 d = half16(sb + 192), dmin = half16(sb + 224);
        #pragma GCC unroll 16
        for (int j = 0; j < 8; j++) {
            const uint8_t *chunk = sb + 256 + (j >> 1) * 512; /* groups 2p (low nibbles) and 2p + 1 (high) */
            prefetch(sb + PF_DIST + j * 288, 288);
            gv w[8], acc[MT];
            #pragma GCC unroll 16
            for (int c = 0; c < 8; c++) w[c] = j & 1 ? hi_nib(gv_ld(chunk + 64 * c)) : lo_nib(gv_ld(chunk + 64 * c));
            dotn(acc, w, 8, xr, 8 * (8 * s + j), mt);
            const __m512i shift = _mm512_set1_epi32(8 * (j & 3));
            const __m512 scj = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(sc[j >> 2], shift), ff));
            const __m512 mj = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(mn[j >> 2], shift), ff));
            term(accf, acc, _mm512_mul_ps(d, scj), 0, a, m0, mt, 8 * s + j);
            min_term(accf, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mj)), a, m0, mt, 8 * s + j);
        }
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out[m], accf[m]);
}

/* Q6_K: super-blocks of 256 = 16 sub-blocks of 16 with int8 scales; 4 low bits in ql, 2 high bits in qh. */
AI void tile_q6k(const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t S = a->G / 8;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    __m512 accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = _mm512_setzero_ps();
    const gv m30 = _mm512_set1_epi8(0x30);
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *sb = rb + s * 3360; /* a super-block of 16 rows: scales 256, ql 2048, qh 1024, d 32 */
        __m512 part[MT]; /* the super-block's sum before its scale d (read last: the stream stays in order) */
        for (int m = 0; m < mt; m++) part[m] = _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int gs = 0; gs < 8; gs++) { /* group gs of the super-block: half gs / 4, quarter gs % 4 */
            const int hf = gs >> 2, gi = gs & 3;
            prefetch(sb + PF_DIST + gs * 420, 420);
            #pragma GCC unroll 16
            for (int t = 0; t < 2; t++) { /* sub-block 2 gs + t: k = 16 t .. 16 t + 15 of the group */
                gv w[4], acc[MT];
                #pragma GCC unroll 16
                for (int c = 4 * t; c < 4 * t + 4; c++) {
                    const gv l = gv_ld(sb + 256 + (16 * hf + 8 * (gi & 1) + c) * 64);
                    const gv h = gv_ld(sb + 2304 + (8 * hf + c) * 64);
                    const gv hb = gi == 0 ? _mm512_slli_epi16(h, 4) : gi == 1 ? _mm512_slli_epi16(h, 2)
                                  : gi == 2 ? h : _mm512_srli_epi16(h, 2);
                    w[c - 4 * t] = _mm512_or_si512(gi < 2 ? lo_nib(l) : hi_nib(l), _mm512_and_si512(hb, m30));
                }
                dotn(acc, w, 4, xr, 8 * (8 * s + gs) + 4 * t, mt);
                const int sub = 2 * gs + t;
                const gv scv = gv_ld(sb + (sub >> 2) * 64);
                const gv sc = _mm512_srai_epi32(_mm512_sllv_epi32(scv, _mm512_set1_epi32(24 - 8 * (sub & 3))), 24);
                const __m512 scf = _mm512_cvtepi32_ps(sc);
                for (int m = 0; m < mt; m++) {
                    const int64_t g = 8 * s + gs, i = (m0 + m) * a->G + g;
                    const gv v = _mm512_sub_epi32(acc[m], _mm512_set1_epi32(32 * a->sum16[2 * i + t]));
                    part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(scf, _mm512_set1_ps(a->s[i])),
                                              part[m]);
                }
            }
        }
        const __m512 d = half16(sb + 3328);
        for (int m = 0; m < mt; m++) accf[m] = _mm512_fmadd_ps(part[m], d, accf[m]);
    }
    for (int m = 0; m < mt; m++) _mm512_storeu_ps(out[m], accf[m]);
}

#elif defined(GG_AVX2)
/* A 64-byte vector of codes (16 rows x 4 bytes) as two 256-bit halves: rows 0-7, rows 8-15. */
typedef struct { __m256i h[2]; } gv;

AI gv gv_ld(const uint8_t *p) {
    gv v = {{_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))}};
    return v;
}
AI gv gv_and(gv a, __m256i b) {
    gv v = {{_mm256_and_si256(a.h[0], b), _mm256_and_si256(a.h[1], b)}};
    return v;
}
AI gv gv_or(gv a, gv b) {
    gv v = {{_mm256_or_si256(a.h[0], b.h[0]), _mm256_or_si256(a.h[1], b.h[1])}};
    return v;
}
AI gv gv_srl16(gv a, int n) {
    gv v = {{_mm256_srli_epi16(a.h[0], n), _mm256_srli_epi16(a.h[1], n)}};
    return v;
}
AI gv gv_sll16(gv a, int n) {
    gv v = {{_mm256_slli_epi16(a.h[0], n), _mm256_slli_epi16(a.h[1], n)}};
    return v;
}
AI gv lo_nib(gv v) { return gv_and(v, _mm256_set1_epi8(0x0F)); }
AI gv hi_nib(gv v) { return gv_and(gv_srl16(v, 4), _mm256_set1_epi8(0x0F)); }

typedef struct { __m256 h[2]; } gf;
AI gf half16(const uint8_t *p) {
    gf v = {{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))}};
    return v;
}
AI gf gf_mul(gf a, gf b) {
    gf v = {{_mm256_mul_ps(a.h[0], b.h[0]), _mm256_mul_ps(a.h[1], b.h[1])}};
    return v;
}
AI gf gf_cvt(gv a) {
    gf v = {{_mm256_cvtepi32_ps(a.h[0]), _mm256_cvtepi32_ps(a.h[1])}};
    return v;
}
AI gf gf_zero(void) {
    gf v = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
    return v;
}
AI gv gv_zero(void) {
    gv v = {{_mm256_setzero_si256(), _mm256_setzero_si256()}};
    return v;
}
AI void zero_acc(gv acc[MT], int mt) {
    for (int m = 0; m < mt; m++) acc[m] = gv_zero();
}

/* acc[m] += dot products of unsigned codes w (<= 63) with token m's codes x[m][k .. k + 3]; signed_w: w holds
 * Q8_0's q + 128 (flipped back to q, multiplied as |q| * sign(x, q)). */
AI void dot4s(gv acc[MT], gv w, const int8_t *xg, int64_t chunk, int mt, int signed_w) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int m = 0; m < mt; m++) {
        int32_t x4;
        memcpy(&x4, xg + chunk * (4 * mt) + 4 * m, 4); /* the group's mt tokens interleaved per 4 k */
        const __m256i xb = _mm256_set1_epi32(x4);
        #pragma GCC unroll 16
        for (int p = 0; p < 2; p++) {
            __m256i prod;
            if (signed_w) { /* |q| * sign(x, q): |-128| is 128 as an unsigned byte, and x never -128 */
                const __m256i q = _mm256_xor_si256(w.h[p], flip);
                prod = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xb, q));
            } else {
                prod = _mm256_maddubs_epi16(w.h[p], xb);
            }
            acc[m].h[p] = _mm256_add_epi32(acc[m].h[p], _mm256_madd_epi16(prod, ones));
        }
    }
}
#define dot4(acc, w, xr, chunk, mt) dot4s(acc, w, xr, chunk, mt, 0)

AI void term(gf accf[MT], const gv acc[MT], gf scale, int32_t off, const acts_t *a, int64_t m0, int mt, int64_t g) {
    for (int m = 0; m < mt; m++) {
        const int64_t i = (m0 + m) * a->G + g;
        const __m256i o = _mm256_set1_epi32(off * a->sum[i]);
        const __m256 xs = _mm256_set1_ps(a->s[i]);
        #pragma GCC unroll 16
        for (int p = 0; p < 2; p++)
            accf[m].h[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m].h[p], o)),
                                           _mm256_mul_ps(scale.h[p], xs), accf[m].h[p]);
    }
}

AI void min_term(gf accf[MT], gf mn, const acts_t *a, int64_t m0, int mt, int64_t g) {
    for (int m = 0; m < mt; m++) {
        const int64_t i = (m0 + m) * a->G + g;
        const __m256 xs = _mm256_set1_ps(a->s[i] * (float)a->sum[i]);
        #pragma GCC unroll 16
        for (int p = 0; p < 2; p++) accf[m].h[p] = _mm256_fmadd_ps(mn.h[p], xs, accf[m].h[p]);
    }
}

AI void store_acc(float out[MT][RB], const gf accf[MT], int mt) {
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(out[m], accf[m].h[0]), _mm256_storeu_ps(out[m] + 8, accf[m].h[1]);
}

AI void tile_q32(int fmt, const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t G = a->G;
    /* one block of 16 rows every TB bytes: codes (QS bytes), qh (Q5_0: 64), d (32), m (Q4_1: 32) */
    const int64_t TB = RB * block_bytes(fmt), QS = fmt == Q8_0 ? 512 : 256, DO = fmt == Q5_0 ? 320 : QS;
    const int32_t off = fmt == Q8_0 ? 0 : fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    gf accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = gf_zero();
    const __m256i lane = _mm256_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __m256i sel0 = _mm256_set1_epi32(0x08040201), sel1 = _mm256_set1_epi32((int)0x80402010);
    const __m256i b16 = _mm256_set1_epi8(16);
    for (int64_t g = 0; g < G; g++) {
        prefetch(rb + g * TB + PF_DIST, (int)TB);
        gv w[8];
        if (fmt == Q8_0) {
            #pragma GCC unroll 16
            for (int c = 0; c < 8; c++) w[c] = gv_ld(rb + g * TB + 64 * c);
        } else {
            #pragma GCC unroll 16
            for (int c = 0; c < 4; c++) {
                const gv v = gv_ld(rb + g * TB + 64 * c);
                w[c] = lo_nib(v), w[c + 4] = hi_nib(v);
            }
            if (fmt == Q5_0) {
                const gv qh = gv_ld(rb + g * TB + 256);
                #pragma GCC unroll 16
                for (int c = 0; c < 8; c++) { /* bit c' of the group's qh word, c' = 4 c + j (low) or 16 + ... */
                    const int byte = c < 4 ? c >> 1 : 2 + ((c - 4) >> 1);
                    const __m256i sel = (c & 1) ? sel1 : sel0;
                    const __m256i idx = _mm256_add_epi8(lane, _mm256_set1_epi8((char)byte));
                    #pragma GCC unroll 16
                    for (int p = 0; p < 2; p++) {
                        const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(qh.h[p], idx), sel);
                        w[c].h[p] = _mm256_or_si256(w[c].h[p], _mm256_and_si256(_mm256_cmpeq_epi8(b, sel), b16));
                    }
                }
            }
        }
        gv acc[MT];
        zero_acc(acc, mt);
        #pragma GCC unroll 16
        for (int c = 0; c < 8; c++) dot4s(acc, w[c], xr, 8 * g + c, mt, fmt == Q8_0);
        term(accf, acc, half16(rb + g * TB + DO), off, a, m0, mt, g);
        if (fmt == Q4_1) min_term(accf, half16(rb + g * TB + 288), a, m0, mt, g);
    }
    store_acc(out, accf, mt);
}

AI void tile_q4k(const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t S = a->G / 8;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    gf accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = gf_zero();
    const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ff = _mm256_set1_epi32(0xFF);
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *sb = rb + s * 2304; /* a super-block of 16 rows: scales 192, d 32, dmin 32, qs 2048 */
        const gv w0 = gv_ld(sb), w1 = gv_ld(sb + 64), w2 = gv_ld(sb + 128);
        gv sc[2], mn[2];
        #pragma GCC unroll 16
        for (int p = 0; p < 2; p++) {
            sc[0].h[p] = _mm256_and_si256(w0.h[p], m6);
            sc[1].h[p] = _mm256_or_si256(_mm256_and_si256(w2.h[p], m4), _mm256_and_si256(_mm256_srli_epi32(w0.h[p], 2), m30));
            mn[0].h[p] = _mm256_and_si256(w1.h[p], m6);
            mn[1].h[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2.h[p], 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi32(w1.h[p], 2), m30));
        }
        const gf d = half16(sb + 192), dmin = half16(sb + 224);
        #pragma GCC unroll 16
        for (int j = 0; j < 8; j++) {
            const uint8_t *chunk = sb + 256 + (j >> 1) * 512;
            prefetch(sb + PF_DIST + j * 288, 288);
            gv acc[MT];
            zero_acc(acc, mt);
            #pragma GCC unroll 16
            for (int c = 0; c < 8; c++) {
                const gv v = gv_ld(chunk + 64 * c);
                dot4(acc, j & 1 ? hi_nib(v) : lo_nib(v), xr, 8 * (8 * s + j) + c, mt);
            }
            const __m256i shift = _mm256_set1_epi32(8 * (j & 3));
            gf dsc, dm;
            #pragma GCC unroll 16
            for (int p = 0; p < 2; p++) {
                const __m256i scj = _mm256_and_si256(_mm256_srlv_epi32(sc[j >> 2].h[p], shift), ff);
                const __m256i mj = _mm256_and_si256(_mm256_srlv_epi32(mn[j >> 2].h[p], shift), ff);
                dsc.h[p] = _mm256_mul_ps(d.h[p], _mm256_cvtepi32_ps(scj));
                dm.h[p] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin.h[p], _mm256_cvtepi32_ps(mj)));
            }
            term(accf, acc, dsc, 0, a, m0, mt, 8 * s + j);
            min_term(accf, dm, a, m0, mt, 8 * s + j);
        }
    }
    store_acc(out, accf, mt);
}

AI void tile_q6k(const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t S = a->G / 8;
    const int8_t *xr = a->qi + m0 * a->K; /* this token group's codes */
    gf accf[MT];
    for (int m = 0; m < mt; m++) accf[m] = gf_zero();
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *sb = rb + s * 3360; /* a super-block of 16 rows: scales 256, ql 2048, qh 1024, d 32 */
        const gf d = half16(sb + 3328);
        #pragma GCC unroll 16
        for (int gs = 0; gs < 8; gs++) {
            const int hf = gs >> 2, gi = gs & 3;
            prefetch(sb + PF_DIST + gs * 420, 420);
            #pragma GCC unroll 16
            for (int t = 0; t < 2; t++) {
                gv acc[MT];
                zero_acc(acc, mt);
                #pragma GCC unroll 16
                for (int c = 4 * t; c < 4 * t + 4; c++) {
                    const gv l = gv_ld(sb + 256 + (16 * hf + 8 * (gi & 1) + c) * 64);
                    const gv h = gv_ld(sb + 2304 + (8 * hf + c) * 64);
                    const gv hb = gi == 0 ? gv_sll16(h, 4) : gi == 1 ? gv_sll16(h, 2) : gi == 2 ? h : gv_srl16(h, 2);
                    dot4(acc, gv_or(gi < 2 ? lo_nib(l) : hi_nib(l), gv_and(hb, m30)), xr, 8 * (8 * s + gs) + c, mt);
                }
                const int sub = 2 * gs + t;
                const gv scv = gv_ld(sb + (sub >> 2) * 64);
                const __m256i sh = _mm256_set1_epi32(24 - 8 * (sub & 3));
                gf dsc;
                #pragma GCC unroll 16
                for (int p = 0; p < 2; p++)
                    dsc.h[p] = _mm256_mul_ps(d.h[p], _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(scv.h[p], sh), 24)));
                for (int m = 0; m < mt; m++) {
                    const int64_t g = 8 * s + gs, i = (m0 + m) * a->G + g;
                    const __m256i o = _mm256_set1_epi32(32 * a->sum16[2 * i + t]);
                    const __m256 xs = _mm256_set1_ps(a->s[i]);
                    #pragma GCC unroll 16
                    for (int p = 0; p < 2; p++)
                        accf[m].h[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m].h[p], o)),
                                                       _mm256_mul_ps(dsc.h[p], xs), accf[m].h[p]);
                }
            }
        }
    }
    store_acc(out, accf, mt);
}
#endif

#endif
