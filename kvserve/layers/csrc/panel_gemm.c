/* Linear layer for float32 activations at larger M (batched decode, prefill) on CPUs without bf16 dot products:
 * out[M, N] = x[M, K] @ w[N, K]^T (+ bias), w float32 or bfloat16 (widened in cache, never in memory).
 *
 * Why: on an AVX2 host a bf16 model keeps its weights in bf16 (half the bytes at decode) and computes in
 * float32. Above small_gemm's M, F.linear needs a float32 copy of the weight per call: 3x the weight's bytes
 * through memory (read bf16, write and re-read fp32), ~20 % of a batch-64 step (docs/performance-log.md).
 * Here each thread widens a tile of NR weight rows into an L1 scratch, once per call, and multiplies it with
 * every token: the weight crosses the memory bus once, as bf16.
 *
 *     x is packed once per call into panels of 16 tokens, k-major: xp[p][k][0..16) = x[16p .. 16p+16, k]
 *     for each tile of NR = 6 output rows (split over OpenMP threads):
 *         wt[r][k] = float(w[n0 + r, k])                        (6 x K floats, L1/L2)
 *         for each panel p:                                       12 accumulators = 6 rows x 16 tokens
 *             acc[r][0..16) += wt[r][k] * xp[p][k][0..16)  for k = 0..K-1
 *             out[16p + i, n0 + r] = acc[r][i] (+ bias[n0 + r])
 *
 * The inner loop is a broadcast of wt[r][k] times two 8-float vectors of xp: 12 FMAs per 2 vector loads and
 * 6 broadcast loads (the BLIS micro-kernel shape, Van Zee & van de Geijn 2015, transposed so that the
 * bf16 operand is the one widened per tile). Written with GCC vector extensions (8 floats): AVX2 + FMA
 * where the build has it, two SSE halves otherwise. Accumulation is float32 in k order: each output equals
 * a float32 dot product, tested against float64 F.linear to 1e-5 relative. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 6   /* weight rows per tile */
#define MP 16  /* tokens per x panel */

typedef float v8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8 ld8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) v8 bcast(float f) {
    return (v8){f, f, f, f, f, f, f, f}; /* one vbroadcastss from memory ((v8){0} + f would add a zero first) */
}

/* xp [P][K][MP] from x [M][K] (rows past M are zeros) */
static void pack_x(const float *x, float *xp, int64_t M, int64_t K, int64_t p) {
    float *dst = xp + p * K * MP;
    const int64_t m0 = p * MP, rows = M - m0 < MP ? M - m0 : MP;
    if (rows < MP) memset(dst, 0, sizeof(float) * (size_t)(K * MP));
    for (int64_t i = 0; i < rows; i++) {
        const float *src = x + (m0 + i) * K;
        for (int64_t k = 0; k < K; k++) dst[k * MP + i] = src[k];
    }
}

/* wt [NR][K] float32 from rows n0 .. n0 + NR of w (rows past N are zeros) */
static void load_tile(const void *w, int w_bf16, float *wt, int64_t n0, int64_t N, int64_t K) {
    const int64_t rows = N - n0 < NR ? N - n0 : NR;
    for (int64_t r = 0; r < rows; r++) {
        float *dst = wt + r * K;
        if (w_bf16) {
            const uint16_t *src = (const uint16_t *)w + (n0 + r) * K;
            for (int64_t k = 0; k < K; k++) dst[k] = bf16_widen(src[k]);
        } else {
            memcpy(dst, (const float *)w + (n0 + r) * K, sizeof(float) * (size_t)K);
        }
    }
    if (rows < NR) memset(wt + rows * K, 0, sizeof(float) * (size_t)((NR - rows) * K));
}

/* one tile x one panel: acc [NR][MP] = wt [NR][K] . xp_p [K][MP], stored to out (bias added) */
static inline void micro(const float *restrict wt, const float *restrict xp, int64_t K, float *out, int64_t N,
                         int64_t n0, int64_t m0, int64_t M, const float *bias) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0};
    for (int64_t k = 0; k < K; k++) {
        const v8 x0 = ld8(xp + k * MP), x1 = ld8(xp + k * MP + 8);
        v8 s;
        s = bcast(wt[k]);         a0 += s * x0; b0 += s * x1;
        s = bcast(wt[K + k]);     a1 += s * x0; b1 += s * x1;
        s = bcast(wt[2 * K + k]); a2 += s * x0; b2 += s * x1;
        s = bcast(wt[3 * K + k]); a3 += s * x0; b3 += s * x1;
        s = bcast(wt[4 * K + k]); a4 += s * x0; b4 += s * x1;
        s = bcast(wt[5 * K + k]); a5 += s * x0; b5 += s * x1;
    }
    float acc[NR][MP];
    memcpy(acc[0], &a0, 32); memcpy(acc[0] + 8, &b0, 32);
    memcpy(acc[1], &a1, 32); memcpy(acc[1] + 8, &b1, 32);
    memcpy(acc[2], &a2, 32); memcpy(acc[2] + 8, &b2, 32);
    memcpy(acc[3], &a3, 32); memcpy(acc[3] + 8, &b3, 32);
    memcpy(acc[4], &a4, 32); memcpy(acc[4] + 8, &b4, 32);
    memcpy(acc[5], &a5, 32); memcpy(acc[5] + 8, &b5, 32);
    const int64_t rows = N - n0 < NR ? N - n0 : NR, toks = M - m0 < MP ? M - m0 : MP;
    for (int64_t i = 0; i < toks; i++) {
        float *o = out + (m0 + i) * N + n0;
        for (int64_t r = 0; r < rows; r++) o[r] = acc[r][i] + (bias ? bias[n0 + r] : 0.f);
    }
}

/* Which builds route to it: small_gemm_features() bit 4 (small_gemm.c's PANEL_PATH). */
/* x [M, K] float32; w [N, K] float32 (w_bf16 0) or bfloat16 (1); bias [N] float32 or NULL; out [M, N] float32.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int panel_gemm(const float *x, const void *w, int w_bf16, const float *bias, float *out, int64_t M, int64_t N,
               int64_t K, int64_t num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t P = (M + MP - 1) / MP, tiles = (N + NR - 1) / NR;
    int nt = num_threads > 0 ? (int)num_threads : 1;
    if (nt > tiles) nt = (int)tiles;
    const size_t bytes = sizeof(float) * (size_t)(P * K * MP + (int64_t)nt * NR * K);
    float *xp = (float *)aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (xp == NULL) return -1;
    float *wts = xp + P * K * MP;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        float *wt = wts + (int64_t)omp_get_thread_num() * NR * K;
#else
        float *wt = wts;
#endif
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) pack_x(x, xp, M, K, p);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            load_tile(w, w_bf16, wt, t * NR, N, K);
            for (int64_t p = 0; p < P; p++) micro(wt, xp + p * K * MP, K, out, N, t * NR, p * MP, M, bias);
        }
    }
    free(xp);
    return 0;
}
