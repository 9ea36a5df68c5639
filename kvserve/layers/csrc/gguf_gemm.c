/* GGUF block-quantized linear layer for CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W kept in the file's block
 * formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; ``--quantization gguf``, kvserve/layers/gguf_blocks.py).
 *
 * Activations are quantized at each call per token and group of GS = 32 consecutive k, exactly as the int8 path
 * (int8_gemm.c's int8_quantize_rows: xq = round(x * 127 / amax) in [-127, 127], x_scale = amax / 127, plus the
 * group's code sum xsum; Q6_K also uses the sums of each half group, xsum16). Weight codes are unsigned (the
 * formats' offsets are applied through the code sums), and each group's integer dot products are exact in int32:
 *
 *     format  weight (gguf's dequantization)     group term added to out[m, n] (acc = sum_k code * xq, int32)
 *     Q4_0    d (q - 8),  q in 0..15             d * xs * (acc - 8 xsum)
 *     Q4_1    d q + m,    q in 0..15             d * xs * acc + m * xs * xsum
 *     Q5_0    d (q - 16), q in 0..31             d * xs * (acc - 16 xsum)
 *     Q8_0    d q,        q in -128..127         d * xs * (acc - 128 xsum)       (codes stored as q + 128)
 *     Q4_K    d sc_j q - dmin m_j, q in 0..15    (d sc_j) * xs * acc - (dmin m_j) * xs * xsum     (6-bit sc, m
 *                                                per group j of a 256 super-block)
 *     Q6_K    d sc_t (q - 32), q in 0..63        sum over the two halves t: (d sc_t) * xs * (acc_t - 32 xsum16_t)
 *                                                (int8 sc per 16 k)
 *
 * then out = sum_g term_g (+ bias) in float32, in x's dtype. The result is the exact product of the dequantized
 * weights with the quantized activations up to float32 rounding of the terms and their sum
 * (tests/unit/test_gguf_gemm.py holds it to that against a float64 reference).
 *
 * Layout. Each weight (or each segment of a fused one: q/k/v may differ in format) is repacked at load from the
 * file's row-major blocks into row blocks of RB = 16 output rows (rows past N are zero blocks). A row block is
 * its rows' blocks one block index b at a time (a "tile" of 16 x block bytes), and inside a tile the same bytes
 * regrouped field by field so that one 64-byte vector holds 4 bytes of each of the 16 rows. For a field of F
 * bytes per block (F a multiple of 4: codes, qh, scales):
 *
 *     tile b, field  [F / 4][16 rows][4 bytes]     byte (v, i, j) <- byte 4 v + j of that field of row i's block b
 *
 * and a 2-byte field (the f16 d, m, dmin) is [16 rows][2 bytes]. Fields come in the order the kernel reads them,
 * so that a thread streams its row blocks strictly front to back:
 *
 *     Q8_0 (34 B / 32)    qs[32] (stored q + 128) | d                    Q4_0 (18 B / 32)   qs[16] | d
 *     Q4_1 (20 B / 32)    qs[16] | d | m                                  Q5_0 (22 B / 32)   qs[16] | qh[4] | d
 *     Q4_K (144 B / 256)  scales[12] | d | dmin | qs[128]                 Q6_K (210 B / 256) scales[16] | ql[128] | qh[64] | d
 *
 *     row block of Q4_1, K = 64 (B = 2 blocks, tiles of 320 bytes):
 *     +------------------------------------------------------+------------------------------------------------------+
 *     | tile 0: v0 v1 v2 v3 (64 B each) | d (16 x f16) | m    | tile 1: v0 v1 v2 v3 | d | m                            |
 *     +------------------------------------------------------+------------------------------------------------------+
 *       v = qs bytes 4v .. 4v + 3 of rows 0..15: low nibbles k = 32 b + 4v + j, high nibbles k = 32 b + 16 + 4v + j
 *
 * One vector of a nibble format so gives the codes of 8 k of 16 rows (low nibbles, then high ones after a
 * shift); every vector is a 32-bit lane per row, so the dot products accumulate vertically (no horizontal sums)
 * and each OpenMP thread streams its contiguous range of row blocks sequentially, prefetching PF_DIST bytes ahead
 * (gguf_tiles.h has the loops). The tile order (rather than each field over all of K) measured 1.6x at batch 1
 * for Q4_1 (20 -> 33 Gw/s, one thread): one stream instead of three.
 *
 * Segments: an int64 table [count, (format, rows, address) x count]; the outputs are their rows in order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GG_VNNI 1
#include <immintrin.h>
#define MT 8 /* tokens per pass over a row block */
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define GG_AVX2 1
#include <immintrin.h>
#define MT 2
#else
#define MT 4
#endif

