/* A whole decode step of a Llama-family decoder in one call (float32 or bfloat16 activations; a KV cache of
 * the activations' dtype or 8-bit (int8 / fp8 rows with scales, kv8.h); float32, bfloat16, int8 weights
 * (int8_gemm.c's packed layout) or GGUF blocks (gguf_gemm.c's segment tables)): every layer's norms, projections, RoPE, KV write, paged attention and MLP.
 *
 * Why: at batch 1 a step is ~300 kernel calls of 20-100 us each. Called one by one from Python, each pays
 * the interpreter's and ctypes' overhead and restarts the memory pipeline (the hardware prefetchers lose
 * the stream during the gap), which cost ~30 % of the step at batch 1 here. Inside one C call the kernels
 * run back to back, as llama.cpp's graph does. The arithmetic is exactly the per-op path's: the same
 * functions (small_gemm, add_rms_norm, rope_write_kv, paged_decode_attention, silu_mul) in the same order,
 * so the two paths give bitwise equal results (tests/unit/test_cpu_kernels.py checks it).
 *
 * Per layer l, for the M decode tokens (one per sequence), with the residual stream `res`:
 *     h = rms_norm(res += x)          (layer 0: res = x)
 *     qkv = h @ Wqkv^T (+ b)          RoPE on q, k; k, v -> cache slots
 *     a = paged_attention(q, cache)   o = a @ Wo^T
 *     h = rms_norm(res += o)          x = down(silu(gate(h)) * up(h))
 * and after the last layer: out = rms_norm(res += x).
 *
 * layer_ptrs: [num_layers, 9] int64 addresses: input_norm_w, qkv_w, qkv_b (0: none), o_w,
 * post_norm_w, gate_up_w, down_w, k_cache, v_cache (the weights: int8_gemm.c's packed buffers for w_fmt 2;
 * for w_fmt 3 gguf_gemm.c's segment tables, which let each projection, and each part of a fused one, have its
 * own block format).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

int small_gemm(const void *x, int x_bf16, const void *w, int w_bf16, const float *bias, void *out,
               int64_t M, int64_t N, int64_t K, int64_t num_threads);
int int8_gemm(const void *x, int x_bf16, const uint8_t *packed, const float *bias, void *out, int64_t M, int64_t N,
              int64_t K, int64_t num_threads);
int gguf_gemm(const void *x, int x_bf16, const int64_t *segs, const float *bias, void *out, int64_t M, int64_t N,
              int64_t K, int64_t num_threads);
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads);
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t M, int64_t H,
                  float eps, int bf16);
void silu_mul(const void *gate_up, void *out, int64_t M, int64_t F, int bf16);
void rope_write_kv(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                   int64_t T, int64_t Hq, int64_t Hk, int64_t D, int bf16, int kv_bf16);
int paged_decode_attention_kv8(const float *q, const void *k_cache, const void *v_cache, int kv_fmt,
                               const int64_t *block_tables, const int64_t *seq_lens, float *out,
                               int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads);
int rope_write_kv8(void *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                   int64_t T, int64_t Hq, int64_t Hk, int64_t D, int bf16, int kv_fmt);

enum { P_IN_NORM, P_QKV_W, P_QKV_B, P_O_W, P_POST_NORM, P_GATE_UP_W, P_DOWN_W, P_K_CACHE, P_V_CACHE, P_COUNT };

#define PTR(l, i) ((void *)(intptr_t)layer_ptrs[(l) * P_COUNT + (i)])

/* One projection: w_fmt 0 float32, 1 bfloat16 (small_gemm.c), 2 int8 (int8_gemm.c), 3 GGUF (gguf_gemm.c). */
static int gemm(const void *x, int act_bf16, const void *w, int w_fmt, const float *bias, void *out, int64_t M,
                int64_t N, int64_t K, int64_t num_threads) {
    if (w_fmt == 2) return int8_gemm(x, act_bf16, (const uint8_t *)w, bias, out, M, N, K, num_threads);
    if (w_fmt == 3) return gguf_gemm(x, act_bf16, (const int64_t *)w, bias, out, M, N, K, num_threads);
    return small_gemm(x, act_bf16, w, w_fmt, bias, out, M, N, K, num_threads);
}

/* x: [M, H] embeddings in the activation dtype (act_bf16: bfloat16, else float32), overwritten (scratch);
 * out: [M, H] final normed hidden, activation dtype. Norm weights have the activation dtype, biases are
 * float32, projection weights float32, bfloat16, int8 or GGUF (w_fmt 0 / 1 / 2 / 3), K/V caches of format kv_fmt
 * (kv_quant.format_code: 0 float32, 1 bfloat16, 2 int8, 3 fp8): the activation dtype, bfloat16 under float32
 * activations (k, v rounded to bf16 as they are written, as torch's `.to()`), or 8-bit (rope_write_kv8 and
 * paged_decode_attention_kv8 instead). As in the per-op
 * path, attention takes q widened to float32 and its output is rounded to the activation dtype.
 * Returns 0, or -1 when scratch memory could not be allocated or a kernel failed. */
