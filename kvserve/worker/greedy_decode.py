"""Greedy decode steps on CPU in four native calls, with no torch op and no per-step tensor.

Why: at batch 1 on the 2-vCPU Zen 4 host the Python and torch glue around the native kernels took ~1.0 ms of
a 7.1 ms step (window s29). In a loop with warm caches the same glue costs ~0.25 ms: every step streams
~270 MB of weights, which evicts the interpreter's and torch's working set, so each torch op (dispatch,
allocation, a tensor object) pays cache misses. The bulk was torch work: the embedding lookup and its cast,
five input arrays wrapped as tensors, the attention metadata, the logits' copy to float32, the sampler's
metadata and ``torch.argmax`` (45-85 us for one 49,152-entry row).

For a step where every scheduled row is one decode token of a request that samples greedily with nothing
that edits its logits (no logprobs, penalties, logit bias, allowed or bad words, structured output, pending
``min_tokens``), :class:`GreedyDecode` writes the step's inputs into numpy buffers it keeps, then runs
``embed_rows`` -> ``decode_step`` -> ``small_gemm`` (the LM head, into a kept buffer) -> ``argmax_rows``.

It returns the same token ids as the general path (``ModelRunner._execute``) bit for bit: the same kernels on
the same inputs in the same dtype. The general path's LM head is ``small_gemm`` too at these batch sizes
(``Linear.forward``), its logits are widened to float32 exactly before the sampler's argmax, and
``argmax_rows`` follows ``torch.argmax``'s rules (tests/unit/test_greedy_decode.py compares the two paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from torch import nn

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers import cpu_kernels
from kvserve.layers.linear import Linear, small_m_max
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.logits_processor import LogitsProcessors
from kvserve.sampling_params import SamplingParams

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def plain_greedy(params: SamplingParams) -> bool:
    """True when a request's next token is the plain argmax of the model's logits, whatever else is in the
    batch: greedy, no logprobs or prompt logprobs to report, no penalty (logit-editing processors and
    ``min_tokens`` are checked per step by :meth:`GreedyDecode.eligible`)."""
    return (params.greedy and params.logprobs is None and params.prompt_logprobs is None
            and params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1)


class GreedyDecode:
    """The runner's native greedy decode path for one model and its KV cache (see the module docstring).

    Args:
        model: a model for which ``native_greedy_decode_ok(kv_caches)`` holds.
        kv_caches: the runner's paged KV cache, per layer ``(k, v)``.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCache) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.dtype = model.compute_dtype
        self.max_rows = small_m_max(self.dtype)
        # (the parameters themselves: the same tensors as long as the model lives)
        emb = self.embedding = cast(nn.Embedding, model.embed_tokens).weight
        head = self.head = cast(Linear, model.lm_head).weight
        self.hidden_size, self.vocab_rows = int(emb.shape[1]), int(head.shape[0])
        self.x = torch.empty(self.max_rows, self.hidden_size, dtype=self.dtype)  # embeddings (and scratch)
        self.hidden = torch.empty_like(self.x)
        self.logits = torch.empty(self.max_rows, self.vocab_rows, dtype=self.dtype)
        self.ids = np.zeros(self.max_rows, dtype=np.int64)
        self.positions = np.zeros(self.max_rows, dtype=np.int64)
        self.slots = np.zeros(self.max_rows, dtype=np.int64)
        self.seq_lens = np.zeros(self.max_rows, dtype=np.int64)
        self.tokens = np.zeros(self.max_rows, dtype=np.int64)
        self.tables = np.zeros(self.max_rows * 64, dtype=np.int64)  # [rows, max_blocks] views; grows on demand
        self.bf16 = int(self.dtype == torch.bfloat16)
        self.emb_bf16 = int(emb.dtype == torch.bfloat16)
        self.head_bf16 = int(head.dtype == torch.bfloat16)

    def eligible(self, scheduled: Sequence[ScheduledRequest], processors: LogitsProcessors) -> bool:
        """Whether this step can take the path: 1..``max_rows`` rows, each one token that samples (no draft
        tokens) of a :func:`plain_greedy` request past its ``min_tokens``, no logits processor acting on any of
        them, and the model's fused decode switched on."""
        if not 0 < len(scheduled) <= self.max_rows or not self.model.fuse_decode:
            return False
        for s in scheduled:
            if s.num_scheduled_tokens != 1 or not s.sample or s.draft_token_ids:
                return False
            r = s.request
            if not plain_greedy(r.sampling_params) or len(r.output_token_ids) < r.sampling_params.min_tokens:
                return False
        return not processors.act_on_any([s.request for s in scheduled])

    def run(self, scheduled: Sequence[ScheduledRequest]) -> list[int]:
        """Compute the step (this step's K/V are written to the cache) and return each row's next token id.

        Raises:
            IndexError: a token id outside the embedding table. RuntimeError: a kernel failed.
        """
        m = len(scheduled)
        bs = self.kv_caches[0][0].shape[1]
        nb = 1
        for i, s in enumerate(scheduled):
            c = s.num_computed_tokens
            self.ids[i] = s.request.all_token_ids[c]
            self.positions[i] = c
            self.seq_lens[i] = c + 1
            self.slots[i] = s.block_table[c // bs] * bs + c % bs
            nb = max(nb, c // bs + 1)
        if m * nb > self.tables.shape[0]:
            self.tables = np.zeros(2 * m * nb, dtype=np.int64)
        tables = self.tables[:m * nb].reshape(m, nb)
        for i, s in enumerate(scheduled):
            n = s.num_computed_tokens // bs + 1  # the blocks the row attends (the rest of its row is not read)
            tables[i, :n] = s.block_table[:n]
        lib = cpu_kernels.native_library()
        emb = self.embedding
        rc = lib.embed_rows(emb.data_ptr(), self.emb_bf16, emb.shape[0], self.ids.ctypes.data, m, self.hidden_size,
                            self.x.data_ptr(), self.bf16)
        if rc != 0:
            raise IndexError(f"a token id of {self.ids[:m].tolist()} is outside the embedding table of "
                             f"{emb.shape[0]} rows")
        cpu_kernels.decode_step_ptrs(self.model.decode_step_args(self.kv_caches), self.x.data_ptr(),
                                     self.hidden.data_ptr(), self.positions.ctypes.data, self.slots.ctypes.data,
                                     tables.ctypes.data, self.seq_lens.ctypes.data, nb, m, self.hidden_size, self.bf16)
        head = self.head
        threads = torch.get_num_threads()
        rc = lib.small_gemm(self.hidden.data_ptr(), self.bf16, head.data_ptr(), self.head_bf16, None,
                            self.logits.data_ptr(), m, self.vocab_rows, self.hidden_size, threads)
        if rc != 0:
            raise RuntimeError(f"small_gemm failed with code {rc}")
        lib.argmax_rows(self.logits.data_ptr(), self.bf16, m, self.vocab_rows, self.tokens.ctypes.data)
        return self.tokens[:m].tolist()