#define RB 16
#define GS 32
#define MAX_SEGMENTS 16

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type ids */

/* The quantized activations of one call. */
typedef struct {
    const int8_t *q;      /* [M][K] codes */
    const int8_t *qi;     /* the same, tokens interleaved per group of MT: [M / MT][K / 4][MT][4], then the rest */
    const float *s;       /* [M][G] scales (amax / 127) */
    const int32_t *sum;   /* [M][G] code sums per group of 32 */
    const int32_t *sum16; /* [M][2G] code sums per 16 */
    int64_t K, G;
} acts_t;

void int8_quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t Kp, int8_t *q, float *scales,
                        int32_t *xsum, int64_t num_threads);

/* Bytes per block and elements per block of a format (0: unknown format). */
static int64_t block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
    }
}
static int64_t block_elems(int fmt) { return fmt == Q4_K || fmt == Q6_K ? 256 : 32; }

#include "gguf_tiles.h"

/* Bytes of one row block (16 rows) of an [*, K] weight of format fmt; 0 for an unknown format or a K that is
 * not a multiple of the format's block. */
int64_t gguf_rowblock_bytes(int64_t fmt, int64_t K) {
    const int64_t bb = block_bytes((int)fmt), be = block_elems((int)fmt);
    return bb && K > 0 && K % be == 0 ? RB * (K / be) * bb : 0;
}

#if !defined(GG_VNNI) && !defined(GG_AVX2)
static float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24); /* zero and subnormals */
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits |= sign;
    memcpy(&v, &bits, 4);
    return v;
}

/* The 32 unsigned codes of row i in group g (k = 32 g .. 32 g + 31), read from the row block layout. */
static void group_codes(int fmt, const uint8_t *rb, int i, int64_t g, uint8_t u[GS]) {
    const int64_t s = g / 8;
    const int gs = (int)(g % 8);
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) {
            const int k = 4 * c + j;
            switch (fmt) {
            case Q8_0: u[k] = rb[g * 544 + c * 64 + 4 * i + j]; break;
            case Q4_0: case Q4_1: case Q5_0: {
                const uint8_t b = rb[g * RB * block_bytes(fmt) + (c & 3) * 64 + 4 * i + j];
                u[k] = c < 4 ? b & 15 : b >> 4;
                if (fmt == Q5_0) {
                    uint32_t qh;
                    memcpy(&qh, rb + g * 352 + 256 + i * 4, 4);
                    u[k] |= (uint8_t)(((qh >> k) & 1) << 4);
                }
                break;
            }
            case Q4_K: {
                const uint8_t b = rb[s * 2304 + 256 + (gs >> 1) * 512 + c * 64 + 4 * i + j];
                u[k] = gs & 1 ? b >> 4 : b & 15;
                break;
            }
            default: { /* Q6_K */
                const int hf = gs >> 2, gi = gs & 3;
                const uint8_t l = rb[s * 3360 + 256 + (16 * hf + 8 * (gi & 1) + c) * 64 + 4 * i + j];
                const uint8_t h = rb[s * 3360 + 2304 + (8 * hf + c) * 64 + 4 * i + j];
                u[k] = (uint8_t)((gi < 2 ? l & 15 : l >> 4) | (((h >> (2 * gi)) & 3) << 4));
            }
            }
        }
}

