/* Small-M linear layer for CPU decode: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), M = 1..16.
 *
 * At batch 1..8 a linear reads every weight once and does 2·M FLOPs per weight: it is bound by memory
 * bandwidth, not arithmetic. Framework GEMMs (oneDNN / MKL via F.linear) are tuned for large M and read
 * the weights at ~40 % of the machine's bandwidth at M = 1 (docs/performance-log.md); this kernel streams
 * them at the bandwidth instead.
 *
 * Layout: w is the plain row-major nn.Linear weight [N, K] (no packed copy, so F.linear shares it for
 * large M). Output rows are taken R = 4 at a time: the 4 weight rows are read as 4 sequential streams
 * (with a software prefetch well ahead, see PREFETCH) and each weight vector loaded is multiplied with MT token rows
 * of x held in registers, so weights cross the memory bus once per step:
 *
 *     for each tile of 4 output rows (split over OpenMP threads):
 *         for each group of MT tokens:          # weights re-read from L1/L2, not from memory
 *             acc[4][MT] += w[4 rows, k:k+VW] * x[MT rows, k:k+VW]     (VW = 8 on AVX2, 16 on AVX-512)
 *
 * That tile loop is the portable path (and the reference's twin in the tests); the builds for the CPUs we measure
 * stream one row at a time instead, each thread over a contiguous range of rows (one sequential stream per
 * thread, which the hardware prefetchers follow): AVX512-BF16 builds with bf16 activations (gemm_dpbf16_rows) and
 * AVX2 builds with float32 activations below ROW_AVX2_MAX_M tokens (gemm_rows_avx2).
 *
 * Weight dtypes: float32, or bfloat16 widened to float32 in registers (a bf16 value is the top half of
 * an fp32: shift left 16), which halves the bytes read. With AVX512-BF16 and bf16 activations, pairs are
 * multiplied by `vdpbf16ps` (x rounded to bf16, as a bf16 model's activations already are).
 * Accumulation is float32 in every path. Activations (x, out) are float32 or bfloat16; a bf16 x is
 * widened to a float32 scratch copy first (M·K values, small), and outputs are rounded to nearest even.
 *
 * Threads: OpenMP, linked against the runtime torch already loaded (same soname), so torch's
 * set_num_threads governs both and no second thread pool spins.
 * Reference: torch.nn.functional.linear is the oracle (tests/unit/test_cpu_kernels.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_util.h"
#include "avx512_util.h"
#include "bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define MT_MAX 4 /* 32 vector registers: 16 accumulators + 4 weights + x */
#else
#define VW 8
#define MT_MAX 2 /* 16 vector registers: 8 accumulators + 4 weights + x */
#endif
#define R 4
/* Software prefetch distance in bytes along each weight row: the 4 interleaved row streams defeat part of
 * the hardware prefetcher; 8 KiB ahead measured best at M = 1 (77-80 % of the read bandwidth vs 55-70 %
 * without, AVX2 host; prefetching past a row's end is harmless). */
#ifndef PREFETCH
#define PREFETCH 8192
#endif
/* The same for the single-stream row loops (gemm_dpbf16), with the non-temporal hint (prefetchnta): each weight
 * line is read once per step, so it should not evict what the rest of the step reuses from L2/L3 (the
 * engine's Python, the KV cache, activations). Measured in one process alternating the two builds every 40
 * batch-1 steps (SmolLM2 bf16, 2 threads, Zen 5): steps 0.94x and 0.98x the T0-hint build's in two runs of
 * 16 / 24 pairs (faster in 11 / 16 of the pairs). */
#ifndef PREFETCH_ROW
#define PREFETCH_ROW 4096
#endif
/* The row loop prefetches only from this many tokens M up: below it the hardware prefetcher alone streams
 * faster on some cores (Zen 4: M = 1-3 read 10-25 % faster without, M = 4-8 5-20 % slower; see
 * cpu_kernels.row_prefetch_min_m, which sets it per CPU). */
#ifndef ROW_PREFETCH_MIN_M
#define ROW_PREFETCH_MIN_M 1
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));

static inline __attribute__((always_inline)) vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

/* One tile: output columns [n0, n0 + nr) from weight rows [wn0, wn0 + nr) of w (w may be a scratch copy of
 * the tile, then wn0 = 0), tokens [m0, m0 + mt) of x (fp32, row stride K).
 * nr <= R and mt <= MT_MAX are compile-time constants at every call site below. */
