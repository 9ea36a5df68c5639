"""ModelRunner: SchedulerOutput -> one batched forward pass -> sampled tokens (ModelRunnerOutput).

Inputs for the whole step are built with vectorized numpy (no per-token Python), e.g. for two requests
with ``num_computed_tokens = [5, 0]`` and ``num_scheduled_tokens = [1, 3]``::

    req_idx   = [0, 1, 1, 1]            (np.repeat(arange(R), n))
    positions = [5, 0, 1, 2]            (c[req_idx] + arange(T) - starts[req_idx])
    slot      = block_table[req_idx, positions // block_size] * block_size + positions % block_size

Logits are computed only at the last scheduled token of requests that sample.
"""

from __future__ import annotations

import logging
from itertools import chain

import numpy as np
import torch

from kvserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kvserve.layers.attention import AttentionMetadata
from kvserve.models.llama import MODEL_CLASSES, LlamaForCausalLM
from kvserve.models.registry import ModelArchConfig
from kvserve.sample.sampler import Sampler, SamplingMetadata
from kvserve.worker.kv_cache import allocate_kv_cache

logger = logging.getLogger(__name__)


def build_model(arch: ModelArchConfig, weights: dict[str, torch.Tensor], max_position: int,
                dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Instantiate without random init (on the meta device), then load ``weights`` into it."""
    with torch.device("meta"):
        model = MODEL_CLASSES[arch.architecture](arch, max_position)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.reset_tables()
    model.load_weights(weights)
    return model.eval()


class ModelRunner:
    """Owns the model, the physical KV cache and the per-request sampling generators.

    Args:
        model: a loaded model on ``device``.
        num_blocks, block_size: KV cache geometry (must match the BlockManager's).
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.arch = model.config
        self.device = device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, self.dtype, device)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    # ---- inputs --------------------------------------------------------------------------------
    def _prepare(self, order: list[ScheduledRequest], num_decodes: int
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        bs = self.block_size
        n = np.fromiter((s.num_scheduled_tokens for s in order), dtype=np.int64, count=len(order))
        c = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=len(order))
        num_tokens = int(n.sum())
        ids = np.fromiter(chain.from_iterable(
            s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_scheduled_tokens]
            for s in order), dtype=np.int64, count=num_tokens)
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

        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slot).to(dev), num_decode_tokens=num_decodes)
        if num_decodes:
            seq_lens = c[:num_decodes] + 1
            nb = -(-int(seq_lens.max()) // bs)
            meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(bt[:num_decodes, :nb])).to(dev)
            mask = np.arange(nb * bs)[None, :] < seq_lens[:, None]
            meta.decode_mask = torch.from_numpy(mask[:, None, None, :]).to(dev)
        if num_decodes < len(order):
            q_lens, cp = n[num_decodes:], c[num_decodes:]
            kv_lens = cp + q_lens
            p, max_q = len(q_lens), int(q_lens.max())
            nb = -(-int(kv_lens.max()) // bs)
            meta.prefill_block_tables = torch.from_numpy(np.ascontiguousarray(bt[num_decodes:, :nb])).to(dev)
            meta.prefill_max_q = max_q
            first = int(starts[num_decodes])
            pad_index = (req_idx[first:] - num_decodes) * max_q + offsets[first:]
            meta.prefill_pad_index = torch.from_numpy(pad_index).to(dev)
            qi = np.arange(max_q)[None, :, None]  # query index within the chunk
            kj = np.arange(nb * bs)[None, None, :]
            mask = (kj <= cp[:, None, None] + qi) & (qi < q_lens[:, None, None])
            mask[:, :, 0] |= np.arange(max_q)[None, :] >= q_lens[:, None]  # padded rows: attend key 0 (no NaN)
            group = self.arch.num_attention_heads // self.arch.num_key_value_heads
            mask = np.broadcast_to(mask[:, None], (p, group, max_q, nb * bs)).reshape(p, 1, group * max_q, nb * bs)
            meta.prefill_mask = torch.from_numpy(np.ascontiguousarray(mask)).to(dev)
        logits_indices = (cu - 1)[[i for i, s in enumerate(order) if s.sample]]
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), meta, logits_indices)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Raises whatever the model raises (the engine fails the step's requests)."""
        for request_id in chain(so.finished_request_ids):
            self.generators.pop(request_id, None)
        if so.blocks_to_copy:
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=self.device)
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        decodes = [s for s in so.scheduled if s.num_scheduled_tokens == 1]
        order = decodes + [s for s in so.scheduled if s.num_scheduled_tokens > 1]
        input_ids, positions, meta, logits_indices = self._prepare(order, len(decodes))
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling = [s for s in order if s.sample]
        if not sampling:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(self.device)])
        requests = [s.request for s in sampling]
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self._generator(r.request_id, r.sampling_params.seed) for r in requests],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, metadata)
        sampled = out.sampled_token_ids.tolist()
        logprobs: list[TokenLogprobs | None] | None = None
        if out.logprobs is not None:
            ids_l = out.logprobs.token_ids.tolist()
            lps_l = out.logprobs.logprobs.tolist()
            ranks = out.logprobs.ranks.tolist()
            logprobs = []
            for row, r in enumerate(requests):
                k = r.sampling_params.logprobs
                if k is None:
                    logprobs.append(None)
                    continue
                top = list(zip(ids_l[row][1:k + 1], lps_l[row][1:k + 1], strict=True))
                logprobs.append(TokenLogprobs(ids_l[row][0], lps_l[row][0], ranks[row], top))
        return ModelRunnerOutput(req_ids=[r.request_id for r in requests], sampled_token_ids=sampled,
                                 logprobs=logprobs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self.generators[request_id] = g
        return g
