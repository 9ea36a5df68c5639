"""Lossless speculative sampling: verify draft tokens against the target model in one batched call.

A draft (a small model, or n-gram prompt lookup) proposes ``k_i`` tokens ``d_1..d_k`` for row (request)
``i``; the target model runs once over the row's last verified token plus its drafts, which gives ``k_i + 1``
target positions: position ``j`` (0-based) holds the target's prediction for the token after ``d_j``
(position 0 predicts the token ``d_1`` claims to be; position ``k_i`` gives the "bonus" token). All rows'
positions are flattened into ``T = sum_i (k_i + 1)`` logits rows, row ``i`` owning
``[cu[i], cu[i] + k_i + 1)`` with ``cu[i] = sum_{r < i} (k_r + 1)``.

Random rows use the modified rejection sampling of Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding" (Algorithm 1), and Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling" (Algorithm 2): draft ``d_j`` (drawn from the draft distribution ``q_j``) is
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection a token is drawn from
``norm(max(0, p_j - q_j))`` and the row stops; when every draft is accepted a bonus token is drawn from
``p_{k+1}``. Every emitted token is then distributed exactly as if it had been sampled from the target
alone (the scheme is lossless), whatever ``q`` is.

Greedy rows accept a draft while it equals the target's argmax, so they emit exactly what plain greedy
decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sample.sampler import _SAMPLING_EPS, SamplingMetadata, compute_probs, exponential_race

__all__ = ["RejectionOutput", "rejection_sample"]


@dataclass
class RejectionOutput:
    """What one :func:`rejection_sample` call emitted.

    Attributes:
        token_ids: per row, the emitted tokens: the accepted drafts, then one more token (the token drawn
            at the first rejection, or the bonus token when every draft was accepted); ``1..k_i + 1`` tokens.
        num_accepted: per row, the number of accepted drafts, ``len(token_ids[i]) - 1``.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    position_metadata: SamplingMetadata,
    generators: dict[int, torch.Generator],
) -> RejectionOutput:
    """Verify every row's drafts against the target and emit ``1..k_i + 1`` tokens per row.

    Target distributions: greedy rows use the argmax of ``target_logits`` at each position (as
    :class:`~kvserve.sample.sampler.Sampler` does); random rows use ``p_j = compute_probs(...)`` at each
    position, i.e. exactly the distribution the one-token sampler would draw from (temperature, min-p, top-k,
    top-p, softmax). A row is greedy when its temperature, read at its first position, is below ``1e-5``
    (the caller repeats a request's params over its ``k_i + 1`` positions).

    Acceptance rule (random rows): with ``u_j ~ U[0, 1)``, draft ``d_j`` is accepted iff
    ``p_j(d_j) > 0 and u_j * q_j(d_j) <= p_j(d_j)``. For ``q_j(d_j) > 0`` this happens with probability
    ``min(1, p_j(d_j) / q_j(d_j))`` (up to the 2^-24 grid of float32 uniforms); ``<=`` (rather than ``<``)
    makes ``p == q`` accept every draft even after float32 rounding of ``u * q``. A draft the target
    filtered out (``p_j(d_j) == 0``) is always rejected, even when ``u_j == 0``. A draft with
    ``q_j(d_j) == 0`` (which a correct draft never produces) is accepted iff ``p_j(d_j) > 0``. With
    ``draft_probs=None`` (deterministic drafts) ``q_j`` is one-hot at ``d_j``, so ``d_j`` is accepted with
    probability ``p_j(d_j)`` and the residual is ``p_j`` with ``d_j`` removed.

    At the first rejection (position ``j``) the emitted token is drawn from ``norm(max(0, p_j - q_j))``; if
    that residual is all zero in float32 (``q_j`` covers ``p_j`` up to rounding) it is drawn from ``p_j``
    instead. The final token of every random row is drawn with the exponential race
    (:func:`~kvserve.sample.sampler.exponential_race`; the residual needs no normalisation for it).

    Randomness, per random row and call, independent of where the row rejects and of the rest of the batch:
    ``k_i`` uniforms (one ``torch.rand(k_i, generator=g)`` call, none when ``k_i == 0``), then one ``V``-sized
    ``exponential_`` draw for the final token, both from the row's generator when it is seeded. Unseeded
    rows share one ``torch.rand`` over all drafts and one ``[R, V]`` ``exponential_`` of the default RNG
    (neither is drawn when every row is seeded). An all-greedy batch (``position_metadata.all_greedy``)
    draws nothing at all.

    Everything stays on ``target_logits``' device; the only host synchronisation is the final copy of the
    ``[2, R]`` (accepted count, final token) result.

    Args:
        target_logits: ``[T, V]`` float (float32 expected), ``T = sum_i (k_i + 1)``; already penalized /
            logits-processed by the caller. Not modified.
        draft_token_ids: ``R`` rows of draft token ids; row ``i`` has ``k_i >= 0`` ids in ``[0, V)``.
        draft_probs: ``[sum_i k_i, V]`` float, on ``target_logits``' device: ``q_j`` at each draft, in the
            same (row-major) order as the flattened drafts; the distribution each draft was sampled from
            (after the same temperature / top-k / top-p). ``None``: deterministic drafts (``q`` one-hot).
            Ignored for greedy rows.
        position_metadata: ``T`` rows of sampling metadata (temperature, top-k, top-p, min-p per position).
            Its penalty fields and its ``generators`` are ignored.
        generators: row index ``0..R-1`` -> that request's generator, on ``target_logits``' device (seeded
            random rows; pass no greedy rows, as :meth:`SamplingMetadata.build` does: a greedy row's
            generator, if given anyway, is left alone in an all-greedy batch and advanced by the pattern above
            otherwise, but never affects the row's tokens).

    Returns:
        :class:`RejectionOutput` with python lists, one entry per row.

    Raises:
        ValueError: when the shapes disagree (``T``, ``V``, ``sum_i k_i``, the metadata's rows), a draft id
            is outside ``[0, V)``, a generator key is not a row index, or ``draft_probs`` is on another device.
    """
    num_rows = len(draft_token_ids)
    num_drafts_per_row = np.fromiter((len(d) for d in draft_token_ids), dtype=np.int64, count=num_rows)
    num_drafts = int(num_drafts_per_row.sum())
    num_positions = num_drafts + num_rows
    _validate(target_logits, draft_token_ids, draft_probs, position_metadata, generators, num_drafts, num_positions)
    if num_rows == 0:
        return RejectionOutput(token_ids=[], num_accepted=[])

    device = target_logits.device
    logits = target_logits.to(torch.float32)  # a no-op for float32; never written to
    q_probs = draft_probs.to(torch.float32) if draft_probs is not None else None

    # Host-side index arrays, one host->device copy each.
    row_start_np = np.zeros(num_rows, dtype=np.int64)  # cu[i]: row i's first position
    np.cumsum(num_drafts_per_row[:-1] + 1, out=row_start_np[1:])
    draft_offset_np = np.zeros(num_rows, dtype=np.int64)  # row i's first draft in the flattened drafts
    np.cumsum(num_drafts_per_row[:-1], out=draft_offset_np[1:])
    draft_row_np = np.repeat(np.arange(num_rows, dtype=np.int64), num_drafts_per_row)  # [D]
    draft_col_np = np.arange(num_drafts, dtype=np.int64) - draft_offset_np[draft_row_np]  # [D]: j - 1
    draft_tokens_np = np.fromiter((t for row in draft_token_ids for t in row), dtype=np.int64, count=num_drafts)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    row_start = to_device(row_start_np)  # [R]
    num_drafts_t = to_device(num_drafts_per_row)  # [R]
    draft_offset = to_device(draft_offset_np)  # [R]
    draft_row = to_device(draft_row_np)  # [D]
    draft_col = to_device(draft_col_np)  # [D]
    draft_tokens = to_device(draft_tokens_np)  # [D]
    draft_pos = row_start[draft_row] + draft_col  # [D]: the position that verifies each draft

    row_greedy = position_metadata.temperature[row_start] < _SAMPLING_EPS  # [R] bool

    # Greedy verification: accept while the draft equals the target argmax.
    argmax: torch.Tensor | None = None
    greedy_accept: torch.Tensor | None = None
    if not position_metadata.all_random:
        argmax = logits.argmax(dim=-1)  # [T]
        greedy_accept = draft_tokens == argmax[draft_pos]  # [D]

    # Random verification: u * q(d) <= p(d) and p(d) > 0.
    probs: torch.Tensor | None = None
    random_accept: torch.Tensor | None = None
    if not position_metadata.all_greedy:
        probs = compute_probs(logits, position_metadata)  # [T, V]
        uniforms = _draw_uniforms(num_drafts, num_drafts_per_row, draft_offset_np, generators, device)
        p_draft = probs[draft_pos, draft_tokens]  # [D]
        if q_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = q_probs.gather(1, draft_tokens.unsqueeze(1)).squeeze(1)
        random_accept = (p_draft > 0) & (uniforms * q_draft <= p_draft)

    if greedy_accept is not None and random_accept is not None:
        accept = torch.where(row_greedy[draft_row], greedy_accept, random_accept)
    elif greedy_accept is not None:
        accept = greedy_accept
    else:
        assert random_accept is not None
        accept = random_accept

    # Accepted drafts per row = length of the leading run of accepted drafts. Padding beyond k_i is False,
    # so the run never extends past the row's drafts.
    max_drafts = int(num_drafts_per_row.max())
    padded = torch.zeros(num_rows, max_drafts, dtype=torch.int64, device=device)
    padded[draft_row, draft_col] = accept.to(torch.int64)
    num_accepted = padded.cumprod(dim=1).sum(dim=1)  # [R]
    final_pos = row_start + num_accepted  # [R]: the position the last emitted token comes from

    final_greedy: torch.Tensor | None = None
    if argmax is not None:
        final_greedy = argmax[final_pos]
    final_random: torch.Tensor | None = None
    if probs is not None:
        p_final = probs[final_pos]  # [R, V]
        rejected = num_accepted < num_drafts_t  # [R]; when True, draft number num_accepted was rejected
        rejected_col = rejected.unsqueeze(1)
        if num_drafts == 0:
            target = p_final
        else:
            rejected_draft = (draft_offset + num_accepted).clamp(max=num_drafts - 1)  # [R], valid when rejected
            if q_probs is None:
                # q one-hot at the rejected draft: the residual is p with that token removed.
                one_hot = torch.zeros_like(p_final)
                one_hot.scatter_(1, draft_tokens[rejected_draft].unsqueeze(1), 1.0)
                q_final = one_hot
            else:
                q_final = q_probs[rejected_draft]
            residual = (p_final - torch.where(rejected_col, q_final, 0.0)).clamp_(min=0.0)
            residual_ok = (residual.sum(dim=-1) > 0).unsqueeze(1)
            target = torch.where(rejected_col & residual_ok, residual, p_final)
        final_random = exponential_race(target, generators)

    if final_greedy is not None and final_random is not None:
        final = torch.where(row_greedy, final_greedy, final_random)
    elif final_greedy is not None:
        final = final_greedy
    else:
        assert final_random is not None
        final = final_random

    accepted_list, final_list = torch.stack([num_accepted, final]).tolist()  # the one host sync
    token_ids = [row[:a] + [t] for row, a, t in zip(draft_token_ids, accepted_list, final_list, strict=True)]
    return RejectionOutput(token_ids=token_ids, num_accepted=accepted_list)