static inline __attribute__((always_inline)) void tile(const float *x, const void *w, int wbf16, int64_t K,
                                                       int64_t wn0, int64_t n0, int nr, int64_t m0, int mt,
                                                       float *out, int64_t N, const float *bias) {
    vf acc[R][4]; /* mt <= MT_MAX <= 4 */
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = (vf){0};
    const float *wf = (const float *)w;
    const uint16_t *wh = (const uint16_t *)w;
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf wv[R];
        for (int r = 0; r < nr; r++) __builtin_prefetch((const char *)w + ((wn0 + r) * K + k) * (wbf16 ? 2 : 4) + PREFETCH);
        for (int r = 0; r < nr; r++)
            wv[r] = wbf16 ? load_bf16(wh + (wn0 + r) * K + k) : load_f32(wf + (wn0 + r) * K + k);
        for (int m = 0; m < mt; m++) {
            vf xv = load_f32(x + (m0 + m) * K + k);
            for (int r = 0; r < nr; r++) acc[r][m] += wv[r] * xv;
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int m = 0; m < mt; m++) {
            float s = hsum(acc[r][m]);
            for (int64_t kk = k; kk < K; kk++) {
                float wk = wbf16 ? bf16_widen(wh[(wn0 + r) * K + kk]) : wf[(wn0 + r) * K + kk];
                s += wk * x[(m0 + m) * K + kk];
            }
            out[(m0 + m) * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

/* bf16 weights, up to MT_MAX tokens: 2·VW weights per load, widened without shuffles. A 32-bit lane holding the
 * bf16 pair (w[2j], w[2j+1]) gives w[2j] as `lane << 16` and w[2j+1] as `lane & 0xffff0000`; x was
 * permuted once per call to match (`xp`: per chunk of 2·VW, the even-index values then the odd ones).
 * The tail (K % 2·VW) is summed from the unpermuted x. */
static inline __attribute__((always_inline)) void tile_bf16(const float *x, const float *xp, const uint16_t *w,
                                                            int64_t K, int64_t n0, int nr, int64_t m0, int mt,
                                                            float *out, int64_t N, const float *bias) {
    vf acc[R][4];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = (vf){0};
    const vu hi_mask = (vu){0} + 0xffff0000u;
    int64_t k = 0;
    for (; k + 2 * VW <= K; k += 2 * VW) {
        vf we[R], wo[R];
        for (int r = 0; r < nr; r++) __builtin_prefetch((const char *)(w + (n0 + r) * K + k) + PREFETCH);
        for (int r = 0; r < nr; r++) {
            vu u;
            memcpy(&u, w + (n0 + r) * K + k, sizeof u);
            we[r] = (vf)(u << 16);
            wo[r] = (vf)(u & hi_mask);
        }
        for (int m = 0; m < mt; m++) {
            const vf xe = load_f32(xp + (m0 + m) * K + k), xo = load_f32(xp + (m0 + m) * K + k + VW);
            for (int r = 0; r < nr; r++) acc[r][m] += we[r] * xe + wo[r] * xo;
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int m = 0; m < mt; m++) {
            float s = hsum(acc[r][m]);
            for (int64_t kk = k; kk < K; kk++) s += bf16_widen(w[(n0 + r) * K + kk]) * x[(m0 + m) * K + kk];
            out[(m0 + m) * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

#define TILE_CASES(W, WB, WN0)                                                                              \
    do {                                                                                                    \
        int64_t m0 = 0;                                                                                     \
        for (; m0 + MT_MAX <= M; m0 += MT_MAX) tile(x, W, WB, K, WN0, n0, R, m0, MT_MAX, out, N, bias);     \
        switch (M - m0) {                                                                                   \
        case 1: tile(x, W, WB, K, WN0, n0, R, m0, 1, out, N, bias); break;                                  \
        case 2: tile(x, W, WB, K, WN0, n0, R, m0, 2, out, N, bias); break;                                  \
        case 3: tile(x, W, WB, K, WN0, n0, R, m0, 3, out, N, bias); break;                                  \
        default: break;                                                                                     \
        }                                                                                                   \
    } while (0)

#define TILE_BF16_CASES()                                                                                   \
    do {                                                                                                    \
        const uint16_t *wh = (const uint16_t *)w;                                                           \
        int64_t m0 = 0;                                                                                     \
        for (; m0 + MT_MAX <= M; m0 += MT_MAX) tile_bf16(x, xp, wh, K, n0, R, m0, MT_MAX, out, N, bias);    \
        switch (M - m0) {                                                                                   \
        case 1: tile_bf16(x, xp, wh, K, n0, R, m0, 1, out, N, bias); break;                                 \
        case 2: tile_bf16(x, xp, wh, K, n0, R, m0, 2, out, N, bias); break;                                 \
        case 3: tile_bf16(x, xp, wh, K, n0, R, m0, 3, out, N, bias); break;                                 \
        default: break;                                                                                     \
        }                                                                                                   \
    } while (0)

/* xp: x permuted for the bf16-weight tiles (see tile_bf16); NULL with float32 weights. */
static void gemm_f32x(const float *x, const float *xp, const void *w, int wbf16, const float *bias, float *out,
                      int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t tiles = N / R;
    /* Each 4-row weight tile is read from memory once; with M > MT_MAX the next groups of tokens re-read
     * it from L1 (bf16 tiles are widened again in registers: cheaper than a scratch copy). */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * R;
        if (wbf16) TILE_BF16_CASES();
        else TILE_CASES(w, 0, n0);
    }
    for (int64_t n0 = tiles * R; n0 < N; n0++) /* the last N % 4 rows, one at a time */
        for (int64_t m = 0; m < M; m++) {
            if (wbf16) tile(x, w, 1, K, n0, n0, 1, m, 1, out, N, bias);
            else tile(x, w, 0, K, n0, n0, 1, m, 1, out, N, bias);
        }
}

#if defined(__AVX512BF16__)
/* bf16 x bf16 -> fp32 with vdpbf16ps, one weight row at a time for up to 4 tokens (8 accumulators: two
 * per token, 64 bf16 per step). Rows are streamed one after the other, each thread over a contiguous
 * range of rows, so the weights are read as one sequential stream per thread: measured on Zen 4 this
 * reads at the machine's bandwidth where 4 interleaved row streams (the tile loops above) reach ~45 % of
 * it. A token group past the first re-reads the row (<= a few KiB) from L1. K's tail is masked. */
static inline __attribute__((always_inline)) void row_dpbf16(const uint16_t *xh, const uint16_t *wr, int64_t K,
                                                             int64_t m0, int mt, int pf, float *acc_out) {
    __m512 a0[4], a1[4];
    for (int m = 0; m < mt; m++) a0[m] = _mm512_setzero_ps(), a1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (pf) {
            __builtin_prefetch((const char *)(wr + k) + PREFETCH_ROW, 0, 0); /* NTA: see PREFETCH_ROW */
            __builtin_prefetch((const char *)(wr + k) + PREFETCH_ROW + 64, 0, 0);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
        for (int m = 0; m < mt; m++) {
            const uint16_t *xr = xh + (m0 + m) * K + k;
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(xr));
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
    }
    for (; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
        for (int m = 0; m < mt; m++)
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, xh + (m0 + m) * K + k));
    }
    for (int m = 0; m < mt; m++) acc_out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}

/* A 4-row x 4-token tile: acc[r][m] = w[n0 + r] . x[m0 + m] over K, 16 accumulators, so each weight and x
 * vector loaded feeds 4 `vdpbf16ps` (the row loop above loads x once per product: at M >= 8 it is bound
 * by loads, ~50 % of the bf16 peak; this tile is bound by the dot products). The next tile's rows are
 * prefetched as this one streams. Outputs: out[(m0 + m) * N + n0 + r] + bias; K's tail masked. */
static inline __attribute__((always_inline)) void tile4x4_dpbf16(const uint16_t *xh, const uint16_t *w, const float *bias,
                                                                 float *out, int64_t N, int64_t K, int64_t n0, int64_t m0,
                                                                 int nr, int mt) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint16_t *wr = w + n0 * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4], xv[4];
        for (int r = 0; r < nr; r++) {
            __builtin_prefetch((const char *)(wr + (4 + r) * K + k));
            wv[r] = (__m512bh)_mm512_loadu_si512(wr + r * K + k);
        }
        for (int m = 0; m < mt; m++) xv[m] = (__m512bh)_mm512_loadu_si512(xh + (m0 + m) * K + k);
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mt; m++) acc[4 * m + r] = _mm512_dpbf16_ps(acc[4 * m + r], wv[r], xv[m]);
    }
    if (k < K) {
        const __mmask32 mask = (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[4], xv[4];
        for (int r = 0; r < nr; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + r * K + k);
        for (int m = 0; m < mt; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xh + (m0 + m) * K + k);
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mt; m++) acc[4 * m + r] = _mm512_dpbf16_ps(acc[4 * m + r], wv[r], xv[m]);
    }
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(acc));
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < nr; r++) out[(m0 + m) * N + n0 + r] = sums[4 * m + r] + (bias ? bias[n0 + r] : 0.f);
}

