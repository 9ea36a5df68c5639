"""Draft-model proposals: a smaller model of the same vocabulary guesses the next ``k`` tokens.

The draft has its own paged KV cache with the *same block ids* as the target's (one block table per
request, one ``BlockManager``): the runner copies it on copy-on-write and swaps it with the target's, so
blocks, ref counts, preemption and prefix-cache hits apply to both at once. Its contents at a slot are a
pure function of the tokens before it (the block hash covers them), so any writer writes the same values.

In a step where some row has draft slots, ``propose`` runs

1. a *mirror* forward over every scheduled row's own tokens (prefill chunks too: the draft is prefilled
   alongside the target), starting where that row's draft KV stops being valid, whose logits at the
   last token of each speculating row give draft 1;
2. ``k - 1`` decode forwards over the speculating rows, each feeding the previous draft.

Draft KV validity per request is ``(base, fed)``: positions ``< base`` hold KV of verified tokens, then
``fed`` are the drafts fed at ``base, base + 1, ...``; the next step keeps the leading ``fed`` tokens that
verification accepted. A request it has no record of (new, or preempted by recompute) starts from 0: a
prefix-cache hit may hold blocks the target computed while the draft was idle. A step without draft slots
leaves the draft idle (no cost when speculation is off); it catches up in its next mirror forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.models.llama import LlamaForCausalLM
from kvserve.sample.sampler import _SAMPLING_EPS, SamplingMetadata, compute_probs, exponential_race
from kvserve.spec_decode.proposer import with_drafts
from kvserve.worker.input_batch import prepare_inputs

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class DraftModelProposer:
    """Proposes with a draft model over its own paged KV cache (see the module docstring).

    Args:
        model: the loaded draft model (same vocabulary as the target).
        kv_caches: its KV cache, ``[num_blocks, block_size, kv_heads, head_dim]`` per layer, K and V, with
            the target's number of blocks.
        generator: the runner's per-request generator factory ``(request id, seed) -> generator | None``;
            seeded requests draw their draft tokens from it (a fixed number of draws per step).
        native_decode / native_prefill: use the compiled CPU attention kernels (as the runner does).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCache, block_size: int, device: torch.device,
                 generator: Callable[[str, int | None], torch.Generator | None], native_decode: bool,
                 native_prefill: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.generator = generator
        self.native_decode = native_decode
        self.native_prefill = native_prefill
        self._state: dict[str, tuple[int, tuple[int, ...]]] = {}
        # (tokens, seconds) of each draft forward since the engine last read them (the k controller's costs)
        self.timings: list[tuple[int, float]] = []

    def _valid(self, s: ScheduledRequest) -> int:
        """Leading positions of ``s``'s request whose draft KV is valid (at most its computed tokens)."""
        state = self._state.get(s.request.request_id)
        if state is None:
            return 0
        base, fed = state
        tokens = s.request.all_token_ids
        n = 0
        while n < len(fed) and base + n < len(tokens) and tokens[base + n] == fed[n]:
            n += 1
        return min(base + n, s.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """See ``proposer.Proposer.propose``; every speculating row gets exactly its ``num_spec_tokens``."""
        spec = [i for i, s in enumerate(scheduled) if s.num_spec_tokens > 0]
        if not spec:
            return scheduled, None
        t0 = time.perf_counter()
        # 1. the mirror: each row's own tokens, from where its draft KV stops being valid.
        mirror: list[ScheduledRequest] = []
        for s in scheduled:
            start = self._valid(s)
            end = s.num_computed_tokens + s.num_scheduled_tokens - s.num_spec_tokens
            mirror.append(replace(s, num_computed_tokens=start, num_scheduled_tokens=end - start,
                                  sample=s.num_spec_tokens > 0, num_spec_tokens=0, draft_token_ids=()))
        decodes = [m for m in mirror if m.num_scheduled_tokens == 1]
        order = decodes + [m for m in mirror if m.num_scheduled_tokens > 1 and m.num_computed_tokens > 0] + [
            m for m in mirror if m.num_scheduled_tokens > 1 and m.num_computed_tokens == 0]
        input_ids, positions, meta, logits_indices = prepare_inputs(
            order, len(decodes), self.block_size, self.device, self.native_decode, self.native_prefill)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self.timings.append((int(input_ids.shape[0]), time.perf_counter() - t0))
        sampling = [m for m in order if m.sample]
        last = hidden[torch.from_numpy(logits_indices).to(self.device)]
        by_id = {m.request.request_id: row for row, m in enumerate(sampling)}
        rows = [scheduled[i] for i in spec]
        last = last[torch.tensor([by_id[s.request.request_id] for s in rows], device=self.device)]
        k = [s.num_spec_tokens for s in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(k)):
            active = [i for i in range(len(rows)) if k[i] > j]
            if j > 0:  # 2. one decode forward over the rows still drafting, feeding draft j
                step = [replace(rows[i], num_computed_tokens=rows[i].num_computed_tokens + j, num_scheduled_tokens=1,
                                sample=False, num_spec_tokens=0, draft_token_ids=(drafts[i][-1],)) for i in active]
                t1 = time.perf_counter()
                ids, pos, dmeta, _ = prepare_inputs(step, len(step), self.block_size, self.device,
                                                    self.native_decode, self.native_prefill)
                last = self.model(ids, pos, self.kv_caches, dmeta)
                self.timings.append((len(step), time.perf_counter() - t1))
            tokens, q = self._sample(self.model.compute_logits(last), [rows[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs[i].append(q[row])
        for s, d in zip(rows, drafts, strict=True):
            self._state[s.request.request_id] = (s.num_computed_tokens + 1, tuple(d[:-1]))
        for s, m in zip(scheduled, mirror, strict=True):
            if not s.num_spec_tokens:
                self._state[s.request.request_id] = (m.num_computed_tokens + m.num_scheduled_tokens, ())
        by_row = dict(zip(spec, drafts, strict=True))
        out = [with_drafts(s, by_row[i]) if i in by_row else s for i, s in enumerate(scheduled)]
        return out, torch.stack([q for qs in probs for q in qs])

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor]:
        """One draft token per row and the distribution ``q`` it was drawn from (``[rows, V]``): the
        request's temperature / top-k / top-p / min-p on the draft's logits (no penalties: ``q`` only has
        to be what the token was drawn from). Greedy rows: the argmax, ``q`` one-hot. Seeded rows draw
        from their request's generator."""
        requests = [s.request for s in rows]
        meta = SamplingMetadata.build([r.sampling_params for r in requests], [[]] * len(rows), [[]] * len(rows),
                                      [self.generator(r.request_id, r.sampling_params.seed) for r in requests],
                                      logits.shape[-1], logits.device)
        argmax = logits.argmax(dim=-1)
        q = torch.nn.functional.one_hot(argmax, logits.shape[-1]).to(torch.float32)
        if meta.all_greedy:
            return argmax.tolist(), q
        probs = compute_probs(logits, meta)
        sampled = exponential_race(probs, meta.generators)
        is_greedy = meta.temperature < _SAMPLING_EPS
        tokens = torch.where(is_greedy, argmax, sampled)
        q = torch.where(is_greedy.unsqueeze(1), q, probs)
        return tokens.tolist(), q

    def take_timings(self) -> list[tuple[int, float]]:
        """The draft forwards' ``(tokens, seconds)`` since the last call."""
        timings, self.timings = self.timings, []
        return timings

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget requests (finished, or preempted by recompute: their blocks are gone)."""
        for request_id in request_ids:
            self._state.pop(request_id, None)
