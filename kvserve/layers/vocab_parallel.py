"""The embedding table split over tensor-parallel ranks by vocabulary rows (Megatron-LM's vocabulary-parallel
embedding): rank ``r`` holds rows ``[r × shard, (r + 1) × shard)``; a token outside them looks up zeros, and
one all-reduce sums the ranks' lookups, so every rank ends with every token's embedding (exactly: one term of
each sum is the row, the others are zero). E.g. vocabulary 10 over 2 ranks, shard 5, ids ``[3, 7]``::

    rank 0: [E[3], 0]      rank 1: [0, E[7]]      all-reduce -> [E[3], E[7]] on both
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.tp_shard import vocab_shard_size

if TYPE_CHECKING:
    from kvserve.distributed.tp_group import TPGroup


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` of this rank's ``vocab_shard_size(vocab_size, tp.size)`` rows (the last rank's shard
    zero-padded past the vocabulary).

    Args:
        vocab_size: the whole vocabulary.
        hidden_size: embedding width.
        tp: the tensor-parallel group (its ``rank`` picks the rows).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        shard = vocab_shard_size(vocab_size, tp.size)
        super().__init__(shard, hidden_size)
        self.tp = tp
        self.vocab_start = tp.rank * shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` (ids of the whole vocabulary) -> ``[num_tokens, hidden_size]`` in the weight's
        dtype, identical on every rank (a collective: every rank calls it with the same ids)."""
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        x.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)