#define TILE4X4(NR, MT) tile4x4_dpbf16(xh, w, bias, out, N, K, n0, m0, NR, MT)

/* bf16 x bf16 at M >= TILE_M_MIN (the crossover with the row loop measured on Zen 4: M = 12 with 1 thread,
 * 9-10 with 2, weighted by SmolLM2's layer shapes; at M = 16 the tiles run 140-160 GFLOP/s against 80-125
 * on 1 thread, at M = 32 140-167 against 72-102): 4 x 4
 * tiles, threads over groups of 4 rows (each thread's rows are one contiguous run of the weight). */
#ifndef TILE_M_MIN
#define TILE_M_MIN 10
#endif
static void gemm_dpbf16_tiles(const uint16_t *xh, const uint16_t *w, const float *bias, float *out, int64_t M,
                              int64_t N, int64_t K, int nthreads) {
    const int64_t tiles = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = 4 * t;
        const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mt = M - m0 < 4 ? (int)(M - m0) : 4;
            if (nr == 4) {
                switch (mt) {
                case 1: TILE4X4(4, 1); break;
                case 2: TILE4X4(4, 2); break;
                case 3: TILE4X4(4, 3); break;
                default: TILE4X4(4, 4); break;
                }
            } else {
                switch (nr) {
                case 1: TILE4X4(1, 4 < mt ? 4 : mt); break;
                case 2: TILE4X4(2, 4 < mt ? 4 : mt); break;
                default: TILE4X4(3, 4 < mt ? 4 : mt); break;
                }
            }
        }
    }
}

