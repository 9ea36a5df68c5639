"""Engine configuration: frozen dataclasses validated once, plus their CLI flags (spelled as vLLM's)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvserve import cpu_features
from kvserve.disagg.config import KVTransferConfig
from kvserve.errors import InvalidRequestError
from kvserve.kv_offload.config import KVOffloadConfig
from kvserve.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("int8", "gguf")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}: {message}", param=name)


# Token budget of one step by device type when --max-num-batched-tokens is not given. CPU: measured on Zen 4
# (2 threads, SmolLM2 bf16, vs_peers workload A): 512-token steps beat 2,048 on output tok/s (c16 1.25x,
# c64 1.1x), TTFT p99 and ITL p99 (1/2 to 1/4): a step's activations stay in cache and decodes wait for
# shorter prefill chunks. CUDA: vLLM's default for online serving.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# Budget of a step while a burst's prompts wait (at least this many prompt tokens not yet computed), when neither
# --max-num-batched-tokens nor --burst-batched-tokens is given (0: off). CPU: vLLM-CPU's step budget; the bursts'
# prompts are prefilled in fewer steps, and outside bursts steps stay at 512 (docs/performance-log.md).
DEFAULT_BURST_BATCHED_TOKENS = {"cpu": 2048, "cuda": 0}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start, validated in ``__post_init__``.

    Attributes:
        model: a catalog name (see ``kvserve.models.catalog``), a local HF folder or a ``.gguf`` path.
        dtype: weight and activation dtype, ``float32`` | ``bfloat16`` | ``float16`` | ``auto``
            (``auto``: bfloat16 on CUDA and on CPUs with native bf16 dot products, ``avx512_bf16`` or
            ``amx_bf16``; float32 on other CPUs).
        kv_cache_dtype: ``auto`` (the model dtype) | ``float32`` | ``bfloat16`` | ``int8`` | ``fp8`` (=
            ``fp8_e4m3``): the 8-bit formats store scales with the codes, int8 a float16 per 16 channels, fp8
            a float32 per token and KV head (``layers/kv_quant.py``); a budget holds 1.78× (int8) and
            1.88–1.94× (fp8) the blocks of bfloat16.
        quantization: None (weights in ``dtype``) | ``int8``: the decoder layers' projections and the LM head
            as per-output-channel symmetric int8 with float32 scales, quantized at load from the checkpoint's
            float32 tensors; activations quantized per token at each call (docs/quantization.md). The
            embedding table and the norms keep ``dtype``. | ``gguf`` (a ``.gguf`` checkpoint only): the file's
            quantized tensors (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) served in their blocks, without
            dequantizing them at load; activations quantized per token and group of 32 at each call.
        device: ``auto`` | ``cpu`` | ``cuda`` (``auto``: CUDA when present).
        max_model_len: longest sequence (prompt + output) in tokens; None: the model's own limit.
        block_size: tokens per KV block.
        kv_cache_memory: GiB of memory for the KV cache on CPU.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights + KV) on CUDA.
        num_gpu_blocks_override: exact number of KV blocks (tests and benchmarks), overrides the budget.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); None: the device's
            default (``DEFAULT_MAX_NUM_BATCHED_TOKENS``: 512 on CPU, 2,048 on CUDA), and at least
            ``max_model_len`` when chunked prefill is off. On CPU, 512-token steps served workload A 1.2-1.4x
            the tokens/s of 2,048-token steps with a third of the ITL p99 (docs/performance-log.md).
        burst_batched_tokens: token budget of a step while at least that many prompt tokens wait to be
            prefilled (a burst of arrivals: fewer, larger prefill steps; ``SchedulerConfig.step_budget``); 0: off;
            None: ``DEFAULT_BURST_BATCHED_TOKENS`` (2,048 on CPU, off on CUDA) when ``max_num_batched_tokens``
            is not given, else off. Must be 0 or at least ``max_num_batched_tokens``.
        enable_chunked_prefill: split prompts over steps under the budget; off: a prompt is prefilled
            whole (then ``max_num_batched_tokens`` must be >= ``max_model_len``).
        num_threads: torch intra-op threads on CPU (None: leave torch's default).
        cpu_threads_bind: pin the serving engine's compute threads to CPUs (as vLLM's
            ``VLLM_CPU_OMP_THREADS_BIND``): ``auto`` (pin thread t to the t-th CPU of the process's set when
            the engine uses every one of them: nothing else is meant to run there), ``none``, or a CPU list
            such as ``0-3`` or ``0,2`` (thread t on the t-th listed CPU, wrapping around).
        seed: seed of the global RNG used by requests without their own seed.
        skip_tokenizer_init: do not load a tokenizer (prompts must be token ids).
        served_model_name: the name clients use (default: ``model``).
        enable_prefix_caching: reuse the KV of full blocks whose chained hash (tokens, model fingerprint,
            cache salt) matches; on by default, as vLLM.
        prefix_caching_hash_algo: ``sha256`` (collision-safe, default) | ``xxhash`` (faster, 128-bit).
        max_num_partial_prefills: how many prompts may be mid-prefill (chunked) at once.
        long_prefill_token_threshold: a prompt longer than this is "long" and gets at most this many
            tokens per step (0: no cap); with ``max_num_partial_prefills > 1`` it defaults to 4 % of
            ``max_model_len`` (as vLLM).
        preemption_mode: ``auto`` (per victim, the cheaper of recompute and swap by the measured cost
            model) | ``recompute`` | ``swap``.
        swap_space: GiB of host memory for swapped-out KV blocks.
        scheduling_policy: ``fcfs`` | ``priority`` (lower ``priority`` value runs first, as vLLM).
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` a request may ask for (-1: no limit), as vLLM.
        generation_config: default sampling parameters: ``auto`` (the model's generation_config.json, as
            vLLM), ``vllm`` (none) or a folder with a generation_config.json.
        kv_offload_cpu_gib: KV offload: host-memory tier for blocks evicted from the device pool (GiB; 0: off).
        kv_offload_disk_path / kv_offload_disk_gib: a directory tier (write-through behind the cpu tier,
            survives restarts) and its size (GiB; used only with a path).
        kv_offload_redis_url: a Redis pool shared by instances (``redis://host:port/db``, ``rediss://``);
            it must be a trusted, authenticated store: whoever can write to it can poison cached KV.
        kv_offload_redis_prefix: key prefix of this deployment in that Redis.
        kv_offload_redis_timeout: seconds per Redis call before it counts as a miss.
        kv_offload_publish: publish blocks computed here to Redis (False: read-only instance).
        speculative_config: speculative decoding, vLLM's JSON object (text or dict), e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}``; parsed into a
            ``spec_decode.config.SpeculativeConfig``. None: off.
        kv_transfer_config: prefill/decode disaggregation, vLLM's JSON object (text or dict), parsed into a
            ``disagg.config.KVTransferConfig``. None: off.
        tensor_parallel_size: ranks the model is split over (docs/distributed.md): each holds its share of the
            attention heads (and of their KV cache), of the MLP and of the vocabulary; gloo on CPU, NCCL on CUDA
            (one GPU per rank). ``num_threads`` and ``kv_cache_memory`` are per rank. Refused with
            ``quantization``, ``speculative_config``, the KV offload tiers and ``kv_transfer_config``.
        distributed_executor_backend: what runs ranks 1..N-1: ``mp`` (child processes; the default) or ``ray``
            (Ray actors on a local cluster, or the one ``--ray-address`` names). Rank 0 runs in the engine process.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float = 2.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    burst_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    cpu_threads_bind: str = "auto"
    seed: int = 0
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "auto"
    swap_space: float = 4.0
    scheduling_policy: str = "fcfs"
    generation_config: str = "auto"
    max_logprobs: int = 20
    speculative_config: SpeculativeConfig | str | dict[str, Any] | None = None
    kv_offload_cpu_gib: float = 0.0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_gib: float = 10.0
    kv_offload_redis_url: str | None = None
    kv_offload_redis_prefix: str = "kvserve:"
    kv_offload_redis_timeout: float = 0.2
    kv_offload_publish: bool = True
    kv_transfer_config: KVTransferConfig | str | dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_value(self.kv_transfer_config))
        self.kv_offload()  # validates the offload fields
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
                 f"must be None or one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _require(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 f"must be >= 2, got {self.max_model_len}")
        _require(1 <= self.block_size <= 1024, "block_size", f"must be in [1, 1024], got {self.block_size}")
        _require(self.kv_cache_memory > 0, "kv_cache_memory", f"must be > 0 GiB, got {self.kv_cache_memory}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.burst_batched_tokens is None or self.burst_batched_tokens >= 0, "burst_batched_tokens",
                 f"must be >= 0, got {self.burst_batched_tokens}")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                 f"must be >= 1, got {self.num_threads}")
        if self.cpu_threads_bind not in ("auto", "none"):
            try:
                cpu_features.parse_cpu_list(self.cpu_threads_bind)
            except ValueError as e:
                _require(False, "cpu_threads_bind", f"must be auto, none or a CPU list like 0-3; {e}")
        _require(self.prefix_caching_hash_algo in ("sha256", "xxhash"), "prefix_caching_hash_algo",
                 f"must be sha256 or xxhash, got {self.prefix_caching_hash_algo!r}")
        _require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills",
                 f"must be >= 1, got {self.max_num_partial_prefills}")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 f"must be >= 0, got {self.long_prefill_token_threshold}")
        _require(self.preemption_mode in ("auto", "recompute", "swap"), "preemption_mode",
                 f"must be auto, recompute or swap, got {self.preemption_mode!r}")
        _require(self.swap_space >= 0, "swap_space", f"must be >= 0 GiB, got {self.swap_space}")
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                 f"must be fcfs or priority, got {self.scheduling_policy!r}")
        _require(self.max_logprobs >= -1, "max_logprobs", f"must be >= 0 or -1 (no limit), got {self.max_logprobs}")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """``tensor_parallel_size`` in range and not combined with what cannot run sharded yet (both flags named)."""
        tp = self.tensor_parallel_size
        _require(tp >= 1, "tensor_parallel_size", f"must be >= 1, got {tp}")
        _require(self.distributed_executor_backend in (None, "mp", "ray"), "distributed_executor_backend",
                 f"must be mp or ray, got {self.distributed_executor_backend!r}")
        if tp == 1:
            return
        refused = [("quantization", self.quantization is not None, f"--quantization {self.quantization}"),
                   ("speculative_config", self.speculative_config is not None, "--speculative-config"),
                   ("kv_offload", self.kv_offload().enabled, "the KV offload tiers (--kv-offload-*)"),
                   ("kv_transfer_config", self.kv_transfer_config is not None, "--kv-transfer-config")]
        for name, on, flag in refused:
            _require(not on, "tensor_parallel_size", f"--tensor-parallel-size {tp} cannot be combined with {flag} "
                     f"({name}) yet; use --tensor-parallel-size 1 or leave {flag} out")

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags, named as vLLM's (``--max-num-seqs``, ``--block-size``, ...)."""
        d = EngineConfig()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model, help="catalog name, HF folder or .gguf path")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                       help="KV cache dtype; auto: the model dtype; int8: 8 bits with a float16 scale per 16 "
                            "channels; fp8 (= fp8_e4m3): 8 bits with a float32 scale per token and KV head")
        g.add_argument("--quantization", default=None,
                       help="int8: int8 weights (per output channel, quantized at load) and int8 activations "
                            "(per token) in every linear of the decoder and the LM head; gguf (.gguf models): the "
                            "file's quantized blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) as they are, multiplied "
                            "by block kernels")
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                       help="GiB for the KV cache on CPU")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one step (default: 512 on CPU, 2048 on CUDA; at least "
                            "--max-model-len with --no-enable-chunked-prefill)")
        g.add_argument("--burst-batched-tokens", type=int, default=d.burst_batched_tokens,
                       help="token budget of a step while at least that many prompt tokens wait to be prefilled "
                            "(0: off; default: 2048 on CPU unless --max-num-batched-tokens is given, else off)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill)
        g.add_argument("--num-threads", type=int, default=None,
                       help="torch threads (CPU); per rank with --tensor-parallel-size (default there: the CPUs / "
                            "ranks)")
        g.add_argument("--cpu-threads-bind", default=d.cpu_threads_bind,
                       help="pin the compute threads to CPUs: auto (when they use every CPU), none, or a list "
                            "like 0-3 (as vLLM's VLLM_CPU_OMP_THREADS_BIND)")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--skip-tokenizer-init", action="store_true")
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        g.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo, choices=["sha256", "xxhash"])
        g.add_argument("--max-num-partial-prefills", type=int, default=d.max_num_partial_prefills)
        g.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
        g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["auto", "recompute", "swap"])
        g.add_argument("--swap-space", type=float, default=d.swap_space, help="GiB of host memory for swapped KV")
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        g.add_argument("--generation-config", default=d.generation_config,
                       help="default sampling parameters: auto (the model's generation_config.json), vllm (none) "
                            "or a folder with a generation_config.json")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="most logprobs / prompt_logprobs a request may ask for (-1: no limit)")
        o = parser.add_argument_group("kv offload")
        o.add_argument("--kv-offload-cpu-gib", type=float, default=d.kv_offload_cpu_gib,
                       help="host-memory tier for KV blocks evicted from the device pool (GiB; 0: off)")
        o.add_argument("--kv-offload-disk-path", default=None, help="directory of the disk tier (survives restarts)")
        o.add_argument("--kv-offload-disk-gib", type=float, default=d.kv_offload_disk_gib,
                       help="size of the disk tier (GiB)")
        o.add_argument("--kv-offload-redis-url", default=None,
                       help="redis://host:port/db (rediss:// for TLS) of a KV pool shared by instances; a trusted, "
                            "authenticated store only (a writer can poison cached KV); password in the URL or "
                            "KVSERVE_REDIS_PASSWORD")
        o.add_argument("--kv-offload-redis-prefix", default=d.kv_offload_redis_prefix,
                       help="key prefix of this deployment in Redis")
        o.add_argument("--kv-offload-redis-timeout", type=float, default=d.kv_offload_redis_timeout,
                       help="seconds per Redis call before it counts as a miss")
        o.add_argument("--kv-offload-publish", action=argparse.BooleanOptionalAction, default=d.kv_offload_publish,
                       help="publish blocks computed here to Redis (--no-kv-offload-publish: read-only)")
        p = parser.add_argument_group("tensor parallel")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="ranks the model is split over (heads, MLP, vocabulary; gloo on CPU, NCCL on CUDA); "
                            "--num-threads and --kv-cache-memory are per rank")
        p.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                       help="what runs the ranks (and data-parallel replicas): mp (processes; the default for "
                            "tensor parallelism) or ray (actors; the default for --data-parallel-size > 1)")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": '
                            '"qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3}\'; "adaptive": false pins k')
        g.add_argument("--kv-transfer-config", default=None,
                       help='prefill/decode disaggregation as JSON (docs/disagg.md), e.g. \'{"kv_connector": '
                            '"ZmqConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579}\'; '
                            'roles kv_producer (prefill), kv_consumer (decode), kv_both')

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def kv_offload(self) -> KVOffloadConfig:
        """The offload tiers' configuration (``KVOffloadConfig.enabled`` False: none).

        Raises:
            InvalidRequestError: a value out of range (the field named as the flag).
        """
        try:
            return KVOffloadConfig(
                cpu_gib=self.kv_offload_cpu_gib, disk_path=self.kv_offload_disk_path,
                disk_gib=self.kv_offload_disk_gib if self.kv_offload_disk_path is not None else 0.0,
                redis_url=self.kv_offload_redis_url, redis_prefix=self.kv_offload_redis_prefix,
                redis_timeout_s=self.kv_offload_redis_timeout, publish=self.kv_offload_publish)
        except InvalidRequestError as e:
            name = {"redis_timeout_s": "redis_timeout"}.get(e.param or "", e.param or "")
            message = str(e).removeprefix(f"{e.param}: ") if e.param else str(e)
            raise InvalidRequestError(f"kv_offload_{name}: {message}", param=f"kv_offload_{name}") from None

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The validated ``--kv-transfer-config`` (None: no disaggregation)."""
        value = self.kv_transfer_config
        assert value is None or isinstance(value, KVTransferConfig)
        return value

    @property
    def spec(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (typed)."""
        value = self.speculative_config
        return value if isinstance(value, SpeculativeConfig) else None