int decode_step(void *x, void *out, const int64_t *layer_ptrs, int64_t num_layers, const void *final_norm,
                const int64_t *positions, const int64_t *slot_mapping, const int64_t *block_tables,
                const int64_t *seq_lens, int64_t max_blocks, int64_t block_size, const float *cos_table,
                const float *sin_table, int64_t M, int64_t H, int64_t Hq, int64_t Hk, int64_t D, int64_t F,
                float eps, float scale, int w_fmt, int act_bf16, int kv_fmt, int64_t num_threads) {
    const int64_t qkv_n = (Hq + 2 * Hk) * D, q_n = Hq * D;
    const size_t esz = act_bf16 ? 2 : 4;
    const int kv_bf16 = kv_fmt == 1;
    void *res = malloc(esz * (size_t)(M * H));
    void *h = malloc(esz * (size_t)(M * H));
    void *qkv = malloc(esz * (size_t)(M * qkv_n));
    float *q = (float *)malloc(sizeof(float) * (size_t)(M * q_n));
    float *attn32 = (float *)malloc(sizeof(float) * (size_t)(M * q_n));
    void *attn = act_bf16 ? malloc(esz * (size_t)(M * q_n)) : (void *)attn32;
    void *gu = malloc(esz * (size_t)(M * 2 * F));
    void *act = malloc(esz * (size_t)(M * F));
    int rc = (res && h && qkv && q && attn32 && attn && gu && act) ? 0 : -1;
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        if (l == 0) { /* the embeddings start the residual stream */
            memcpy(res, x, esz * (size_t)(M * H));
            add_rms_norm(x, NULL, PTR(l, P_IN_NORM), h, M, H, eps, act_bf16);
        } else {
            add_rms_norm(x, res, PTR(l, P_IN_NORM), h, M, H, eps, act_bf16);
        }
        rc |= gemm(h, act_bf16, PTR(l, P_QKV_W), w_fmt, (const float *)PTR(l, P_QKV_B), qkv, M, qkv_n, H,
                         num_threads);
        if (kv_fmt >= 2)
            rc |= rope_write_kv8(qkv, qkv_n, positions, cos_table, sin_table, PTR(l, P_K_CACHE), PTR(l, P_V_CACHE),
                                 slot_mapping, M, Hq, Hk, D, act_bf16, kv_fmt);
        else
            rope_write_kv(qkv, qkv_n, positions, cos_table, sin_table, PTR(l, P_K_CACHE), PTR(l, P_V_CACHE),
                          slot_mapping, M, Hq, Hk, D, act_bf16, kv_bf16);
        for (int64_t m = 0; m < M; m++) {
            if (act_bf16) {
                const uint16_t *src = (const uint16_t *)qkv + m * qkv_n;
                for (int64_t i = 0; i < q_n; i++) q[m * q_n + i] = bf16_widen(src[i]);
            } else {
                memcpy(q + m * q_n, (const float *)qkv + m * qkv_n, sizeof(float) * (size_t)q_n);
            }
        }
        if (kv_fmt >= 2)
            rc |= paged_decode_attention_kv8(q, PTR(l, P_K_CACHE), PTR(l, P_V_CACHE), kv_fmt, block_tables, seq_lens,
                                             attn32, M, Hk, Hq / Hk, D, block_size, max_blocks, scale, num_threads);
        else
            rc |= paged_decode_attention(q, PTR(l, P_K_CACHE), PTR(l, P_V_CACHE), kv_bf16, block_tables, seq_lens,
                                         attn32, M, Hk, Hq / Hk, D, block_size, max_blocks, scale, num_threads);
        if (act_bf16)
            for (int64_t i = 0; i < M * q_n; i++) ((uint16_t *)attn)[i] = bf16_narrow(attn32[i]);
        rc |= gemm(attn, act_bf16, PTR(l, P_O_W), w_fmt, NULL, x, M, H, q_n, num_threads);
        add_rms_norm(x, res, PTR(l, P_POST_NORM), h, M, H, eps, act_bf16);
        rc |= gemm(h, act_bf16, PTR(l, P_GATE_UP_W), w_fmt, NULL, gu, M, 2 * F, H, num_threads);
        silu_mul(gu, act, M, F, act_bf16);
        rc |= gemm(act, act_bf16, PTR(l, P_DOWN_W), w_fmt, NULL, x, M, H, F, num_threads);
    }
    if (rc == 0) add_rms_norm(x, res, final_norm, out, M, H, eps, act_bf16);
    if (act_bf16) free(attn);
    free(res), free(h), free(qkv), free(q), free(attn32), free(gu), free(act);
    return rc ? -1 : 0;
}