/* The row loop (M < TILE_M_MIN); pf: software-prefetch the weight rows (a constant at each call site). */
static inline __attribute__((always_inline)) void gemm_dpbf16_rows(const uint16_t *xh, const uint16_t *w,
                                                                   const float *bias, float *out, int64_t M, int64_t N,
                                                                   int64_t K, int nthreads, int pf) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            float acc[4];
            const int64_t mt = M - m0 < 4 ? M - m0 : 4;
            switch (mt) {
            case 1: row_dpbf16(xh, wr, K, m0, 1, pf, acc); break;
            case 2: row_dpbf16(xh, wr, K, m0, 2, pf, acc); break;
            case 3: row_dpbf16(xh, wr, K, m0, 3, pf, acc); break;
            default: row_dpbf16(xh, wr, K, m0, 4, pf, acc); break;
            }
            for (int64_t m = 0; m < mt; m++) out[(m0 + m) * N + n] = acc[m] + b;
        }
    }
}

static void gemm_dpbf16(const uint16_t *xh, const uint16_t *w, const float *bias, float *out, int64_t M,
                        int64_t N, int64_t K, int nthreads) {
    if (M >= TILE_M_MIN) {
        gemm_dpbf16_tiles(xh, w, bias, out, M, N, K, nthreads);
        return;
    }
    if (M >= ROW_PREFETCH_MIN_M) gemm_dpbf16_rows(xh, w, bias, out, M, N, K, nthreads, 1);
    else gemm_dpbf16_rows(xh, w, bias, out, M, N, K, nthreads, 0);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define ROW_AVX2 1
/* AVX2 builds, float32 activations, M < ROW_AVX2_MAX_M: one weight row at a time for up to 4 tokens, each
 * thread over a contiguous range of rows, so each thread reads its weights as one sequential stream (the same
 * finding as gemm_dpbf16_rows on Zen 4). Measured on Zen 3 (2 vCPUs, 2 threads, SmolLM2's 121 bf16 GEMVs of a
 * step, 269 MB, M = 1): 7.0 ms against 9.6 ms for the 4-row tiles above, 83-86 % of a pure vector read
 * of the same bytes; 1 thread on the LM head: 21 vs 14 GB/s (a pure read: 23). A T0 prefetch ROW_PF_AVX2 bytes
 * ahead (one per 64-byte line) measured best (0: 0.96x its speed, 2 KiB 0.85x).
 * bf16 weights use tile_bf16's even/odd widening against the permuted x (xp); float32 weights plain loads.
 * M = 1 keeps 4 accumulators (two 32-weight chunks per iteration) so that the FMA latency chains do not
 * bound the stream; more tokens keep 2 per token. */
#ifndef ROW_PF_AVX2
#define ROW_PF_AVX2 1024
#endif
#ifndef ROW_AVX2_MAX_M
#define ROW_AVX2_MAX_M 12
#endif
/* acc_out[m] = w_row . x[m0 + m] for m < mt (mt <= 4, a constant at each call site). x: float32 rows (stride K);
 * xp: x permuted as tile_bf16 expects (bf16 weights only). */
static inline __attribute__((always_inline)) void row_avx2(const float *x, const float *xp, const void *wrow,
                                                           int wbf16, int64_t K, int64_t m0, int mt,
                                                           float *acc_out) {
    __m256 a[4][2];
    for (int m = 0; m < mt; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    if (wbf16) {
        const uint16_t *w = (const uint16_t *)wrow;
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        if (mt == 1) { /* 32 weights per iteration, 4 accumulators */
            __m256 c0 = _mm256_setzero_ps(), c1 = c0;
            const float *xr = xp + m0 * K;
            for (; k + 32 <= K; k += 32) {
                _mm_prefetch((const char *)(w + k) + ROW_PF_AVX2, _MM_HINT_T0);
                const __m256i u = _mm256_loadu_si256((const __m256i *)(w + k));
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k + 16));
                a[0][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), _mm256_loadu_ps(xr + k), a[0][0]);
                a[0][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u, hi)), _mm256_loadu_ps(xr + k + 8), a[0][1]);
                c0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xr + k + 16), c0);
                c1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), _mm256_loadu_ps(xr + k + 24), c1);
            }
            a[0][0] = _mm256_add_ps(a[0][0], c0);
            a[0][1] = _mm256_add_ps(a[0][1], c1);
        }
        for (; k + 16 <= K; k += 16) {
            if (mt > 1 && (k & 31) == 0) _mm_prefetch((const char *)(w + k) + ROW_PF_AVX2, _MM_HINT_T0);
            const __m256i u = _mm256_loadu_si256((const __m256i *)(w + k));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(u, hi));
            for (int m = 0; m < mt; m++) {
                const float *xr = xp + (m0 + m) * K + k;
                a[m][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xr), a[m][0]);
                a[m][1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xr + 8), a[m][1]);
            }
        }
        for (int m = 0; m < mt; m++) {
            float s = hsum8(_mm256_add_ps(a[m][0], a[m][1]));
            for (int64_t kk = k; kk < K; kk++) s += bf16_widen(w[kk]) * x[(m0 + m) * K + kk];
            acc_out[m] = s;
        }
    } else {
        const float *w = (const float *)wrow;
        for (; k + 16 <= K; k += 16) {
            _mm_prefetch((const char *)(w + k) + ROW_PF_AVX2, _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
            for (int m = 0; m < mt; m++) {
                const float *xr = x + (m0 + m) * K + k;
                a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[m][0]);
                a[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[m][1]);
            }
        }
        for (int m = 0; m < mt; m++) {
            float s = hsum8(_mm256_add_ps(a[m][0], a[m][1]));
            for (int64_t kk = k; kk < K; kk++) s += w[kk] * x[(m0 + m) * K + kk];
            acc_out[m] = s;
        }
    }
}

