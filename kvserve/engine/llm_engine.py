"""LLMEngine: requests in, one scheduling step at a time, RequestOutputs out.

    add_request ──▶ Scheduler.waiting ──schedule()──▶ ModelRunner.execute_model ──▶ update_from_output
                                                                                      │
    RequestOutput ◀── IncrementalDetokenizer (stop strings) ◀─────────────────────────┘
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from kvserve import cpu_features
from kvserve.config import DEFAULT_BURST_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from kvserve.core.block_hash import BlockHash
from kvserve.core.block_manager import BlockId, BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import PerfEstimates, RequestUpdate, Scheduler, SchedulerConfig
from kvserve.core.scheduler_output import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from kvserve.disagg.config import KVTransferConfig
from kvserve.disagg.protocol import RemoteDecode, RemotePrefill, parse_transfer_params
from kvserve.engine.generation_config import load_generation_defaults
from kvserve.errors import ExecutorDeadError, InvalidRequestError, PromptTooLongError
from kvserve.executor.base import Executor, UniProcExecutor
from kvserve.executor.launch import start_distributed_executor
from kvserve.kv_offload.config import build_tiers
from kvserve.kv_offload.manager import OffloadManager
from kvserve.kv_offload.tier import BlockMeta
from kvserve.layers import cpu_kernels
from kvserve.layers.kv_quant import KV8_DTYPES, layout_tag
from kvserve.models.catalog import resolve_model_path
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_gguf_blocks, load_weights
from kvserve.models.registry import ModelArchConfig
from kvserve.models.tp_shard import shard_arch
from kvserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from kvserve.sample.token_constraints import prepare_token_constraints
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.controller import SpecController
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.spec_decode.proposer import NgramRowProposer, Proposer
from kvserve.structured.backend import StructuredOutputBackend
from kvserve.structured.processor import StructuredOutputProcessor
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.tokenizer import Tokenizer
from kvserve.worker.kv_cache import (
    allocate_host_swap_pool,
    allocate_kv_cache,
    block_bytes,
    num_device_blocks,
    num_host_blocks_for,
)
from kvserve.worker.model_runner import ModelRunner, build_model

if TYPE_CHECKING:
    from kvserve.disagg.connector import ZmqConnector
    from kvserve.executor.distributed import DistributedExecutor

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def model_fingerprint(model_path: Path, arch: ModelArchConfig, tokenizer: Tokenizer | None,
                      kv_dtype: torch.dtype, model_dtype: torch.dtype | None = None,
                      compute_dtype: torch.dtype | None = None, quantization: str | None = None) -> str:
    """A sha256 hex digest naming everything that decides a KV block's contents besides its tokens.

    Covers the weights (the sha256 of each weight file's contents, so that the same model installed at
    another path or on another host shares KV through a Redis tier, while any changed byte does not), the
    architecture config, the tokenizer (its full serialized form), the KV dtype (and for int8 its row layout,
    ``kv_quant.layout_tag``: blocks of the earlier per-row int8 layout are never read as the grouped one), the
    weights' dtype, the activations' dtype (None: the KV dtype) and the weight quantization (``int8``, ``gguf``). Mixed
    into every prefix-cache block hash, so KV computed by one model can never be served to a request of another.
    """
    files = sorted(model_path.iterdir()) if model_path.is_dir() else [model_path]
    weights = sorted(file_digest(f) for f in files if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    parts = {
        "weights": weights,
        "arch": asdict(arch),
        "tokenizer": hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest() if tokenizer else None,
        "kv_dtype": str(kv_dtype),
        **({"kv_layout": layout_tag(kv_dtype)} if layout_tag(kv_dtype) else {}),
        **({"model_dtype": str(model_dtype)} if model_dtype not in (None, kv_dtype) else {}),
        **({"compute_dtype": str(compute_dtype)} if compute_dtype not in (None, kv_dtype) else {}),
        **({"quantization": quantization} if quantization else {}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


_WEIGHT_SUFFIXES = {".gguf", ".safetensors", ".bin", ".pt", ".pth"}
_DIGEST_CACHE = Path.home() / ".cache" / "kvserve" / "file_digests.json"


def file_digest(path: Path) -> str:
    """sha256 hex digest of a file's contents, cached by (resolved path, size, mtime) in
    ``~/.cache/kvserve/file_digests.json`` (hashing a GB-sized weight file takes seconds, once)."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        cache = json.loads(_DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return str(cache[key])
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    cache[key] = digest
    try:  # a concurrent writer may win; both write the same digests
        _DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _DIGEST_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, _DIGEST_CACHE)
    except OSError:
        pass
    return digest


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """``auto`` device: CUDA when present. ``auto`` dtype: bfloat16 on CUDA; on CPU bfloat16 where the CPU
    has native bf16 dot products (``avx512_bf16`` / ``amx_bf16``), else float32 (bf16 matmuls are emulated
    on e.g. AVX2-only CPUs and run several times slower than float32). The choice and the CPU's flags are
    logged."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype != "auto":
        return device, getattr(torch, config.dtype)
    if device.type != "cpu":
        return device, torch.bfloat16
    dtype = torch.bfloat16 if cpu_features.has_native_bf16() else torch.float32
    logger.info("--dtype auto -> %s on CPU %s%s", str(dtype).removeprefix("torch."), cpu_features.describe(),
                "" if dtype == torch.bfloat16 else f" (none of {', '.join(cpu_features.BF16_FLAGS)})")
    return device, dtype


def compute_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activations' dtype for weights of ``dtype``: the same, except bfloat16 weights on a CPU without
    native bf16 dot products, which compute in float32 (the native kernels widen bf16 weights in registers:
    half the bytes of float32 weights per decode step, without emulated bf16 arithmetic)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_features.has_native_bf16():
        return torch.float32
    return dtype


def resolve_quantization(config: EngineConfig, model_path: Path) -> str | None:
    """``--quantization`` as served: ``int8`` and None as given; ``gguf`` needs a ``.gguf`` checkpoint.

    Raises:
        InvalidRequestError: ``gguf`` with a checkpoint that is not a GGUF file (``param="quantization"``).
    """
    if config.quantization == "gguf" and model_path.suffix != ".gguf":
        raise InvalidRequestError(
            f"quantization: gguf serves a GGUF file's quantized blocks as they are, but model {config.model!r} is "
            f"{model_path}, not a .gguf file (use int8, or leave quantization unset)", param="quantization")
    return config.quantization


def resolve_kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` follows the model dtype (``--dtype``, as vLLM: bfloat16 weights get a
    bfloat16 cache also where the CPU computes in float32; ``kvserve plan`` sizes it so); ``float32`` /
    ``bfloat16`` as named; ``int8`` -> ``torch.int8``, ``fp8`` / ``fp8_e4m3`` -> ``torch.float8_e4m3fn`` (the
    logical dtypes of the 8-bit caches, ``layers/kv_quant.py``)."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    if config.kv_cache_dtype in KV8_DTYPES:
        return KV8_DTYPES[config.kv_cache_dtype]
    return cast(torch.dtype, getattr(torch, config.kv_cache_dtype))


def check_num_logprobs(asked: int | None, limit: int, vocab_size: int, param: str) -> None:
    """Refuse more log-probabilities per token than ``--max-logprobs`` allows (as vLLM; -1 asks for the whole
    vocabulary, a ``limit`` of -1 allows anything).

    Raises:
        InvalidRequestError: over the limit; ``param`` names the request's field.
    """
    if asked is None or limit == -1:
        return
    num = vocab_size if asked == -1 else asked
    if num > limit:
        raise InvalidRequestError(f"{param}: {asked} asks for {num} log-probabilities per token, more than the "
                                  f"{limit} this server allows (--max-logprobs)", param=param)


@dataclass
class _Sequence:
    """Engine-side state of one sample of a request: its Request and detokenizer."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[Any] | None
    text_skip: int = 0  # characters of output text not reported (a decode instance's first tokens, from P)