/* Portable C: the same integer sums and group terms as the vector paths, one row at a time. */
static void tile_portable(int fmt, const uint8_t *rb, const acts_t *a, int64_t m0, int mt, float out[MT][RB]) {
    const int64_t G = a->G;
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < RB; i++) out[m][i] = 0.f;
    for (int64_t g = 0; g < G; g++) {
        const int64_t s = g / 8;
        const int j8 = (int)(g % 8);
        for (int i = 0; i < RB; i++) {
            uint8_t u[GS];
            group_codes(fmt, rb, i, g, u);
            float d, mn = 0.f, dsc[2] = {0.f, 0.f};
            if (fmt == Q4_K) {
                uint8_t q[12];
                for (int w = 0; w < 3; w++) memcpy(q + 4 * w, rb + s * 2304 + w * 64 + 4 * i, 4);
                const int sc = j8 < 4 ? q[j8] & 63 : (q[j8 + 4] & 0xF) | ((q[j8 - 4] >> 6) << 4);
                const int mm = j8 < 4 ? q[j8 + 4] & 63 : (q[j8 + 4] >> 4) | ((q[j8] >> 6) << 4);
                d = half_to_float(rb + s * 2304 + 192 + 2 * i) * (float)sc;
                mn = -(half_to_float(rb + s * 2304 + 224 + 2 * i) * (float)mm);
            } else if (fmt == Q6_K) {
                d = half_to_float(rb + s * 3360 + 3328 + 2 * i);
                for (int t = 0; t < 2; t++) {
                    const int sub = 2 * j8 + t;
                    dsc[t] = d * (float)(int8_t)rb[s * 3360 + (sub >> 2) * 64 + 4 * i + (sub & 3)];
                }
            } else {
                const uint8_t *t = rb + g * RB * block_bytes(fmt);
                d = half_to_float(t + (fmt == Q5_0 ? 320 : fmt == Q8_0 ? 512 : 256) + 2 * i);
                if (fmt == Q4_1) mn = half_to_float(t + 288 + 2 * i);
            }
            const int32_t off = fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
            for (int m = 0; m < mt; m++) {
                const int64_t gi = (m0 + m) * G + g;
                const int8_t *x = a->q + (m0 + m) * a->K + g * GS;
                const float xs = a->s[gi];
                if (fmt == Q6_K) {
                    for (int t = 0; t < 2; t++) {
                        int32_t acc = 0;
                        for (int k = 16 * t; k < 16 * t + 16; k++) acc += (int32_t)u[k] * x[k];
                        acc -= 32 * a->sum16[2 * gi + t];
                        out[m][i] += (float)acc * (dsc[t] * xs);
                    }
                } else {
                    int32_t acc = 0;
                    for (int k = 0; k < GS; k++) acc += (int32_t)u[k] * x[k];
                    out[m][i] += (float)(acc - off * a->sum[gi]) * (d * xs);
                    if (fmt == Q4_1 || fmt == Q4_K) out[m][i] += mn * (xs * (float)a->sum[gi]);
                }
            }
        }
    }
}
#endif

/* Float sums of a row block -> out rows (+ bias), in x's dtype; rows past the segment's end are dropped. */
static inline __attribute__((always_inline)) void store(float s[MT][RB], int mt, int64_t m0, int64_t n0, int nr,
                                                        int64_t N, const float *bias, void *out, int out_bf16) {
    for (int m = 0; m < mt; m++)
        for (int i = 0; i < nr; i++) {
            float v = s[m][i];
            if (bias) v = v + bias[n0 + i];
            if (out_bf16) ((uint16_t *)out)[(m0 + m) * N + n0 + i] = bf16_narrow(v);
            else ((float *)out)[(m0 + m) * N + n0 + i] = v;
        }
}

/* One row block of one format for all M tokens, MT at a time (each tile a constant mt: its accumulators stay in
 * registers). One function per format, so that each is compiled on its own. */
#if defined(GG_VNNI) || defined(GG_AVX2)
#define TILE(FMT, mt) (FMT == Q4_K ? tile_q4k(rb, a, m0, mt, acc) : FMT == Q6_K ? tile_q6k(rb, a, m0, mt, acc) \
                                                                   : tile_q32(FMT, rb, a, m0, mt, acc))
#else
#define TILE(FMT, mt) tile_portable(FMT, rb, a, m0, mt, acc)
#endif
#define TILE_CASE(FMT, T)                                                                                  \
    do {                                                                                                   \
        TILE(FMT, T);                                                                                      \
        store(acc, T, m0, n0, nr, N, bias, out, out_bf16);                                                 \
    } while (0)
#define ROW_BLOCK(FMT)                                                                                     \
    static __attribute__((noinline)) void row_block_##FMT(const uint8_t *rb, const acts_t *a, int64_t M,  \
                                                          int64_t n0, int nr, int64_t N, const float *bias, \
                                                          void *out, int out_bf16) {                       \
        float acc[MT][RB];                                                                                 \
        int64_t m0 = 0;                                                                                    \
        for (; m0 + MT <= M; m0 += MT) TILE_CASE(FMT, MT);                                                 \
        switch (M - m0) {                                                                                  \
        case 1: TILE_CASE(FMT, 1); break;                                                                  \
        REST_CASES(FMT)                                                                                    \
        default: break;                                                                                    \
        }                                                                                                  \
    }
#if MT > 4
#define REST_CASES(FMT)                                                                                    \
    case 2: TILE_CASE(FMT, 2); break;                                                                      \
    case 3: TILE_CASE(FMT, 3); break;                                                                      \
    case 4: TILE_CASE(FMT, 4); break;                                                                      \
    case 5: TILE_CASE(FMT, 5); break;                                                                      \
    case 6: TILE_CASE(FMT, 6); break;                                                                      \
    case 7: TILE_CASE(FMT, 7); break;
#elif MT > 2
#define REST_CASES(FMT)                                                                                    \
    case 2: TILE_CASE(FMT, 2); break;                                                                      \
    case 3: TILE_CASE(FMT, 3); break;