static void gemm_rows_avx2(const float *x, const float *xp, const void *w, int wbf16, const float *bias,
                           float *out, int64_t M, int64_t N, int64_t K, int nthreads) {
    const size_t row_bytes = (size_t)K * (wbf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const void *wr = (const char *)w + (size_t)n * row_bytes;
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            float acc[4];
            switch (M - m0 < 4 ? M - m0 : 4) {
            case 1: row_avx2(x, xp, wr, wbf16, K, m0, 1, acc); break;
            case 2: row_avx2(x, xp, wr, wbf16, K, m0, 2, acc); break;
            case 3: row_avx2(x, xp, wr, wbf16, K, m0, 3, acc); break;
            default: row_avx2(x, xp, wr, wbf16, K, m0, 4, acc); break;
            }
            for (int64_t m = 0; m < 4 && m0 + m < M; m++) out[(m0 + m) * N + n] = acc[m] + b;
        }
    }
}

#define PANEL_PATH 1
/* From this many float32 token rows on, an AVX2 build hands the product to panel_gemm.c: its 6 x 16
 * register tiles reuse each weight value for 16 tokens where the tiles here hold 2, and at M = 12 that
 * overtakes reading the weight once (SmolLM2's linears, 2 threads, Zen 3: 28 vs 33 ms at M = 12, 28 vs
 * 21 ms at M = 8; docs/performance-log.md). */
