"""Step inputs: flatten the scheduled requests into input_ids, positions, slot_mapping and attention metadata.

Everything is vectorized numpy (no per-token Python), e.g. for two requests with
``num_computed_tokens = [5, 0]`` and ``num_scheduled_tokens = [1, 3]``::

    req_idx   = [0, 1, 1, 1]            (np.repeat(arange(R), n))
    positions = [5, 0, 1, 2]            (c[req_idx] + arange(T) - starts[req_idx])
    slot      = block_table[req_idx, positions // block_size] * block_size + positions % block_size
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers.attention import (
    MAX_DECODE_BUCKETS,
    MIN_DECODE_BUCKET,
    AttentionMetadata,
    NativePrefill,
    PrefillGroup,
)


def prepare_inputs(order: list[ScheduledRequest], num_decodes: int, block_size: int,
                   device: torch.device, native_decode: bool = False, native_prefill: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
    """Flatten a step's requests into model inputs.

    Args:
        order: the scheduled requests: the ``num_decodes`` decode rows first (one-token requests sorted by
            length, so that decode buckets pad little, then rows verifying draft tokens), then prefill chunks
            that continue a cached prefix, then fresh prompts.
        native_decode: build the decode metadata for the compiled CPU kernel instead of torch buckets.
        native_prefill: build ``NativePrefill`` (per-chunk start, length, offset and block table) for the
            compiled CPU prefill kernel instead of the torch prefill groups (no masks, no padding indices).
    Returns:
        input_ids ``[T]``, positions ``[T]``, attention metadata, and ``logits_indices`` (numpy
        ``[num_sampling]``: the flat index of the last token of each request that samples; a row with
        ``m`` draft tokens has its last ``m + 1`` indices there, in order).
    """
    bs = block_size
    n = np.fromiter((s.num_scheduled_tokens for s in order), dtype=np.int64, count=len(order))
    c = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=len(order))
    num_tokens = int(n.sum())
    ids = np.fromiter(chain.from_iterable(_step_token_ids(s) for s in order), dtype=np.int64, count=num_tokens)
    cu = np.cumsum(n)
    starts = cu - n
    req_idx = np.repeat(np.arange(len(order)), n)
    offsets = np.arange(num_tokens) - starts[req_idx]  # index of each token within its chunk
    positions = c[req_idx] + offsets
    max_blocks = max(len(s.block_table) for s in order)
    bt = np.zeros((len(order), max_blocks), dtype=np.int64)
    for i, s in enumerate(order):
        bt[i, :len(s.block_table)] = s.block_table
    slot = bt[req_idx, positions // bs] * bs + positions % bs

    dev = device
    # Decode tokens: one query each over its own sequence length. A decode row verifying m draft tokens
    # (speculative decoding) is m + 1 such queries sharing its block table, at lengths c + 1 .. c + m + 1:
    # each attends exactly as a one-token decode at that position would (this step's K/V are written first).
    nd = int(n[:num_decodes].sum())
    meta = AttentionMetadata(slot_mapping=torch.from_numpy(slot).to(dev), num_decode_tokens=nd)
    if nd:
        seq_lens = positions[:nd] + 1
        dec_bt = bt[:num_decodes] if nd == num_decodes else bt[req_idx[:nd]]
    if nd and native_decode:
        nb = -(-int(seq_lens.max()) // bs)
        meta.native_decode = (torch.from_numpy(np.ascontiguousarray(dec_bt[:, :nb])), torch.from_numpy(seq_lens))
    elif nd:
        num_buckets = max(1, min(MAX_DECODE_BUCKETS, nd // MIN_DECODE_BUCKET))
        bounds = np.linspace(0, nd, num_buckets + 1).astype(np.int64)
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            lens = seq_lens[start:end]
            nb = -(-int(lens.max()) // bs)
            mask = np.arange(nb * bs)[None, :] < lens[:, None]
            tables = torch.from_numpy(np.ascontiguousarray(dec_bt[start:end, :nb])).to(dev)
            meta.decode_buckets.append((start, end, tables, torch.from_numpy(mask[:, None, None, :]).to(dev)))
    # Prefill chunks: those continuing a cached prefix come first, then fresh prompts. For the native
    # kernel they are one NativePrefill; for torch two groups: continuing (masked) and fresh (causal).
    lo = num_decodes
    if native_prefill and lo < len(order):  # every chunk in one kernel call: four small arrays, no masks
        nb = -(-int((c[lo:] + n[lo:]).max()) // bs)
        meta.native_prefill = NativePrefill(
            int(starts[lo]), num_tokens, torch.from_numpy(np.ascontiguousarray(bt[lo:, :nb])),
            torch.from_numpy(starts[lo:] - starts[lo]), torch.from_numpy(n[lo:]), torch.from_numpy(c[lo:]))
    elif lo < len(order):
        num_continuing = num_decodes + int(np.count_nonzero(c[num_decodes:] > 0))
        for lo, hi in ((num_decodes, num_continuing), (num_continuing, len(order))):
            if lo < hi:
                meta.prefill_groups.append(_prefill_group(lo, hi, n, c, bt, starts, req_idx, offsets, bs, dev))
    logits_indices = (cu - 1)[[i for i, s in enumerate(order) if s.sample]]
    if any(s.draft_token_ids for s in order if s.sample):  # a row with m drafts: logits at its last m + 1
        logits_indices = np.concatenate([np.arange(cu[i] - 1 - len(s.draft_token_ids), cu[i])
                                         for i, s in enumerate(order) if s.sample])
    return (torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), meta, logits_indices)


def _step_token_ids(s: ScheduledRequest) -> list[int]:
    """The tokens a row computes this step: its known tokens, then its draft tokens (speculative decoding)."""
    c = s.num_computed_tokens
    if not s.draft_token_ids:
        return s.request.all_token_ids[c:c + s.num_scheduled_tokens]
    return s.request.all_token_ids[c:c + s.num_scheduled_tokens - len(s.draft_token_ids)] + list(s.draft_token_ids)


def _prefill_group(lo: int, hi: int, n: np.ndarray, c: np.ndarray, bt: np.ndarray, starts: np.ndarray,
                   req_idx: np.ndarray, offsets: np.ndarray, bs: int, dev: torch.device) -> PrefillGroup:
    """Requests ``order[lo:hi]`` as one padded prefill group (see ``PrefillGroup``)."""
    q_lens, cp = n[lo:hi], c[lo:hi]
    max_q = int(q_lens.max())
    nb = -(-int((cp + q_lens).max()) // bs)
    first, last = int(starts[lo]), int(starts[hi - 1] + n[hi - 1])
    pad_index = (req_idx[first:last] - lo) * max_q + offsets[first:last]
    mask, bounds = None, list[tuple[int, int]]()
    if not cp.any():  # fresh prompts: attended one by one, unpadded (see PrefillGroup.bounds)
        bounds = list(zip(starts[lo:hi].tolist(), (starts[lo:hi] + q_lens).tolist(), strict=True))
    else:  # causal with an offset, as an additive mask
        qi = np.arange(max_q)[None, :, None]  # query index within the chunk
        kj = np.arange(nb * bs)[None, None, :]
        allowed = (kj <= cp[:, None, None] + qi) & (qi < q_lens[:, None, None])
        allowed[:, :, 0] |= np.arange(max_q)[None, :] >= q_lens[:, None]  # padded rows: key 0 (no NaN)
        mask = torch.from_numpy(np.where(allowed, np.float32(0), np.float32(-np.inf))[:, None]).to(dev)
    return PrefillGroup(first, last, torch.from_numpy(np.ascontiguousarray(bt[lo:hi, :nb])).to(dev),
                        torch.from_numpy(pad_index).to(dev), max_q, mask, bounds)
