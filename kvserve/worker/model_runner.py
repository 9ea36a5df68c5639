"""ModelRunner: SchedulerOutput -> one batched forward pass -> sampled tokens (ModelRunnerOutput).

Decode requests are ordered first (see ``layers/attention.py``); inputs come from ``input_batch``.
Logits are computed only at the last scheduled token of requests that sample.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kvserve.core.block_hash import BlockHash
from kvserve.core.block_manager import BlockId
from kvserve.core.request import Request
from kvserve.core.scheduler_output import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from kvserve.layers.cpu_kernels import native_available
from kvserve.layers.gguf_blocks import GGUFTensor
from kvserve.layers.kv_quant import is_kv8, storage_dtype
from kvserve.models.llama import MODEL_CLASSES, LlamaForCausalLM
from kvserve.models.registry import ModelArchConfig
from kvserve.models.tp_shard import shard_arch, shard_weights
from kvserve.sample.logits_processor import LogitsProcessors
from kvserve.sample.sampler import Sampler, SamplingMetadata
from kvserve.sample.token_constraints import TokenConstraints
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.proposer import Proposer
from kvserve.spec_decode.verify import mask_before_min_tokens, verify_drafts
from kvserve.worker.greedy_decode import GreedyDecode
from kvserve.worker.host_memory import move_parameters_to_hugepages
from kvserve.worker.input_batch import prepare_inputs
from kvserve.worker.kv_cache import allocate_host_swap_pool, allocate_kv_cache, block_bytes
from kvserve.worker.prompt_logprobs import compute_prompt_logprobs, follow_prompt_logprobs

if TYPE_CHECKING:
    from kvserve.distributed.tp_group import TPGroup

KVCache = list[tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger(__name__)


def build_model(arch: ModelArchConfig, weights: Mapping[str, torch.Tensor | GGUFTensor], max_position: int,
                dtype: torch.dtype, device: torch.device, compute_dtype: torch.dtype | None = None,
                quantization: str | None = None, quantize_lm_head: bool = True,
                tp: TPGroup | None = None) -> LlamaForCausalLM:
    """Instantiate without random init (on the meta device), then load ``weights`` into it.

    Args:
        dtype: the dtype of the linear and embedding weights.
        compute_dtype: the activations' dtype (norm weights, biases); None: ``dtype``. bfloat16
            weights with float32 activations is the CPU mode for hosts without bf16 dot products: half
            the weight bytes per decode step, float32 math (see ``compute_dtype_for``).
        quantization: None, or ``"int8"``: the decoder layers' projections and the LM head (unless
            ``quantize_lm_head`` is False) hold int8 codes quantized from ``weights`` (``layers/int8.py``);
            the embedding table and the norms keep ``dtype`` / ``compute_dtype``. ``"gguf"``: the tensors
            ``weights`` holds as GGUF blocks (``loader.load_gguf_blocks``) stay blocks (``layers/gguf_linear.py``).
        tp: tensor parallelism: build this rank's shard (``models/tp_shard.py``) of the whole model ``arch``
            from the whole checkpoint ``weights``; None: the whole model.
    Raises:
        ValueError: an unknown ``quantization`` (or one with ``tp``), or a checkpoint tensor missing, of the
            wrong shape, or in a GGUF format the kernels do not serve.
        InvalidRequestError: ``tp.size`` does not divide the model's heads (``tp_shard.shard_arch``).
    """
    compute_dtype = compute_dtype or dtype
    if quantization not in (None, "int8", "gguf"):
        raise ValueError(f"quantization: must be None, 'int8' or 'gguf', got {quantization!r}")
    if tp is not None:
        if quantization is not None:
            raise ValueError("quantization: not supported with tensor parallelism")
        weights = shard_weights(cast(dict[str, torch.Tensor], dict(weights)), arch, tp.rank, tp.size)
        arch = shard_arch(arch, tp.size)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch.architecture](arch, max_position, tp)
        if quantization == "int8":
            model.use_int8_weights(lm_head=quantize_lm_head)
        elif quantization == "gguf":
            model.use_gguf_weights(weights)
    model = model.to_empty(device=device).to(compute_dtype)
    if dtype != compute_dtype:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                module.weight = torch.nn.Parameter(module.weight.to(dtype), requires_grad=False)
    if arch.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear):  # to_empty breaks the tie
        assert isinstance(model.embed_tokens, torch.nn.Embedding)
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.reset_tables()
    model.load_weights(weights)
    move_parameters_to_hugepages(model)  # CPU: weights streamed at bandwidth (host_memory.py)
    return model.eval()


class ModelRunner:
    """Owns the model, the physical KV cache and the per-request sampling generators.

    Args:
        model: a loaded model on ``device``.
        num_blocks, block_size: KV cache geometry (must match the BlockManager's).
        num_host_blocks: blocks of the host swap pool (``kv_cache.num_host_blocks_for(swap_space)``);
            0: no pool, swap preemption impossible.
        kv_dtype: the KV cache's dtype (None: the model's); ``torch.int8`` / ``torch.float8_e4m3fn`` for the
            8-bit caches (rows of codes plus their scales, ``layers/kv_quant.py``).

    Swap layout: the device cache and the host pool have the same per-layer block shape, so a swap is a
    row copy per layer (``row`` = head_dim, or ``kv_quant.row_elems`` bytes of codes and scales for an 8-bit cache, so
    swaps, copy-on-write and offload payloads carry the scales with the codes)::

        kv_caches[l][0|1]      [num_blocks,      block_size, num_kv_heads, row]   (device)
                 │ swap out ▲ swap in         (device_block <-> host_block)
        host_kv_caches[l][0|1] [num_host_blocks, block_size, num_kv_heads, row]   (CPU, pinned on CUDA)
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 num_host_blocks: int = 0, kv_dtype: torch.dtype | None = None,
                 proposer: Proposer | None = None) -> None:
        self.model = model
        self.arch = model.config  # (under tensor parallelism: this rank's shard, its KV heads)
        # Tensor parallelism: every rank runs execute_model on the same SchedulerOutput; only rank 0 (the
        # driver) samples. ``collectives_pending`` is True from the start of a step until its last collective:
        # a failure in between leaves the ranks out of step (the executor then stops them all).
        self.tp: TPGroup | None = model.tp
        self.is_driver = self.tp is None or self.tp.is_driver
        self.collectives_pending = False
        self.device = device
        self.model_dtype = model.compute_dtype
        self.dtype = kv_dtype or self.model_dtype  # the KV cache's logical dtype (swaps, block bytes)
        self.cache_dtype = storage_dtype(self.dtype)  # the cache tensors' dtype (8-bit: int8 / uint8 bytes)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_bytes = block_bytes(self.arch, block_size, self.dtype)  # one block, all layers, K and V
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, self.dtype, device)
        self.host_kv_caches = allocate_host_swap_pool(self.arch, num_host_blocks, block_size, self.dtype, device)
        # The compiled kernel reads float32 / bfloat16 / 8-bit caches in place on CPU; other cases use the torch
        # path (an 8-bit cache whose native variant is not built falls back per call, ``attention.py``).
        self.native_decode = (device.type == "cpu" and (self.dtype in (torch.float32, torch.bfloat16)
                                                        or is_kv8(self.dtype)) and native_available())
        # Prefill attention likewise (csrc/prefill_attention.c), when the activations are float32 / bfloat16 too.
        self.native_prefill = self.native_decode and self.model_dtype in (torch.float32, torch.bfloat16)
        self.sampler = Sampler()
        # Per-request logits edits before sampling (structured output, ...); see sample/logits_processor.py.
        self.logits_processors = LogitsProcessors()
        self.logits_processors.add(TokenConstraints())  # allowed_token_ids, bad_words, logit_bias: first
        self.generators: dict[str, torch.Generator] = {}
        # Speculative decoding: proposes drafts for rows with draft slots (None: off). A draft model's KV
        # cache is another (device cache, host pool) group, copied and swapped with the target's.
        self.proposer = proposer
        self.kv_groups: list[tuple[KVCache, KVCache]] = [(self.kv_caches, self.host_kv_caches)]
        self.last_forward_seconds = 0.0  # the target forward of the latest step (the k controller's input)
        self.last_forward_tokens = 0
        # Plain greedy decode steps in four native calls (worker/greedy_decode.py); made at the first step the
        # model allows it. Tests switch ``greedy_fast_path`` off to compare with the general path.
        self.greedy_fast_path = True
        self._greedy: GreedyDecode | None = None
        self._greedy_checked = False

    def add_kv_group(self, caches: KVCache, host_pool: KVCache, group_block_bytes: int) -> None:
        """Register another model's paged KV cache (a draft model's): same block ids, copied on
        copy-on-write and swapped with the target's; ``block_bytes`` grows by ``group_block_bytes``."""
        self.kv_groups.append((caches, host_pool))
        self.block_bytes += group_block_bytes

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: swap out, swap in, copy-on-write, then the forward over ``so.scheduled`` (if any).

        The output's ``swap_bytes`` / ``swap_seconds`` account this step's swaps (also when nothing is
        scheduled). Raises IndexError for a swap block id outside the device cache or host pool, and whatever
        the model raises (the engine fails the step's requests).
        """
        self.collectives_pending = self.tp is not None
        for request_id in so.finished_request_ids:
            self.generators.pop(request_id, None)
        self.logits_processors.release(so.finished_request_ids)
        if self.proposer is not None and (so.finished_request_ids or so.preempted_request_ids):
            self.proposer.release(so.finished_request_ids + so.preempted_request_ids)  # recompute: new blocks
        # NOTE: swaps and copies happen even on a step with nothing scheduled, in the contract's order:
        # offload reads (evicted blocks are rewritten below), swap out (frees device blocks this step may
        # reuse), swap in, copy-on-write, offload loads, then the forward.
        offloaded = self.export_blocks(so.blocks_to_offload) if so.blocks_to_offload else []
        swap_bytes, swap_seconds = self.swap_blocks(so.blocks_to_swap_out, so.blocks_to_swap_in)
        if so.blocks_to_copy:
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=self.device)
            for caches, _ in self.kv_groups:
                for k_cache, v_cache in caches:
                    k_cache[dst] = k_cache[src]
                    v_cache[dst] = v_cache[src]
        if so.blocks_to_load:
            self.import_blocks(so.blocks_to_load)
        if not so.scheduled:  # (not ``is_empty``: that may come to count swaps and copies as work)
            self.collectives_pending = False
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], swap_bytes=swap_bytes,
                                     swap_seconds=swap_seconds, offloaded=offloaded)
        out = self._execute(so)
        out.swap_bytes, out.swap_seconds, out.offloaded = swap_bytes, swap_seconds, offloaded
        return out

    # ---- KV offload ----------------------------------------------------------------------------
    @property
    def offload_block_shape(self) -> tuple[int, ...]:
        """The payload shape of one block: ``[num_layers, 2 (K, V), block_size, num_kv_heads, row]`` elements of the
        cache's storage dtype (``row``: head_dim, or for an 8-bit cache head_dim codes + a 4-byte scale, so one
        block's payload holds its scales)."""
        return (len(self.kv_caches), 2, *self.kv_caches[0][0].shape[1:])

    @property
    def offload_block_nbytes(self) -> int:
        """Bytes of one block's payload (``offload_block_shape`` in the cache's storage dtype)."""
        return math.prod(self.offload_block_shape) * self.cache_dtype.itemsize

    def export_blocks(self, blocks: list[tuple[BlockId, BlockHash, bool]]) -> list[tuple[BlockHash, bytes, bool]]:
        """The target cache's contents of ``blocks`` as payload bytes (layout ``offload_block_shape``, the
        cache dtype, C order), one gather per layer and one device -> host copy."""
        idx = torch.tensor([b for b, _, _ in blocks], dtype=torch.int64, device=self.device)
        data = torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)], dim=1)
                            for k, v in self.kv_caches], dim=1)  # [n, L, 2, bs, H, D]
        raw = data.cpu().contiguous().view(torch.uint8).numpy()
        return [(h, raw[i].tobytes(), evicted) for i, (_, h, evicted) in enumerate(blocks)]

    def import_blocks(self, loads: list[tuple[BlockId, bytes]]) -> None:
        """Write payloads (as ``export_blocks`` makes them) into device blocks of the target cache.

        Raises:
            ValueError: a payload of the wrong size.
        """
        shape, nbytes = self.offload_block_shape, self.offload_block_nbytes
        for _, payload in loads:
            if len(payload) != nbytes:
                raise ValueError(f"KV payload of {len(payload)} bytes, expected {nbytes}")
        raw = np.frombuffer(b"".join(p for _, p in loads), dtype=np.uint8)
        data = torch.from_numpy(raw.copy()).view(self.cache_dtype).view(len(loads), *shape).to(self.device)
        idx = torch.tensor([b for b, _ in loads], dtype=torch.int64, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, data[:, layer, 0])
            v.index_copy_(0, idx, data[:, layer, 1])

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The forward and the sampling of a step with scheduled requests (``execute_model``'s second half;
        it fills in the step's swap and offload accounting)."""
        scheduled, draft_probs = so.scheduled, None
        if self.proposer is None and self.tp is None and self.greedy_fast_path:
            greedy = self._greedy_path()
            if greedy is not None and greedy.eligible(scheduled, self.logits_processors):
                tokens = greedy.run(scheduled)
                return ModelRunnerOutput(req_ids=[s.request.request_id for s in scheduled],
                                         sampled_token_ids=[[t] for t in tokens])
        if self.proposer is not None:
            scheduled, draft_probs = self.proposer.propose(so.scheduled)
        decodes = sorted((s for s in scheduled if s.num_scheduled_tokens == 1), key=lambda s: s.num_computed_tokens)
        decodes += [s for s in scheduled if s.draft_token_ids]  # verified as decode queries (input_batch.py)
        prefills = [s for s in scheduled if s.num_scheduled_tokens > 1 and not s.draft_token_ids]
        order = decodes + [s for s in prefills if s.num_computed_tokens > 0] + [
            s for s in prefills if s.num_computed_tokens == 0]
        batch = prepare_inputs(order, len(decodes), self.block_size, self.device, self.native_decode,
                               self.native_prefill)
        input_ids, positions, meta, logits_indices = batch
        t_forward = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.proposer is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.last_forward_seconds = time.perf_counter() - t_forward
            self.last_forward_tokens = int(input_ids.shape[0])
        if not self.is_driver:  # the same collectives as rank 0's, then nothing: rank 0 samples
            follow_prompt_logprobs(order, hidden, self.model.compute_logits)
            if logits_indices.size:
                self.model.compute_logits(_rows(hidden, logits_indices))
            self.collectives_pending = False
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        prompt_logprobs = compute_prompt_logprobs(order, hidden, self.model.compute_logits)
        sampling = [s for s in order if s.sample]
        if not sampling:
            self.collectives_pending = False
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(_rows(hidden, logits_indices))
        self.collectives_pending = False
        if any(s.draft_token_ids for s in sampling):
            return self._verify_step(sampling, logits, draft_probs, prompt_logprobs)
        requests = [s.request for s in sampling]
        _mask_stop_tokens_before_min_tokens(logits, requests)
        self.logits_processors.apply(logits, requests)
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self._generator(r.request_id, r.sampling_params.seed) for r in requests],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, metadata)
        sampled = [[t] for t in out.sampled_token_ids.tolist()]
        logprobs: list[list[TokenLogprobs] | None] | None = None
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
                logprobs.append([TokenLogprobs(ids_l[row][0], lps_l[row][0], ranks[row], top)])
        return ModelRunnerOutput(req_ids=[r.request_id for r in requests], sampled_token_ids=sampled,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 num_draft_tokens=[0] * len(requests) if self.proposer is not None else None)

    def _greedy_path(self) -> GreedyDecode | None:
        """The native greedy decode path, made on first use where the model allows it (else None)."""
        if not self._greedy_checked:
            self._greedy_checked = True
            if self.device.type == "cpu" and self.model.native_greedy_decode_ok(self.kv_caches):
                self._greedy = GreedyDecode(self.model, self.kv_caches)
        return self._greedy

    def _verify_step(self, sampling: list[ScheduledRequest], logits: torch.Tensor, draft_probs: torch.Tensor | None,
                     prompt_logprobs: dict[str, PromptLogprobsChunk]) -> ModelRunnerOutput:
        """Sample a step where some rows verify drafts: every sampling row goes through
        ``spec_decode.verify.verify_drafts`` (a row without drafts is a one-position round: the same
        distribution as the plain sampler). ``logits`` has each row's ``len(drafts) + 1`` positions."""
        tokens, logprobs = verify_drafts(logits, sampling, draft_probs, self.logits_processors, self._generator)
        asked = any(s.request.sampling_params.logprobs is not None for s in sampling)
        return ModelRunnerOutput(req_ids=[s.request.request_id for s in sampling], sampled_token_ids=tokens,
                                 logprobs=logprobs if asked else None, prompt_logprobs=prompt_logprobs,
                                 num_draft_tokens=[len(s.draft_token_ids) for s in sampling])

    # ---- swapping ------------------------------------------------------------------------------
    def swap_blocks(self, blocks_to_swap_out: list[tuple[BlockId, int]], blocks_to_swap_in: list[tuple[int, BlockId]],
                    host_pool: KVCache | None = None) -> tuple[int, float]:
        """Copy ``(device_block, host_block)`` pairs device -> host, then ``(host_block, device_block)`` host -> device.

        Args:
            host_pool: the host tensors to use (default: this runner's swap pool; the bandwidth probe
                passes a temporary one when there is no pool).
        Returns:
            ``(bytes, seconds)``: bytes copied in both directions (``block_bytes`` per block and direction)
            and the wall time of the copies (synchronized on CUDA); ``(0, 0.0)`` when there is nothing to do.
        Raises:
            IndexError: a block id outside the device cache or the host pool (e.g. no pool configured).
        """
        if not blocks_to_swap_out and not blocks_to_swap_in:
            return 0, 0.0
        groups = self.kv_groups if host_pool is None else [(self.kv_caches, host_pool)]
        pool = groups[0][1]
        num_host = pool[0][0].shape[0] if pool else 0
        for _, h in blocks_to_swap_out:
            _check_block(h, num_host, "host")
        for h, _ in blocks_to_swap_in:
            _check_block(h, num_host, "host")
        for d in [d for d, _ in blocks_to_swap_out] + [d for _, d in blocks_to_swap_in]:
            _check_block(d, self.num_blocks, "device")
        # NOTE: swap-out runs first, so a host block must not be both swapped in from and swapped out to in
        # one step (the swap-in would read the newly swapped-out data); the scheduler never reuses a host
        # block freed by a swap-in within the same step.
        assert not {h for _, h in blocks_to_swap_out} & {h for h, _ in blocks_to_swap_in}, \
            "a host block is both swap-out target and swap-in source in one step"
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # time only the copies, not queued forward work
        t0 = time.perf_counter()
        for caches, group_pool in groups:
            if blocks_to_swap_out:
                self._swap_out(blocks_to_swap_out, caches, group_pool)
            if blocks_to_swap_in:
                self._swap_in(blocks_to_swap_in, caches, group_pool)
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        group_bytes = self.block_bytes if host_pool is None else block_bytes(self.arch, self.block_size, self.dtype)
        return (len(blocks_to_swap_out) + len(blocks_to_swap_in)) * group_bytes, seconds

    def _swap_out(self, pairs: list[tuple[BlockId, int]], caches: KVCache, pool: KVCache) -> None:
        """Device blocks -> host pool, all layers. On CUDA: one gather on the device into a staging tensor
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``, one DMA into pinned memory, then a scatter
        into the pool on the CPU."""
        dev_idx = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=self.device)
        host_idx = torch.tensor([h for _, h in pairs], dtype=torch.int64)
        if self.device.type == "cpu":
            for (k, v), (hk, hv) in zip(caches, pool, strict=True):
                hk.index_copy_(0, host_idx, k.index_select(0, dev_idx))
                hv.index_copy_(0, host_idx, v.index_select(0, dev_idx))
            return
        staged = torch.empty((len(caches), 2, len(pairs), *caches[0][0].shape[1:]),
                             dtype=caches[0][0].dtype, device=self.device)
        for layer, (k, v) in enumerate(caches):
            torch.index_select(k, 0, dev_idx, out=staged[layer, 0])
            torch.index_select(v, 0, dev_idx, out=staged[layer, 1])
        host = torch.empty(staged.shape, dtype=caches[0][0].dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        torch.cuda.synchronize(self.device)  # NOTE: the DMA must land before the CPU scatters ``host``
        for layer, (hk, hv) in enumerate(pool):
            hk.index_copy_(0, host_idx, host[layer, 0])
            hv.index_copy_(0, host_idx, host[layer, 1])

    def _swap_in(self, pairs: list[tuple[int, BlockId]], caches: KVCache, pool: KVCache) -> None:
        """Host pool -> device blocks, all layers. On CUDA: one gather on the CPU into pinned staging, one
        asynchronous DMA, then a scatter on the device (stream-ordered before the forward)."""
        host_idx = torch.tensor([h for h, _ in pairs], dtype=torch.int64)
        dev_idx = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        if self.device.type == "cpu":
            for (k, v), (hk, hv) in zip(caches, pool, strict=True):
                k.index_copy_(0, dev_idx, hk.index_select(0, host_idx))
                v.index_copy_(0, dev_idx, hv.index_select(0, host_idx))
            return
        host = torch.empty((len(pool), 2, len(pairs), *pool[0][0].shape[1:]), dtype=caches[0][0].dtype, pin_memory=True)
        for layer, (hk, hv) in enumerate(pool):
            torch.index_select(hk, 0, host_idx, out=host[layer, 0])
            torch.index_select(hv, 0, host_idx, out=host[layer, 1])
        staged = host.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(caches):
            k.index_copy_(0, dev_idx, staged[layer, 0])
            v.index_copy_(0, dev_idx, staged[layer, 1])

    # ---- start-up measurements (feed the scheduler's cost model) -------------------------------
    @torch.inference_mode()
    def measure_copy_bandwidth(self, num_blocks: int = 16, repeats: int = 5) -> float:
        """Bytes per second of a device -> host -> device round trip of ``num_blocks`` blocks (median of
        ``repeats``, after one warm-up).

        Call before serving: it uses device blocks ``0 .. n-1`` and host blocks ``0 .. n-1`` (or a temporary
        host pool of ``n`` blocks when the runner has a smaller one). Each round trip writes the blocks
        back where they came from, so the device cache is left unchanged.

        Returns:
            a positive finite bytes/s (``ModelRunnerOutput.swap_bytes / swap_seconds`` measures the same).
        """
        n = max(1, min(num_blocks, self.num_blocks))
        pool = self.host_kv_caches if self.num_host_blocks >= n else allocate_host_swap_pool(
            self.arch, n, self.block_size, self.dtype, self.device)
        out = [(BlockId(i), i) for i in range(n)]
        back = [(i, BlockId(i)) for i in range(n)]
        rates: list[float] = []
        for i in range(repeats + 1):
            b1, s1 = self.swap_blocks(out, [], pool)
            b2, s2 = self.swap_blocks([], back, pool)
            if i:  # the first round trip is the warm-up
                rates.append((b1 + b2) / max(s1 + s2, 1e-9))
        return float(statistics.median(rates))

    @torch.inference_mode()
    def measure_prefill_speed(self, num_tokens: int = 256, repeats: int = 1) -> float:
        """Tokens per second of one prefill forward of a dummy prompt of ``num_tokens`` tokens (capped at the
        cache and position limits), including logits at its last token; median of ``repeats`` after one
        warm-up.

        Call before serving: it writes K/V into the first ``ceil(n / block_size)`` device blocks and zeroes
        them afterwards (the start-up state), and touches no sampler or generator state.

        Returns:
            a positive finite tokens/s.
        """
        n = max(1, min(num_tokens, self.num_blocks * self.block_size, self.model.rotary.cos.shape[0]))
        times = self._time_dummy_prefill(self.model, self.kv_caches, n, repeats, logits=True)
        return n / max(statistics.median(times), 1e-9)

    @torch.inference_mode()
    def measure_forward_times(self, sizes: list[int], model: LlamaForCausalLM | None = None,
                              kv_caches: KVCache | None = None, repeats: int = 2) -> list[tuple[int, float]]:
        """Seconds of one forward of ``n`` tokens (a dummy prompt, no logits) for each ``n`` in ``sizes``:
        the step-time curve the speculative k controller starts from (best of ``repeats`` after a warm-up).

        Args:
            model / kv_caches: another model and its cache (the draft's); default the target's.
        Call before serving: it writes K/V into the first blocks and zeroes them afterwards.
        Returns:
            ``(n, seconds)`` pairs, ``n`` capped at the cache and position limits.
        """
        model = model or self.model
        caches = kv_caches if kv_caches is not None else self.kv_caches
        cap = min(self.num_blocks * self.block_size, model.rotary.cos.shape[0])
        return [(n, min(self._time_dummy_prefill(model, caches, n, repeats, logits=False)))
                for n in sorted({min(max(1, n), cap) for n in sizes})]

    def _time_dummy_prefill(self, model: LlamaForCausalLM, caches: KVCache, n: int, repeats: int,
                            logits: bool) -> list[float]:
        """Wall seconds of ``repeats`` forwards (after one warm-up) of a dummy ``n``-token prompt written into
        the first blocks (zeroed afterwards: the start-up state), with the last token's logits if asked."""
        ids = ((np.arange(n, dtype=np.int64) * 7919 + 17) % model.config.vocab_size).tolist()
        request = Request("__measure__", ids, SamplingParams(max_tokens=1), None, 1)
        num_blocks = math.ceil(n / self.block_size)
        scheduled = ScheduledRequest(request, 0, n, [BlockId(b) for b in range(num_blocks)], sample=logits)
        cuda = self.device.type == "cuda"
        times: list[float] = []
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            input_ids, positions, meta, logits_indices = prepare_inputs(
                [scheduled], 0, self.block_size, self.device, self.native_decode, self.native_prefill)
            hidden = model(input_ids, positions, caches, meta)
            if logits:
                model.compute_logits(_rows(hidden, logits_indices))
            if cuda:
                torch.cuda.synchronize(self.device)
            if i:  # the first pass is the warm-up
                times.append(time.perf_counter() - t0)
        for k_cache, v_cache in caches:
            k_cache[:num_blocks].zero_()
            v_cache[:num_blocks].zero_()
        return times

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
    mask_before_min_tokens(logits, requests, [r.output_token_ids for r in requests])

def _check_block(block: int, num: int, where: str) -> None:
    """Raise IndexError for a block id outside ``[0, num)`` (``where``: "device" or "host")."""
    if not 0 <= block < num:
        raise IndexError(f"{where} block {block} is outside the {where} pool of {num} blocks")


def _rows(hidden: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
    """``hidden[indices]``: the rows of ``hidden`` ``[T, H]`` at the increasing positions ``indices`` ``[R]``;
    ``hidden`` itself when they are all of its rows (a pure decode step: no gather, no index tensor)."""
    n = hidden.shape[0]
    if len(indices) == n and n and int(indices[0]) == 0 and int(indices[-1]) == n - 1:
        return hidden  # (increasing and distinct, from 0 to n - 1: every row in order)
    return hidden[torch.from_numpy(indices).to(hidden.device)]