@dataclass
class _Group:
    """A user request: ``n`` samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    arrival_time: float
    prompt_logprobs: PromptLogprobs | None = None
    score_only: bool = False  # max_tokens=0 with prompt logprobs: the one sampled token is not reported
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    """The synchronous engine: a model, a paged KV cache, a scheduler.

    Args:
        config: the engine configuration.

    Raises:
        ModelNotFoundError: the model is unknown or not installed.
        InvalidRequestError: an invalid configuration value.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._launching: DistributedExecutor | None = None
        try:
            self._setup(config)
        except BaseException:
            executor = self._launching or getattr(self, "executor", None)
            if executor is not None:  # tensor-parallel workers already started: stop them
                executor.shutdown()
            raise

    def _setup(self, config: EngineConfig) -> None:
        self.config = config
        tp_size = config.tensor_parallel_size
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif tp_size > 1:  # threads per rank: the CPUs shared out
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp_size))
        # The intra-op threads the engine computes with; a thread that later drives it sets the same
        # (OpenMP's thread count is per calling thread; see AsyncLLM).
        self.num_threads = torch.get_num_threads()
        torch.manual_seed(config.seed)
        self.device, self.dtype = resolve_device_dtype(config)
        if tp_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # rank r computes on cuda:r
        self.compute_dtype = compute_dtype_for(self.dtype, self.device)
        if self.compute_dtype != self.dtype:
            logger.info("%s weights with %s activations: CPU %s has no native bf16 dot products", self.dtype,
                        self.compute_dtype, cpu_features.describe())
        # The weights' dtype, not the activations': on AVX2 a bf16 model computes in float32 over a bf16 cache
        # (half the KV bytes; A mixed c64 offline 1.036x the float32 cache's tok/s on Zen 3, docs/performance-log.md).
        self.kv_dtype = resolve_kv_cache_dtype(config, self.dtype)
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        # SamplingParams fields a request leaves out take these values (vLLM's --generation-config).
        self.default_sampling_params = load_generation_defaults(config.generation_config, self.model_path)
        self.quantization = resolve_quantization(config, self.model_path)
        arch, weights = (load_gguf_blocks(self.model_path) if self.quantization == "gguf"
                         else load_weights(self.model_path))
        self.arch = arch
        # What one rank holds (the whole model without tensor parallelism): its heads' KV sizes the cache.
        self.shard_arch = shard_arch(arch, tp_size)  # (refuses a size that splits a head, before any worker starts)
        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise InvalidRequestError(
                f"max_model_len: {self.max_model_len} exceeds the model's {arch.max_position_embeddings}",
                param="max_model_len")
        if config.max_num_batched_tokens is None:  # the device's default (at least a whole prompt unchunked)
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS.get(self.device.type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])
            if not config.enable_chunked_prefill:
                budget = max(budget, self.max_model_len)
            config = self.config = dataclasses.replace(config, max_num_batched_tokens=budget)
            if config.burst_batched_tokens is None:
                burst = DEFAULT_BURST_BATCHED_TOKENS.get(self.device.type, 0)
                burst = max(burst, budget) if burst else 0
                config = self.config = dataclasses.replace(config, burst_batched_tokens=burst)
        assert config.max_num_batched_tokens is not None
        self.max_num_batched_tokens: int = config.max_num_batched_tokens  # the budget in force
        self.burst_batched_tokens: int = config.burst_batched_tokens or 0  # (0: off)
        if 0 < self.burst_batched_tokens < self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"burst_batched_tokens: {self.burst_batched_tokens} must be 0 (off) or at least "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})", param="burst_batched_tokens")
        self.max_step_tokens = max(self.max_num_batched_tokens, self.burst_batched_tokens)  # sizes activations
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidRequestError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off", param="max_num_batched_tokens")
        if tp_size > 1:
            self._launching = start_distributed_executor(config, self.device, self.dtype, self.compute_dtype,
                                                         self.kv_dtype, self.max_model_len, self.num_threads)
        tp = self._launching.tp if self._launching is not None else None
        model = build_model(arch, weights, self.max_model_len, self.dtype, self.device, self.compute_dtype,
                            quantization=self.quantization, tp=tp)
        del weights
        self.tokenizer: Tokenizer | None = None
        if not config.skip_tokenizer_init:
            self.tokenizer = Tokenizer.from_path(self.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else arch.eos_token_id
        self.spec_config: SpeculativeConfig | None = config.spec
        self.draft_model = self._load_draft_model(self.spec_config) if self.spec_config else None
        self.num_blocks = self._num_blocks()
        if self._launching is not None:
            self.num_blocks = self._launching.agree_num_blocks(self.num_blocks)
        self._fit_max_model_len_to_cache()
        self.fingerprint = model_fingerprint(self.model_path, arch, self.tokenizer, self.kv_dtype, self.dtype,
                                             self.compute_dtype, self.quantization)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.prefix_caching_hash_algo, self.fingerprint)
        num_host_blocks = 0
        if config.preemption_mode != "recompute":
            num_host_blocks = num_host_blocks_for(config.swap_space * self._target_kv_share(), self.shard_arch,
                                                  config.block_size, self.kv_dtype)
        self.spec: SpecController | None = None
        if self.spec_config is not None:
            self.spec = SpecController(self.spec_config, self.max_num_batched_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                            config.enable_chunked_prefill, config.max_num_partial_prefills,
                            config.long_prefill_token_threshold, config.preemption_mode, config.scheduling_policy,
                            num_host_blocks, self.kv_block_bytes(), self.burst_batched_tokens),
            self.block_manager, spec=self.spec)
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, self.device, num_host_blocks,
                                  kv_dtype=self.kv_dtype)
        # Every call that must reach all tensor-parallel ranks goes through the executor; self.runner is rank 0's.
        self.executor: Executor = UniProcExecutor(self.runner)
        if self._launching is not None:
            self._launching.start(self.runner, self.num_blocks, num_host_blocks)
            self.executor, self._launching = self._launching, None
        # Set when a tensor-parallel rank died: every request failed, no other can be served.
        self.dead_error: ExecutorDeadError | None = None
        if self.spec_config is not None:
            self._setup_speculation(self.spec_config, num_host_blocks)
        self.offload: OffloadManager | None = None
        offload_config = config.kv_offload()
        if offload_config.enabled:
            if not config.enable_prefix_caching:
                raise InvalidRequestError("kv_offload: the offload tiers extend the prefix cache; they need "
                                          "--enable-prefix-caching", param="enable_prefix_caching")
            meta = BlockMeta(self.fingerprint, str(self.kv_dtype).removeprefix("torch."), config.block_size,
                             self.runner.offload_block_shape)
            self.offload = OffloadManager(build_tiers(offload_config, meta), config.block_size, meta.nbytes,
                                          lambda: self.perf.prefill_tokens_per_s, offload_config.publish)
            self.scheduler.set_offload(self.offload, publish=self.offload.publish)
            logger.info("KV offload tiers: %s (block %d bytes)", ", ".join(
                repr(t) if t.name == "redis" else t.name for t in self.offload.tiers), meta.nbytes)
        self.connector: ZmqConnector | None = None
        if config.kv_transfer is not None:
            self.connector = self._build_connector(config.kv_transfer)
            self.scheduler.set_connector(self.connector)
        # Structured output (xgrammar): grammars compile on first use, cached per schema (shared with the server).
        self.structured_outputs: StructuredOutputBackend | None = None
        if self.tokenizer is not None:
            self.structured_outputs = StructuredOutputBackend(self.tokenizer.hf, arch.vocab_size, self.eos_token_id)
            self.runner.logits_processors.add(StructuredOutputProcessor(self.structured_outputs))
        self.perf: PerfEstimates = self.scheduler.perf
        if config.preemption_mode == "auto" and num_host_blocks > 0:
            # The cost model's two speeds, measured here and then updated by every step (EMA).
            self.perf.copy_bytes_per_s = self.executor.measure_copy_bandwidth()
            self.perf.prefill_tokens_per_s = self.executor.measure_prefill_speed(
                min(64, self.max_num_batched_tokens, self.max_model_len))
        self.groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        logger.info("loaded %s (%s, %s, KV cache %s) in %.1f s: %d KV blocks of %d tokens", config.model,
                    self.device, self.dtype, self.kv_dtype, time.perf_counter() - t0, self.num_blocks,
                    config.block_size)

    def _build_connector(self, cfg: KVTransferConfig) -> ZmqConnector:
        """The PD-disaggregation KV connector (``--kv-transfer-config``); a producer binds its port here.

        Raises:
            InvalidRequestError: the producer's ``kv_ip:kv_port`` cannot be bound.
        """
        import zmq

        from kvserve.disagg.connector import ZmqConnector

        runner = self.runner

        def export(block_ids: list[int]) -> list[bytes]:
            return [p for _, p, _ in runner.export_blocks([(BlockId(b), BlockHash(b""), False) for b in block_ids])]

        try:
            connector = ZmqConnector(cfg, self.fingerprint, self.config.block_size, runner.offload_block_nbytes,
                                     str(self.kv_dtype).removeprefix("torch."), runner.offload_block_shape, export)
        except zmq.ZMQError as e:
            raise InvalidRequestError(f"kv_transfer_config: cannot bind {cfg.kv_ip}:{cfg.kv_port} ({e})",
                                      param="kv_transfer_config") from None
        logger.info("KV transfer: %s as %s, engine id %s%s", cfg.kv_connector, cfg.kv_role, connector.engine_id,
                    f", serving KV on {cfg.kv_ip}:{connector.port}" if cfg.is_producer else "")
        return connector

    # ---- speculative decoding ------------------------------------------------------------------
    def _load_draft_model(self, spec: SpeculativeConfig) -> LlamaForCausalLM | None:
        """The draft model of ``method: draft_model`` (None for n-gram), in the target's dtypes.

        Raises:
            ModelNotFoundError: the draft is unknown or not installed.
            InvalidRequestError: its vocabulary differs from the target's (size or tokens), or its context
                is shorter than ``max_model_len``.
        """
        if spec.method != "draft_model" or spec.model is None:
            return None
        path = resolve_model_path(spec.model)
        d_arch, d_weights = load_weights(path)
        if d_arch.vocab_size != self.arch.vocab_size:
            raise InvalidRequestError(
                f"speculative_config.model: the draft {spec.model!r} has a vocabulary of {d_arch.vocab_size} tokens, "
                f"the target {self.config.model!r} {self.arch.vocab_size}; they must share one tokenizer",
                param="speculative_config")
        if self.tokenizer is not None:
            d_tok = Tokenizer.from_path(path)
            if d_tok.backend.get_vocab() != self.tokenizer.backend.get_vocab():
                raise InvalidRequestError(
                    f"speculative_config.model: the draft {spec.model!r} has a different vocabulary (tokenizer) than "
                    f"the target {self.config.model!r}; they must share one tokenizer", param="speculative_config")
        if d_arch.max_position_embeddings < self.max_model_len:
            raise InvalidRequestError(
                f"speculative_config.model: the draft's context ({d_arch.max_position_embeddings}) is shorter than "
                f"max_model_len ({self.max_model_len})", param="speculative_config")
        self.draft_arch = d_arch
        draft = build_model(d_arch, d_weights, self.max_model_len, self.dtype, self.device, self.compute_dtype)
        logger.info("speculative decoding: draft model %s (%d layers), k_max %d", spec.model, d_arch.num_hidden_layers,
                    spec.num_speculative_tokens)
        return draft

    def _target_kv_share(self) -> float:
        """The target's share of KV memory (1 without a draft model; the draft's cache has as many blocks)."""
        if self.draft_model is None:
            return 1.0
        t = block_bytes(self.shard_arch, self.config.block_size, self.kv_dtype)
        return t / (t + block_bytes(self.draft_arch, self.config.block_size, self.kv_dtype))

    def _setup_speculation(self, spec: SpeculativeConfig, num_host_blocks: int) -> None:
        """The runner's proposer (and a draft model's KV cache), then the start-up step-time probe."""
        assert self.spec is not None
        runner = self.runner
        proposer: Proposer
        if self.draft_model is not None:
            bs = self.config.block_size
            caches = allocate_kv_cache(self.draft_arch, self.num_blocks, bs, self.kv_dtype, self.device)
            host = allocate_host_swap_pool(self.draft_arch, num_host_blocks, bs, self.kv_dtype, self.device)
            runner.add_kv_group(caches, host, block_bytes(self.draft_arch, bs, self.kv_dtype))
            proposer = DraftModelProposer(self.draft_model, caches, bs, self.device, runner._generator,
                                          runner.native_decode, runner.native_prefill)
            if spec.adaptive:
                for n, t in runner.measure_forward_times(self._probe_sizes(), self.draft_model, caches):
                    self.spec.draft_time.observe(n, t)
        else:
            proposer = NgramRowProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        runner.proposer = proposer
        if spec.adaptive:
            for n, t in runner.measure_forward_times(self._probe_sizes()):
                self.spec.target_time.observe(n, t)
            logger.info("speculative decoding: target step times %s", ", ".join(
                f"{n:.0f}: {1e3 * t:.1f} ms" for n, t in self.spec.target_time.table()))

    def _probe_sizes(self) -> list[int]:
        return [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= self.max_num_batched_tokens]

    def _fit_max_model_len_to_cache(self) -> None:
        """As vLLM: a KV cache smaller than ``max_model_len`` refuses to start when ``--max-model-len`` was
        given, else ``max_model_len`` is lowered to the cache's capacity (with a warning), so that every
        request the length check admits can run to its ``max_tokens``.

        Raises:
            InvalidRequestError: ``max_model_len`` was given and exceeds the capacity (both numbers named).
        """
        capacity = self.kv_cache_capacity_tokens
        if self.max_model_len <= capacity:
            return
        where = f"{self.num_blocks} KV blocks of {self.config.block_size} tokens"
        if self.config.max_model_len is not None:
            raise InvalidRequestError(
                f"max_model_len: {self.max_model_len} is larger than the {capacity} tokens the KV cache can hold "
                f"({where}); give the cache more memory (--kv-cache-memory, --gpu-memory-utilization, "
                f"--num-gpu-blocks-override) or lower --max-model-len", param="max_model_len")
        logger.warning("max_model_len lowered from the model's %d to %d, the tokens the KV cache can hold (%s); "
                       "give the cache more memory to serve longer sequences", self.max_model_len, capacity, where)
        self.max_model_len = capacity

    def _num_blocks(self) -> int:
        """The KV blocks this process's budget holds (under tensor parallelism: rank 0's, of its KV heads)."""
        return num_device_blocks(self.config, self.shard_arch, self.kv_dtype, self.dtype, self.device,
                                 self.max_step_tokens, self._target_kv_share())

    # ---- requests ------------------------------------------------------------------------------
    @property
    def kv_cache_capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def max_concurrency(self) -> float:
        """How many requests of ``max_model_len`` tokens the KV cache holds at once."""
        return self.kv_cache_capacity_tokens / self.max_model_len

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over all layers, K and V (the draft model's cache included); under tensor
        parallelism one rank's share (its KV heads), which every rank copies in parallel."""
        bs = self.config.block_size
        draft = block_bytes(self.draft_arch, bs, self.kv_dtype) if self.draft_model is not None else 0
        return block_bytes(self.shard_arch, bs, self.kv_dtype) + draft

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt: text needs a tokenizer (skip_tokenizer_init is set)", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt: must be a string or a list of token ids", param="prompt")
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt: token id {bad} is out of range [0, {vocab})", param="prompt")
        return None, list(prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request; returns its id.

        Raises:
            InvalidRequestError: empty or malformed prompt, token ids out of range, stop strings without
                a tokenizer, a structured-output constraint that does not compile.
            PromptTooLongError: the prompt leaves no room for one output token within ``max_model_len``
                (which never exceeds the KV cache's capacity, see ``_fit_max_model_len_to_cache``).
        """
        self._check_alive()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use", param="request_id")
        text, ids = self._prompt_ids(prompt)
        params = prepare_token_constraints(params, self.arch.vocab_size, self.tokenizer)
        if params.structured_outputs is not None:  # compiles (or finds in the cache); 400 when invalid
            if self.structured_outputs is None:
                raise InvalidRequestError(f"{params.structured_outputs.field}: needs a tokenizer "
                                          "(skip_tokenizer_init is set)", param=params.structured_outputs.field)
            self.structured_outputs.compile(params.structured_outputs)
        if params.truncate_prompt_tokens is not None:  # keep the last k tokens (-1: max_model_len)
            k = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-k:]
        n = len(ids)
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt: this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{n} tokens (no room for any output)", param="prompt")
        self._check_num_logprobs(params)
        transfer = self._check_transfer(params, n)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop: stop strings need a tokenizer", param="stop")
        limit = self.max_model_len - n
        max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        # max_tokens=0 with prompt logprobs scores the prompt (echo + logprobs): it runs to one hidden token.
        score_only = max_tokens == 0 and params.prompt_logprobs is not None
        max_tokens = 1 if score_only else max_tokens
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, text, ids, params, [], arrival,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       score_only=score_only)
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = params if params.n == 1 else params.clone(n=1, seed=seed)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, child, self.eos_token_id, max_tokens, arrival, priority, cache_salt)
            detok = IncrementalDetokenizer(self.tokenizer.backend, ids, child) if self.tokenizer else None
            seq = _Sequence(req, i, detok, [] if params.logprobs is not None else None)
            req.kv_transfer = transfer
            if isinstance(transfer, RemotePrefill):  # P sampled these (streamed by the proxy): D goes on after them
                for token_id in transfer.first_token_ids:
                    req.append_output_token(token_id)
                if detok is not None:
                    detok.update(transfer.first_token_ids)
                    seq.text_skip = len(detok.output_text)
            group.sequences.append(seq)
        self.groups[request_id] = group
        for seq in group.sequences:
            self._seq_to_group[seq.request.request_id] = group
            if max_tokens == 0:
                seq.request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if max_tokens > 0:
            # n > 1: sample 0 computes the prompt; the others fork its blocks (Scheduler.add_forks).
            self.scheduler.add_request(group.sequences[0].request)
            if params.n > 1:
                self.scheduler.add_forks(group.sequences[0].request, [seq.request for seq in group.sequences[1:]])
        if group.finished:
            self._pending.append(self._finish_group(group))
        return request_id

    def _check_transfer(self, params: SamplingParams, num_prompt_tokens: int) -> RemoteDecode | RemotePrefill | None:
        """Validate a request's ``kv_transfer_params`` against this instance's role.

        Raises:
            InvalidRequestError: malformed params, no ``--kv-transfer-config`` with the needed role, n > 1,
                a prompt whose length differs from the prefill instance's, too few ``max_tokens``, or
                out-of-vocabulary first tokens (``param`` is ``kv_transfer_params``).
        """
        transfer = parse_transfer_params(params.kv_transfer_params)
        if transfer is None:
            return None

        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"kv_transfer_params: {msg}", param="kv_transfer_params")

        c = self.connector
        if isinstance(transfer, RemoteDecode):
            if c is None or not c.config.is_producer:
                raise bad("do_remote_decode needs an instance started with --kv-transfer-config and kv_role "
                          "kv_producer or kv_both")
        else:
            if c is None or not c.config.is_consumer:
                raise bad("do_remote_prefill needs an instance started with --kv-transfer-config and kv_role "
                          "kv_consumer or kv_both")
            if transfer.num_prompt_tokens != num_prompt_tokens:
                raise bad(f"the prefill instance computed {transfer.num_prompt_tokens} prompt tokens, this request "
                          f"has {num_prompt_tokens} (send the same prompt and chat template to both)")
            if params.max_tokens is not None and params.max_tokens <= len(transfer.first_token_ids):
                raise bad(f"max_tokens {params.max_tokens} leaves nothing to decode after the "
                          f"{len(transfer.first_token_ids)} token(s) the prefill instance sampled")
            if any(not 0 <= t < self.arch.vocab_size for t in transfer.first_token_ids):
                raise bad("first_token_ids holds a token id out of the vocabulary")
            if params.structured_outputs is not None:
                raise bad("structured outputs are not supported on a decode instance (send them to one instance)")
        if params.n > 1:
            raise bad("n > 1 is not supported with kv_transfer_params (send one request per sample)")
        if params.prompt_logprobs is not None:
            raise bad("prompt_logprobs are not supported with kv_transfer_params")
        return transfer

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); every KV block they held is freed."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            self.scheduler.finish_requests([s.request.request_id for s in group.sequences],
                                           RequestStatus.FINISHED_ABORTED)
            self._finish_group(group)

    def bind_compute_threads(self) -> list[int] | None:
        """Pin the calling thread's OpenMP team to CPUs as ``config.cpu_threads_bind`` says (see EngineConfig);
        call it from the thread that will step the engine (AsyncLLM's loop thread does).

        Returns:
            The CPUs thread 0, 1, ... were pinned to, or None when nothing was pinned (not a CPU engine, ``none``,
            ``auto`` with fewer threads than the process's CPUs, no native kernels to pin with, or tensor
            parallelism: its executor pins every rank to CPUs of its own, docs/distributed.md).
        """
        spec = self.config.cpu_threads_bind
        if (self.device.type != "cpu" or spec == "none" or not cpu_kernels.native_available()
                or self.config.tensor_parallel_size > 1):
            return None
        allowed = sorted(os.sched_getaffinity(0))
        if spec == "auto":
            if self.num_threads != len(allowed):
                return None
            cpus = allowed
        else:
            cpus = cpu_features.parse_cpu_list(spec)
        team = cpu_kernels.pin_omp_threads(cpus)
        if team < 0:
            logger.warning("could not pin the compute threads to CPUs %s", cpus)
            return None
        pinned = [cpus[t % len(cpus)] for t in range(team)]
        logger.info("compute threads pinned to CPUs %s (--cpu-threads-bind %s)", pinned, spec)
        return pinned

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._pending)

    def poll_background(self) -> None:
        """Work an idle engine still has: free the blocks pinned for decode instances that confirmed (or
        whose ``kv_transfer_timeout_s`` passed), and notice a tensor-parallel rank that died (then
        ``dead_error`` is set and the failed requests' outputs come from the next ``step()``). ``step()`` does the
        same; the server loop calls this."""
        self.scheduler.release_pins()
        try:
            self.executor.check_health()
        except ExecutorDeadError as e:
            self._pending += self._fail_all(e)

    def _check_alive(self) -> None:
        """Raise the engine's death (a tensor-parallel rank died) as ``ExecutorDeadError``."""
        if self.dead_error is None:
            try:
                self.executor.check_health()
            except ExecutorDeadError as e:
                self._pending += self._fail_all(e)
        if self.dead_error is not None:
            raise self.dead_error

    def _fail_all(self, error: ExecutorDeadError) -> list[RequestOutput]:
        """The executor died: finish every request with ``error`` (their outputs returned), stop the workers left;
        from now on the engine refuses requests."""
        self.dead_error = error
        outputs = []
        for group in list(self.groups.values()):
            ids = [seq.request.request_id for seq in group.sequences]
            for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR):
                req.error = f"{type(error).__name__}: {error}"
            outputs.append(self._finish_group(group))
        self.executor.shutdown()
        return outputs

    def idle_wait_s(self) -> float | None:
        """How long an idle engine loop may sleep before ``poll_background`` has work (None: until woken)."""
        return self.connector.next_deadline_s() if self.connector is not None else None

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of every request that changed.

        An exception inside the model fails only the requests of that step (status ``error``); the
        engine stays usable.
        """
        outputs, self._pending = self._pending, []
        if self.dead_error is not None:
            return outputs
        so = self.scheduler.schedule()
        if so.is_empty and not so.blocks_to_swap_out and not so.blocks_to_offload:
            if so.finished_request_ids:  # (the runner is skipped: its per-request state is dropped here)
                self.executor.forget_requests(so.finished_request_ids)
            if self.offload is not None and self.offload.num_fetching:
                self.offload.wait_fetches(0.005)  # requests wait for their blocks: sleep, don't spin
            if self.connector is not None and self.connector.num_pulling:
                self.connector.wait_pulls(0.005)
            return outputs
        try:
            t0 = time.perf_counter()
            runner_out = self.executor.execute_model(so)
            self._update_perf(so, runner_out, time.perf_counter() - t0)
            if self.spec is not None and self.runner.last_forward_tokens:
                self.spec.target_time.observe(self.runner.last_forward_tokens, self.runner.last_forward_seconds)
                if self.runner.proposer is not None:
                    for n, t in self.runner.proposer.take_timings():
                        self.spec.draft_time.observe(n, t)
            if self.offload is not None and runner_out.offloaded:
                self.offload.offer(runner_out.offloaded)
        except ExecutorDeadError as e:  # a tensor-parallel rank died: nothing more can run
            logger.error("tensor parallelism stopped (%s); failing all %d requests", e, len(self.groups))
            return outputs + self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the engine
            logger.exception("model step failed; failing its %d requests", len(so.scheduled))
            self.scheduler.recompute_swapped(so.preempted_request_ids)
            failed = {g.request_id: g for g in (self._seq_to_group[s.request.request_id] for s in so.scheduled)}
            for group in failed.values():
                seq_ids = [seq.request.request_id for seq in group.sequences]
                for req in self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ERROR):
                    req.error = f"{type(e).__name__}: {e}"
                outputs.append(self._finish_group(group))
            return outputs
        for seq_id, chunk in runner_out.prompt_logprobs.items():
            if seq_id in self._seq_to_group:
                self._add_prompt_logprobs(self._seq_to_group[seq_id], chunk)
        updates = self.scheduler.update_from_output(so, runner_out)
        if self.offload is not None and self.offload.publish:
            self._publish_committed()
        changed: dict[str, _Group] = {}
        now = time.monotonic()
        for upd in updates:
            group = self._seq_to_group[upd.request.request_id]
            self._apply_update(group, upd)
            if group.first_token_time is None:
                group.first_token_time = now
            changed[group.request_id] = group
        for group in changed.values():
            outputs.append(self._finish_group(group) if group.finished else self._make_output(group))
        return outputs

    _EMA = 0.2  # weight of the newest sample in the running speed estimates

    def _update_perf(self, so: SchedulerOutput, out: ModelRunnerOutput, seconds: float) -> None:
        """Refresh the cost model's speeds from this step: copy bandwidth from its swaps, prefill speed from
        steps that are mostly prefill (>= 64 prefill tokens making >= 75 % of the step's tokens)."""
        def ema(old: float, sample: float) -> float:  # the first sample replaces an unmeasured (0) value
            return sample if old <= 0 else (1 - self._EMA) * old + self._EMA * sample

        perf = self.perf
        if out.swap_bytes > 0 and out.swap_seconds > 0:
            perf.copy_bytes_per_s = ema(perf.copy_bytes_per_s, out.swap_bytes / out.swap_seconds)
        prefill = sum(s.num_scheduled_tokens for s in so.scheduled
                      if s.num_scheduled_tokens > 1 and not s.num_spec_tokens)
        total = so.total_num_scheduled_tokens
        if prefill >= 64 and prefill >= 0.75 * total and seconds > out.swap_seconds:
            perf.prefill_tokens_per_s = ema(perf.prefill_tokens_per_s, total / (seconds - out.swap_seconds))

    def _check_num_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            check_num_logprobs(getattr(params, name), self.config.max_logprobs, self.arch.vocab_size, name)

    def _add_prompt_logprobs(self, group: _Group, chunk: PromptLogprobsChunk) -> None:
        """Append a step's scored prompt tokens in vLLM's shape (a recomputed prompt's repeats are dropped)."""
        lps = group.prompt_logprobs
        if lps is None:
            return
        skip = len(lps) - chunk.start  # rows already there (a preempted request recomputes its prompt)
        if skip < 0 or skip >= len(chunk.ranks):
            return
        for ids, values, rank in zip(chunk.token_ids[skip:], chunk.logprobs[skip:], chunk.ranks[skip:], strict=True):
            entry = {ids[0]: Logprob(values[0], rank, self._token_text(ids[0]))}
            for r, (t, v) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
                entry.setdefault(t, Logprob(v, r, self._token_text(t)))
            lps.append(entry)

    def _token_text(self, token_id: int) -> str | None:
        """One token's text (cached), vLLM's ``Logprob.decoded_token``; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _apply_update(self, group: _Group, upd: RequestUpdate) -> None:
        seq = group.sequences[0] if len(group.sequences) == 1 else next(
            s for s in group.sequences if s.request is upd.request)
        if group.score_only:
            return  # the token only ended the prompt's scoring step
        if seq.logprobs is not None:
            seq.logprobs.extend(upd.new_logprobs)
        if seq.detokenizer is not None:
            new_ids = upd.new_token_ids
            if upd.request.status == RequestStatus.FINISHED_STOPPED and not group.params.include_stop_str_in_output:
                new_ids = new_ids[:-1]  # EOS or a stop token id: its text is not output (as vLLM)
            before = len(seq.detokenizer.output_token_ids)
            stop = seq.detokenizer.update(new_ids)
            used = len(seq.detokenizer.output_token_ids) - before
            if stop is not None and used < len(upd.new_token_ids):
                # Several tokens this step (speculative decoding) and a stop string ended inside them: the
                # tokens after it are dropped, as one token per step would never have produced them.
                drop = len(upd.new_token_ids) - used
                upd.request.truncate_output(drop)
                if seq.logprobs is not None:
                    del seq.logprobs[len(seq.logprobs) - drop:]
            if stop is not None and not upd.request.is_finished:
                upd.request.stop_reason = stop
                self.scheduler.finish_requests([upd.request.request_id], RequestStatus.FINISHED_STOPPED)
            elif stop is not None:
                # Finished on a token in the same step (e.g. max_tokens) but the text hit a stop string.
                upd.request.stop_reason = stop
                upd.request.status = RequestStatus.FINISHED_STOPPED

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for seq in group.sequences:
            req = seq.request
            finished = req.is_finished
            text = ""
            if seq.detokenizer is not None:
                text = seq.detokenizer.get_next_output_text(finished, delta=False)[seq.text_skip:]
            token_ids = [] if group.score_only else list(req.output_token_ids)
            outs.append(CompletionOutput(seq.index, text, token_ids,
                                         list(seq.logprobs) if seq.logprobs is not None else None,
                                         req.status.finish_reason, req.stop_reason))
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        scheduled = group.sequences[0].request.first_scheduled_time
        if scheduled is not None:  # queue time = first_scheduled_time - arrival_time (server metrics)
            metrics["first_scheduled_time"] = scheduled
        errors = [s.request.error for s in group.sequences if s.request.error]
        out = group.sequences[0].request.kv_transfer_out
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, group.finished,
                             list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
                             group.sequences[0].request.num_cached_tokens,
                             errors[0] if errors else None, metrics,
                             out.to_dict() if isinstance(out, RemotePrefill) else None)

    def _finish_group(self, group: _Group) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        for seq in group.sequences:
            self._seq_to_group.pop(seq.request.request_id, None)
        out = self._make_output(group)
        out.metrics["finished_time"] = time.monotonic()
        return out

    def _publish_committed(self) -> None:
        """Hand the blocks this step committed to the offload writer now (their K/V were written by the
        forward just done), rather than at the next ``schedule()``, which an idle engine never runs."""
        assert self.offload is not None
        evicted, committed = self.block_manager.take_offload()
        blocks = [(b, h, True) for b, h in evicted] + [(b, h, False) for b, h in committed]
        if blocks:
            self.offload.offer(self.runner.export_blocks(blocks))

    def close(self) -> None:
        """Write the prefix blocks still on the device to the local offload tiers (so that a disk tier
        serves them after a restart), store everything queued, and close the tiers (idempotent); stop the KV
        connector; stop the tensor-parallel workers."""
        if self.connector is not None:
            self.connector.close()
        if self.offload is not None and not self.offload.closed:
            if self.offload.local:
                cached = list(self.block_manager.cached_blocks.items())
                for i in range(0, len(cached), 256):
                    chunk = [(b, h, True) for h, b in cached[i:i + 256]]
                    self.offload.offer(self.runner.export_blocks(chunk))
                    self.offload.flush()
            self.offload.close()
        self.executor.shutdown()

    # ---- stats ---------------------------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prefix-cache counters since start: ``queries`` and ``hits`` in prompt tokens (each request
        counted once, at its first admission), ``hit_rate`` = hits / queries (0 before any query), and
        ``cached_blocks`` / ``evictions`` in blocks."""
        s, bm = self.scheduler, self.block_manager
        return {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                "hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
                "cached_blocks": bm.num_cached_blocks, "evictions": bm.num_evictions}

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request uses; returns how many were dropped."""
        return self.block_manager.reset_prefix_cache()
