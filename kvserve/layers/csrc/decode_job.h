/* The decode-attention job shared by paged_attention.c (entry point, scalar and AVX-512 paths) and
 * paged_attention_avx2.c: the arguments of `paged_decode_attention`, layouts as documented there. */
#ifndef KVSERVE_DECODE_JOB_H
#define KVSERVE_DECODE_JOB_H

#include <stdint.h>

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks;
    float scale;
} job_t;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_DECODE 1
/* paged_attention_avx2.c; max_len = the longest seq_len; returns 0, or -1 when scratch memory ran out. */
int decode_attention_avx2(const job_t *j, int kv_bf16, int64_t max_len, int nt);
#endif

#endif