#else
#define REST_CASES(FMT)
#endif
ROW_BLOCK(Q4_0)
ROW_BLOCK(Q4_1)
ROW_BLOCK(Q5_0)
ROW_BLOCK(Q8_0)
ROW_BLOCK(Q4_K)
ROW_BLOCK(Q6_K)

/* The entry point. x: [M, K] float32 (x_bf16 0) or bfloat16 (1), contiguous; segs: the segment table (see the
 * header); bias: float32 [N] or NULL; out: [M, N] in x's dtype. Returns 0; -1 when scratch memory could not be
 * allocated; -2 for an invalid table (unknown format, K not a multiple of a format's block, more than
 * MAX_SEGMENTS segments, rows not summing to N). */
int gguf_gemm(const void *x, int x_bf16, const int64_t *segs, const float *bias, void *out, int64_t M, int64_t N,
              int64_t K, int64_t num_threads) {
    const int64_t count = segs[0];
    if (count < 1 || count > MAX_SEGMENTS || K % GS) return -2;
    int64_t first_block[MAX_SEGMENTS + 1], first_row[MAX_SEGMENTS + 1], rb_bytes[MAX_SEGMENTS];
    first_block[0] = first_row[0] = 0;
    for (int64_t s = 0; s < count; s++) {
        const int64_t fmt = segs[1 + 3 * s], rows = segs[2 + 3 * s];
        rb_bytes[s] = gguf_rowblock_bytes(fmt, K);
        if (rb_bytes[s] == 0 || rows < 1) return -2;
        first_block[s + 1] = first_block[s] + (rows + RB - 1) / RB;
        first_row[s + 1] = first_row[s] + rows;
    }
    if (first_row[count] != N) return -2;
    const int nthreads = num_threads > 0 ? (int)num_threads : 1;
    const int64_t G = K / GS;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + 64);
    int8_t *xqi = (int8_t *)malloc((size_t)(M * K) + 64);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * G));
    int32_t *xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * G));
    int32_t *xsum16 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * G * 2));
    if (!xq || !xqi || !xs || !xsum || !xsum16) {
        free(xq), free(xqi), free(xs), free(xsum), free(xsum16);
        return -1;
    }
    int8_quantize_rows(x, x_bf16, M, K, K, xq, xs, xsum, nthreads);
    /* tokens in groups of MT (the last one: the rest, w tokens), interleaved per 4 k: token m's codes k .. k + 3
     * at xqi[m0 K + (k / 4) 4 w + 4 (m - m0)], m0 = its group's first token; a tile's broadcasts then read one
     * stream from one base address, and a batch-1 call reads K bytes (not MT K) */
    for (int64_t m = 0; m < M; m++) {
        const int64_t m0 = m / MT * MT, w = M - m0 < MT ? M - m0 : MT;
        for (int64_t k = 0; k < K; k += 4) memcpy(xqi + m0 * K + k * w + 4 * (m - m0), xq + m * K + k, 4);
    }
    for (int64_t h = 0; h < M * G * 2; h++) {
        int32_t t = 0;
        for (int k = 0; k < GS / 2; k++) t += xq[h * (GS / 2) + k];
        xsum16[h] = t;
    }
    const acts_t a = {xq, xqi, xs, xsum, xsum16, K, G};
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < first_block[count]; b++) {
        int64_t s = 0;
        while (b >= first_block[s + 1]) s++;
        const int fmt = (int)segs[1 + 3 * s];
        const int64_t local = b - first_block[s], n0 = first_row[s] + local * RB;
        const int64_t left = segs[2 + 3 * s] - local * RB;
        const int nr = left < RB ? (int)left : RB;
        const uint8_t *rb = (const uint8_t *)(intptr_t)segs[3 + 3 * s] + local * rb_bytes[s];
        switch (fmt) {
        case Q4_0: row_block_Q4_0(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        case Q4_1: row_block_Q4_1(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        case Q5_0: row_block_Q5_0(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        case Q8_0: row_block_Q8_0(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        case Q4_K: row_block_Q4_K(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        default: row_block_Q6_K(rb, &a, M, n0, nr, N, bias, out, x_bf16); break;
        }
    }
    free(xq), free(xqi), free(xs), free(xsum), free(xsum16);
    return 0;
}

/* Which path this build has: 1 = AVX512-VNNI (vpdpbusd), 2 = AVX2 (vpmaddubsw), 0 = portable C. */
int gguf_gemm_features(void) {
#if defined(GG_VNNI)
    return 1;
#elif defined(GG_AVX2)
    return 2;
#else
    return 0;
#endif
}