def _draw_uniforms(
    num_drafts: int,
    num_drafts_per_row: np.ndarray,
    draft_offset: np.ndarray,
    generators: dict[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """``[D]`` float32 uniforms in [0, 1): default RNG for all drafts, then each seeded row's own ``k_i``.

    Seeded rows draw with one ``torch.rand(k_i, generator=g)`` (nothing when ``k_i == 0``) before
    :func:`exponential_race` draws their final-token noise, so each generator sees the same sequence of
    calls whatever the batch and wherever the row rejects.
    """
    if len(generators) < len(num_drafts_per_row):
        uniforms = torch.rand(num_drafts, device=device)
    else:
        uniforms = torch.empty(num_drafts, device=device)
    for row, generator in generators.items():
        k = int(num_drafts_per_row[row])
        if k > 0:
            start = int(draft_offset[row])
            uniforms[start : start + k] = torch.rand(k, generator=generator, device=device)
    return uniforms


def _validate(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    position_metadata: SamplingMetadata,
    generators: dict[int, torch.Generator],
    num_drafts: int,
    num_positions: int,
) -> None:
    """Host-side shape checks (no tensor values are read); raises ValueError with what disagrees."""
    num_rows = len(draft_token_ids)
    if target_logits.dim() != 2:
        raise ValueError(f"rejection_sample: target_logits must be [T, V], got shape {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    if target_logits.shape[0] != num_positions:
        raise ValueError(
            f"rejection_sample: target_logits has {target_logits.shape[0]} rows but {num_rows} rows with "
            f"{num_drafts} drafts need sum(k_i + 1) = {num_positions}"
        )
    if position_metadata.temperature.shape != (num_positions,):
        raise ValueError(
            f"rejection_sample: position_metadata has {tuple(position_metadata.temperature.shape)} temperatures, "
            f"expected one per target position ({num_positions})"
        )
    optional = {"top_k": position_metadata.top_k, "top_p": position_metadata.top_p, "min_p": position_metadata.min_p}
    for name, t in optional.items():
        if t is not None and t.shape != (num_positions,):
            raise ValueError(
                f"rejection_sample: position_metadata.{name} has shape {tuple(t.shape)}, expected ({num_positions},)"
            )
    if draft_probs is not None:
        if draft_probs.shape != (num_drafts, vocab):
            raise ValueError(
                f"rejection_sample: draft_probs has shape {tuple(draft_probs.shape)}, expected "
                f"(sum(k_i), V) = ({num_drafts}, {vocab})"
            )
        if draft_probs.device != target_logits.device:
            raise ValueError(
                f"rejection_sample: draft_probs is on {draft_probs.device}, target_logits on {target_logits.device}"
            )
    for i, row in enumerate(draft_token_ids):
        for token in row:
            if not 0 <= token < vocab:
                raise ValueError(f"rejection_sample: row {i} has draft token id {token}, outside [0, {vocab})")
    for row_index in generators:
        if not 0 <= row_index < num_rows:
            raise ValueError(f"rejection_sample: generator for row {row_index}, but there are {num_rows} rows")