#define PANEL_MIN_M 12
int panel_gemm(const float *x, const void *w, int w_bf16, const float *bias, float *out, int64_t M, int64_t N,
               int64_t K, int64_t num_threads);
#endif

/* Scratch rows on 64-byte lines: a 32-byte vector load from a 16-byte aligned malloc block splits across two
 * cache lines every other load. */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }

/* The entry point. x_dtype / w_dtype / out follow: 0 = float32, 1 = bfloat16 (out has x's dtype).
 * bias: float32 [N] or NULL. Returns 0, or -1 when scratch memory could not be allocated. */
int small_gemm(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *out,
               int64_t M, int64_t N, int64_t K, int64_t num_threads) {
#ifdef PANEL_PATH
    if (!x_bf16 && M >= PANEL_MIN_M) return panel_gemm((const float *)x, w, w_bf16, bias, (float *)out, M, N, K, num_threads);
#endif
    const int nthreads = num_threads > 0 ? (int)num_threads : 1;
    float *out_f = x_bf16 ? (float *)malloc(sizeof(float) * (size_t)(M * N)) : (float *)out;
    if (out_f == NULL) return -1;
#if defined(__AVX512BF16__)
    if (x_bf16 && w_bf16) {
        gemm_dpbf16((const uint16_t *)x, (const uint16_t *)w, bias, out_f, M, N, K, nthreads);
        goto convert_out;
    }
#endif
    {
        const float *xf = (const float *)x;
        float *scratch = NULL;
        if (x_bf16) {
            scratch = (float *)alloc64(sizeof(float) * (size_t)(M * K));
            if (scratch == NULL) { free(out_f); return -1; }
            const uint16_t *xh = (const uint16_t *)x;
            for (int64_t i = 0; i < M * K; i++) scratch[i] = bf16_widen(xh[i]);
            xf = scratch;
        }
        float *xp = NULL; /* x permuted for the bf16-weight tiles (see tile_bf16) */
        if (w_bf16) {
            xp = (float *)alloc64(sizeof(float) * (size_t)(M * K));
            if (xp == NULL) { free(scratch); if (x_bf16) free(out_f); return -1; }
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c + 2 * VW <= K; c += 2 * VW)
                    for (int64_t j = 0; j < VW; j++) {
                        xp[m * K + c + j] = xf[m * K + c + 2 * j];
                        xp[m * K + c + VW + j] = xf[m * K + c + 2 * j + 1];
                    }
        }
#ifdef ROW_AVX2
        if (M < ROW_AVX2_MAX_M) gemm_rows_avx2(xf, xp, w, w_bf16, bias, out_f, M, N, K, nthreads);
        else
#endif
        gemm_f32x(xf, xp, w, w_bf16, bias, out_f, M, N, K, nthreads);
        free(xp);
        free(scratch);
    }
#if defined(__AVX512BF16__)
convert_out:
#endif
    if (x_bf16) {
        uint16_t *oh = (uint16_t *)out;
        for (int64_t i = 0; i < M * N; i++) oh[i] = bf16_narrow(out_f[i]);
        free(out_f);
    }
    return 0;
}

/* Which paths this build has, as bit flags: 1 = AVX-512 vectors, 2 = AVX512-BF16 dot products. */
int small_gemm_features(void) {
    int f = 0;
#if defined(__AVX512F__)
    f |= 1;
#endif
#if defined(__AVX512BF16__)
    f |= 2;
#endif
#ifdef PANEL_PATH
    f |= 4; /* float32 rows from PANEL_MIN_M on go to panel_gemm */
#endif
    return f;
}
