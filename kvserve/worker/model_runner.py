"""ModelRunner: SchedulerOutput -> one batched forward pass -> sampled tokens (ModelRunnerOutput).

Decode requests are ordered first (see ``layers/attention.py``); inputs come from ``input_batch``.
Logits are computed only at the last scheduled token of requests that sample.
"""

from __future__ import annotations

import logging

import torch

from kvserve.core.request import Request
from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvserve.layers.cpu_kernels import native_available
from kvserve.models.llama import MODEL_CLASSES, LlamaForCausalLM
from kvserve.models.registry import ModelArchConfig
from kvserve.sample.sampler import Sampler, SamplingMetadata
from kvserve.worker.input_batch import prepare_inputs
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
        # The compiled kernel reads float32 caches in place on CPU; other cases use the torch path.
        self.native_decode = device.type == "cpu" and self.dtype == torch.float32 and native_available()
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Raises whatever the model raises (the engine fails the step's requests)."""
        for request_id in so.finished_request_ids:
            self.generators.pop(request_id, None)
        if so.blocks_to_copy:
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=self.device)
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        decodes = sorted((s for s in so.scheduled if s.num_scheduled_tokens == 1), key=lambda s: s.num_computed_tokens)
        prefills = [s for s in so.scheduled if s.num_scheduled_tokens > 1]
        order = decodes + [s for s in prefills if s.num_computed_tokens > 0] + [
            s for s in prefills if s.num_computed_tokens == 0]
        batch = prepare_inputs(order, len(decodes), self.block_size, self.device, self.native_decode)
        input_ids, positions, meta, logits_indices = batch
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampling = [s for s in order if s.sample]
        if not sampling:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(self.device)])
        requests = [s.request for s in sampling]
        _mask_stop_tokens_before_min_tokens(logits, requests)
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


def _mask_stop_tokens_before_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """``min_tokens`` (as vLLM): EOS and stop token ids cannot be sampled before that many outputs.

    logits ``[num_sampling, vocab]`` are edited in place (rows of requests still under min_tokens only).
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids) + ([r.eos_token_id] if r.eos_token_id is not None and not p.ignore_eos else [])
        rows += [row] * len(banned)
        cols += banned
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
