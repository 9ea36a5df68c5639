"""Native CPU kernels, compiled on first use with the system C compiler and called through ctypes.

The sources under ``csrc/`` build one shared library:

* ``small_gemm.c``: the linear layers and the LM head at small M (decode): weights streamed at the memory
  bandwidth, float32 or bfloat16 weights, AVX2/AVX-512 FMA or AVX512-BF16 dot products;
* ``paged_attention.c``: decode attention reading K/V in place from the paged cache (float32 or bfloat16);
  AVX2 builds hand head_dim multiples of 64 to ``paged_attention_avx2.c`` (register-blocked, ``decode_job.h``);
* ``paged_attention_kv8.c``: the same over an 8-bit cache (int8 codes with a scale per 16 channels, fp8 codes
  with a scale per row, ``kv8.h``), dequantizing in registers;
* ``prefill_attention.c``: prefill attention (fresh prompts and chunks continuing a cached prefix) over
  the paged cache in place, flash-attention style; AVX512-BF16 dot products on bf16 inputs where available;
  8-bit caches widened tile by tile into L1;
* ``fused_ops.c``: RMSNorm + residual add, SiLU·mul, rotary + KV-cache write, one call each;
* ``int8_gemm.c``: the linear layers with int8 weights (``--quantization int8``, ``int8.py``): activations
  quantized per token, AVX512-VNNI ``vpdpbusd`` or AVX2 ``vpmaddubsw`` int32 dot products;
* ``gguf_gemm.c``: the linear layers with GGUF block weights (``--quantization gguf``, ``gguf_blocks.py``): Q4_0,
  Q4_1, Q5_0, Q8_0, Q4_K, Q6_K blocks unpacked in registers, int8 activations, the same dot products;
* ``decode_step.c``: all layers of a pure-decode step in one call, chaining the kernels above (no Python
  between kernels: at batch 1 the gaps cost ~30 % of the step).

Each has a torch reference path (``F.linear``, ``int8.int8_linear_reference``, ``gguf_blocks.gguf_linear_reference``,
``attention.py``, ``layernorm.py``/``rotary.py``), which is also the oracle the kernels are tested against, and which
callers use when the library is unavailable: no C compiler, a failed build, CUDA tensors, or
``KVSERVE_DISABLE_NATIVE=1``.

The library is built with ``-march=native`` (``KVSERVE_NATIVE_MARCH`` overrides it, e.g. ``x86-64-v3`` to
force the AVX2 path on an AVX-512 host), linked with OpenMP: at run time it binds to the ``libgomp.so.1``
torch has already loaded, so ``torch.set_num_threads`` sizes one shared thread pool. It is cached under
``$KVSERVE_CACHE_DIR/kernels`` (default ~/.cache/kvserve), keyed by the sources, flags and compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kvserve import cpu_features
from kvserve.layers.kv_quant import format_code, row_elems
from kvserve.models.catalog import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = {  # file -> its own flags (fast-math only where reductions must reorder to vectorize)
    "small_gemm.c": ["-ffp-contract=fast"],
    "panel_gemm.c": ["-ffp-contract=fast"],
    "paged_attention.c": ["-ffast-math", "-fno-finite-math-only"],
    "paged_attention_kv8.c": ["-ffast-math", "-fno-finite-math-only"],
    "paged_attention_avx2.c": ["-ffast-math", "-fno-finite-math-only"],
    "fused_ops.c": ["-ffp-contract=off"],
    "decode_step.c": [],
    "decode_io.c": [],
    "prefill_attention.c": ["-ffp-contract=fast"],  # (no fast-math: its exp rounds with the 1.5*2^23 trick)
    "int8_gemm.c": ["-ffp-contract=off"],  # (its float epilogue must equal the torch reference's bits)
    "threads.c": [],
    "gguf_gemm.c": [],
    "shm_barrier.c": [],
}
_COMMON = ["-O3", "-fPIC", "-fopenmp"]
_LIBS = ["-lm", "-lmvec"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
WEIGHT_FMT_INT8 = 2  # decode_step's weight_fmt for int8 weights (0 float32, 1 bfloat16)
WEIGHT_FMT_GGUF = 3  # ... and for GGUF blocks (each weight pointer a segment table, gguf_gemm.c)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {  # name -> (restype, argtypes)
    "small_gemm": (ctypes.c_int, [_PTR, ctypes.c_int, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "small_gemm_features": (ctypes.c_int, []),
    "paged_decode_attention": (ctypes.c_int, [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR] + [_I64] * 6
                               + [ctypes.c_float, _I64]),
    "paged_decode_attention_kv8": (ctypes.c_int, [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR] + [_I64] * 6
                                   + [ctypes.c_float, _I64]),
    "kv8_attention_features": (ctypes.c_int, []),
    "add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int]),
    "silu_mul": (None, [_PTR, _PTR, _I64, _I64, ctypes.c_int]),
    "rope_write_kv": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int,
                             ctypes.c_int]),
    "rope_write_kv8": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                      ctypes.c_int, ctypes.c_int]),
    "decode_step": (ctypes.c_int, [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR]
                    + [_I64] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64]),
    "embed_rows": (ctypes.c_int, [_PTR, ctypes.c_int, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int]),
    "argmax_rows": (None, [_PTR, ctypes.c_int, _I64, _I64, _PTR]),
    "paged_prefill_attention": (ctypes.c_int, [_PTR, _I64, ctypes.c_int, _PTR, _PTR, ctypes.c_int, _PTR, _I64, _PTR,
                                               _PTR, _PTR, _I64, _I64, _PTR] + [_I64] * 4 + [ctypes.c_float, _I64]),
    "prefill_attention_features": (ctypes.c_int, []),
    "int8_gemm": (ctypes.c_int, [_PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "int8_gemm_features": (ctypes.c_int, []),
    "int8_packed_nbytes": (_I64, [_I64, _I64]),
    "int8_quantize_rows": (None, [_PTR, ctypes.c_int, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64]),
    "pin_omp_threads": (ctypes.c_int, [_PTR, ctypes.c_int32]),
    "shm_arrive_wait": (ctypes.c_int, [_PTR, ctypes.c_int32, ctypes.c_int32, _I64, _PTR, ctypes.c_double]),
    "gguf_gemm": (ctypes.c_int, [_PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "gguf_gemm_features": (ctypes.c_int, []),
    "gguf_rowblock_bytes": (_I64, [_I64, _I64]),
    "panel_gemm": (ctypes.c_int, [_PTR, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _I64, _I64, _I64]),
}


def march() -> str:
    """The ``-march`` the library is built for (``KVSERVE_NATIVE_MARCH``, default ``native``)."""
    return os.environ.get("KVSERVE_NATIVE_MARCH", "native")


def row_prefetch_min_m() -> int:
    """From how many tokens M up ``small_gemm.c``'s bf16 row loop (M below 10: decode, the LM head) prefetches
    the weight rows in software (4 KiB ahead); below it the hardware prefetcher streams alone.
    ``KVSERVE_ROW_PREFETCH_MIN_M`` overrides.

    4 on Zen 4, 1 (always) elsewhere. Measured on a 2-vCPU Zen 4 EPYC (SmolLM2's 121 bf16 GEMVs of a step, 2
    threads, builds with and without the prefetch alternated in one process): without it M = 1 took 0.90x the
    time (the LM head alone 0.75x), M = 2 0.89x, M = 3 0.75-0.78x, but M = 4 1.06-1.08x, M = 6 1.16x and
    M = 8 1.21x; in the engine, batch-1 steps 0.935x (faster in 24 of 24 alternating blocks of 40 steps). On
    Zen 5 the 4 KiB non-temporal prefetch at M = 1 measured faster than a T0 one (window s27); without was
    not measured there, so it stays.

    Raises:
        ValueError: ``KVSERVE_ROW_PREFETCH_MIN_M`` is not a non-negative integer.
    """
    env = os.environ.get("KVSERVE_ROW_PREFETCH_MIN_M")
    if env is not None:
        if not env.strip().isdigit():
            raise ValueError(f"KVSERVE_ROW_PREFETCH_MIN_M={env!r}: expected a non-negative integer")
        return int(env)
    return 4 if cpu_features.is_zen4() else 1


def _source_flags() -> dict[str, list[str]]:
    """Each source's compiler flags: ``_SOURCES`` plus the per-CPU tuning macros."""
    flags = {name: list(f) for name, f in _SOURCES.items()}
    flags["small_gemm.c"].append(f"-DROW_PREFETCH_MIN_M={row_prefetch_min_m()}")
    return flags


def build_library(arch: str, compiler: str | None = None) -> ctypes.CDLL | None:
    """Compile (or reuse the cached build of) the kernels for ``-march=arch`` and load them.

    Returns None, with a warning, when no compiler is found or the build fails: callers then use the
    torch path. Separate from ``_library`` so tests can build the AVX2 variant on an AVX-512 host.
    """
    cc = compiler or os.environ.get("CC", "cc")
    path = shutil.which(cc) or (None if compiler else shutil.which("gcc"))
    if path is None:
        logger.warning("no C compiler found (%s): using the torch kernels", cc)
        return None
    sources = _source_flags()
    digest = hashlib.sha256()
    for name, flags in sorted(sources.items()):
        digest.update((_CSRC / name).read_bytes() + " ".join(flags).encode())
    for header in sorted(_CSRC.glob("*.h")):  # included by the sources
        digest.update(header.read_bytes())
    digest.update(" ".join([arch, path, *_COMMON]).encode())
    lib_path = cache_dir() / "kernels" / f"kvserve_cpu-{digest.hexdigest()[:16]}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            objs = []
            for name, flags in sources.items():
                obj = Path(tmp) / (name + ".o")
                cmd = [path, *_COMMON, f"-march={arch}", *flags, "-c", "-o", str(obj), str(_CSRC / name)]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    logger.warning("compiling %s failed, using the torch kernels:\n%s", name, result.stderr)
                    return None
                objs.append(str(obj))
            tmp_lib = Path(tmp) / lib_path.name
            result = subprocess.run([path, "-shared", "-fopenmp", "-o", str(tmp_lib), *objs, *_LIBS],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("linking the CPU kernels failed, using the torch kernels:\n%s", result.stderr)
                return None
            os.replace(tmp_lib, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for fn_name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_DISABLE_NATIVE"):
        return None
    return build_library(march())


def native_available() -> bool:
    """True when the compiled kernels can be used (a C compiler was found and the build succeeded)."""
    return _library() is not None


def native_library() -> ctypes.CDLL:
    """The loaded kernels (their ctypes signatures set), for a caller that passes raw addresses of buffers it
    keeps (``worker/greedy_decode.py``). Raises RuntimeError when they are unavailable."""
    return _lib()


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are unavailable (check native_available() first)")
    return lib


def _bf16_flag(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise TypeError(f"native CPU kernels take float32 or bfloat16 tensors, got {t.dtype}")


def gemm_features(lib: ctypes.CDLL | None = None) -> set[str]:
    """Paths compiled into the library: ``{"avx512"}``, ``{"avx512", "avx512_bf16"}``, ``{"avx2_panel"}``
    (AVX2 + FMA builds without AVX-512: ``small_gemm`` hands float32 activations of ``PANEL_MIN_M`` = 12 rows
    or more to ``panel_gemm``, which serves any M) or empty (generic builds)."""
    f = (lib or _lib()).small_gemm_features()
    return {name for bit, name in ((1, "avx512"), (2, "avx512_bf16"), (4, "avx2_panel")) if f & bit}


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for small M on CPU (decode), reading the weight at memory bandwidth.

    Args:
        x: ``[M, K]`` float32 or bfloat16 (a strided row view is copied to contiguous first).
        weight: ``[N, K]`` float32 or bfloat16, contiguous (an ``nn.Linear`` weight).
        bias: ``[N]`` float32 or None.
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[M, N]`` in x's dtype; accumulation in float32 (bf16 x bf16 with AVX512-BF16: ``vdpbf16ps``; float32
        x of 12 rows or more on an AVX2 build: ``panel_gemm``'s tiles, see ``gemm_features``).
    Raises:
        RuntimeError: the kernels are unavailable or scratch memory could not be allocated.
        TypeError: an unsupported dtype.
    """
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous(), "weight must be a contiguous [N, K] matrix"
    assert bias is None or bias.dtype == torch.float32
    out = torch.empty(m, n, dtype=x.dtype)
    rc = (lib or _lib()).small_gemm(x.data_ptr(), _bf16_flag(x), weight.data_ptr(), _bf16_flag(weight),
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                                    torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"small_gemm failed with code {rc}")
    return out


def panel_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by ``panel_gemm.c`` (6 weight rows x 16 tokens per register tile, a bf16 weight
    widened once per call in cache): what ``small_gemm`` runs from 12 float32 rows on in AVX2 builds; callable
    at any M on any build (tests).

    Args:
        x: ``[M, K]`` float32 (a strided row view is copied to contiguous first).
        weight: ``[N, K]`` float32 or bfloat16, contiguous.
        bias: ``[N]`` float32 or None.
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[M, N]`` float32, each element a float32 dot product accumulated in k order.
    Raises:
        RuntimeError: the kernels are unavailable or scratch memory could not be allocated.
        TypeError: an unsupported weight dtype.
    """
    x = x.contiguous()
    m, k = x.shape
    assert x.dtype == torch.float32 and weight.shape[1] == k and weight.is_contiguous()
    assert bias is None or bias.dtype == torch.float32
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    rc = (lib or _lib()).panel_gemm(x.data_ptr(), weight.data_ptr(), _bf16_flag(weight),
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), m, weight.shape[0], k,
                                    torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"panel_gemm failed with code {rc}")
    return out


def kv8_features(lib: ctypes.CDLL | None = None) -> set[str]:
    """8-bit KV attention variants compiled in: ``"decode"`` (``paged_attention_kv8.c``), ``"prefill"``
    (``prefill_attention.c``'s int8 / fp8 tiles), ``"decode_avx512"`` (its AVX-512 path); empty when the
    library is unavailable. Where a variant is missing, ``attention.py`` takes the torch path for it."""
    lib = lib or _library()
    return set() if lib is None else set(_kv8_feature_names(lib))


@cache
def _kv8_feature_names(lib: ctypes.CDLL) -> frozenset[str]:
    f = lib.kv8_attention_features()
    return frozenset(name for bit, name in ((1, "decode"), (2, "prefill"), (4, "decode_avx512")) if f & bit)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, one query token per sequence.

    Args:
        q: ``[num_seqs, num_kv_heads, group, head_dim]`` (any float dtype; computed in float32), on CPU.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, or 8-bit
            ``[..., row_elems(head_dim, dtype)]`` int8 / uint8 (fp8) rows of codes and scales (``kv_quant.py``;
            dequantized in registers), contiguous.
        block_tables: ``[num_seqs, max_blocks]`` int64 (entries past a sequence's length are ignored).
        seq_lens: ``[num_seqs]`` int64, keys attended per sequence (>= 1).
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[num_seqs, num_kv_heads, group, head_dim]`` in q's dtype.
    Raises:
        RuntimeError: the kernel is unavailable (check ``native_available()`` first) or failed.
    """
    lib = lib or _lib()
    q32 = q.float().contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    num_seqs, num_kv_heads, group, head_dim = q.shape
    out = torch.empty_like(q32)
    fn, fmt = lib.paged_decode_attention, 0
    if k_cache.dtype in (torch.int8, torch.uint8):
        assert k_cache.shape[3] == row_elems(head_dim, k_cache.dtype) and v_cache.dtype == k_cache.dtype
        fn, fmt = lib.paged_decode_attention_kv8, format_code(k_cache)
    else:
        fmt = _bf16_flag(k_cache)
    rc = fn(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), fmt, block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_kv_heads, group, head_dim, k_cache.shape[1],
        block_tables.shape[1], scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed with code {rc}")
    return out.to(q.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Fused ``residual += x; return RMSNorm(residual)`` (or ``RMSNorm(x)`` when residual is None).

    Args:
        x, residual: ``[M, H]`` contiguous, one dtype (float32 or bfloat16); residual is updated in place.
        weight: ``[H]`` in the same dtype. lib: a library from ``build_library`` (tests); default: the process's.
    Returns:
        ``[M, H]``, bitwise the reference's ``weight * to_dtype(r * rsqrt(mean(r^2) + eps))`` up to
        float32 summation order.
    """
    out = torch.empty_like(x)
    (lib or _lib()).add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), x.shape[0], x.shape[1], eps, _bf16_flag(x))
    return out


def silu_mul(gate_up: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` ``[M, 2F]`` (contiguous) -> ``[M, F]`` (``lib``: a library
    from ``build_library``, for tests; default: the process's)."""
    m, f2 = gate_up.shape
    out = gate_up.new_empty(m, f2 // 2)
    (lib or _lib()).silu_mul(gate_up.data_ptr(), out.data_ptr(), m, f2 // 2, _bf16_flag(gate_up))
    return out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, lib: ctypes.CDLL | None = None) -> None:
    """Rotate q and k of ``qkv`` in place and write k, v to the paged cache (``lib``: a library from
    ``build_library``, for tests; default: the process's).

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` contiguous (the fused projection's output).
        positions, slot_mapping: ``[T]`` int64.
        cos, sin: ``[max_position, head_dim]`` float32 tables.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, contiguous;
            k and v are converted to the cache's dtype as ``Tensor.to`` converts them (float32 -> bfloat16 rounds
            to nearest even), so a bfloat16 cache may sit under float32 activations.
    Raises:
        TypeError: qkv or the caches not float32 / bfloat16, or k_cache and v_cache of different dtypes.
    """
    assert qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    (lib or _lib()).rope_write_kv(qkv.data_ptr(), qkv.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), qkv.shape[0],
                         num_heads, num_kv_heads, head_dim, _bf16_flag(qkv), _bf16_flag(k_cache))


def rope_write_kv8(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """``rope_write_kv`` into 8-bit caches: q and k rotated in place, k and v rows quantized into their slots
    (the codes and scales of ``kv_quant.quantize``, bit for bit).

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` float32 or bfloat16, contiguous.
        positions, slot_mapping: ``[T]`` int64. cos, sin: ``[max_position, head_dim]`` float32 tables.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, row_elems(head_dim, dtype)]`` int8 or uint8
            (fp8).
    Raises:
        RuntimeError: head_dim over 1,024.
    """
    assert qkv.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert k_cache.shape[3] == row_elems(head_dim, k_cache.dtype)
    rc = _lib().rope_write_kv8(qkv.data_ptr(), qkv.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), qkv.shape[0],
                               num_heads, num_kv_heads, head_dim, _bf16_flag(qkv), format_code(k_cache))
    if rc != 0:
        raise RuntimeError(f"rope_write_kv8 failed with code {rc} (head_dim {head_dim})")


def decode_step(x: torch.Tensor, layer_ptrs: torch.Tensor, final_norm: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                intermediate_size: int, eps: float, scale: float, weight_fmt: int, kv_fmt: int) -> torch.Tensor:
    """Every decoder layer of a pure-decode step, then the final norm, in one native call.

    Args:
        x: ``[M, H]`` float32 or bfloat16 embeddings of the M decode tokens (one per sequence), contiguous;
            its dtype is the activations' (used as scratch).
        layer_ptrs: ``[num_layers, 9]`` int64 addresses (see ``decode_step.c``): norm weights in x's dtype,
            float32 biases, projection weights by ``weight_fmt``: 0 float32, 1 bfloat16, 2 int8 (``int8.pack_int8``'s
            buffers; ``WEIGHT_FMT_INT8``), K/V caches of format ``kv_fmt`` (the cache's ``kv_quant.format_code``:
            0 float32, 1 bfloat16, 2 int8, 3 fp8), x's dtype or 8-bit, or bfloat16 under float32 x.
        final_norm: ``[H]`` in x's dtype. positions, slot_mapping, seq_lens: ``[M]`` int64; block_tables
            ``[M, max_blocks]`` int64. cos, sin: ``[max_position, head_dim]`` float32.
    Returns:
        ``[M, H]`` in x's dtype: the final norm's output, bitwise the per-op path's.
    Raises:
        RuntimeError: the kernels are unavailable, or scratch memory could not be allocated.
    """
    m, h = x.shape
    assert x.is_contiguous() and final_norm.dtype == x.dtype
    out = torch.empty_like(x)
    block_tables = block_tables.contiguous()
    args = DecodeStepArgs(layer_ptrs, final_norm, cos, sin, block_size, num_heads, num_kv_heads, head_dim,
                          intermediate_size, eps, scale, weight_fmt, kv_fmt)
    decode_step_ptrs(args, x.data_ptr(), out.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                     block_tables.data_ptr(), seq_lens.data_ptr(), block_tables.shape[1], m, h, _bf16_flag(x))
    return out


def argmax_rows(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D float32 or bfloat16 CPU tensor (``decode_io.c``; the same index as
    torch's: the first NaN of a row if it has one, else the first index of its maximum).

    Args:
        x: ``[M, N]`` float32 or bfloat16 (copied to contiguous rows first if strided).
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[M]`` int64.
    Raises:
        RuntimeError: the kernels are unavailable. TypeError: another dtype.
    """
    x = x.contiguous()
    m, n = x.shape
    out = torch.empty(m, dtype=torch.int64)
    (lib or _lib()).argmax_rows(x.data_ptr(), _bf16_flag(x), m, n, out.data_ptr())
    return out


def embed_rows(table: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype,
               lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``table[ids].to(out_dtype)`` for a float32 or bfloat16 embedding table (``decode_io.c``): rows copied,
    or bfloat16 rows widened to float32 (exact).

    Args:
        table: ``[V, H]`` float32 or bfloat16, contiguous. ids: ``[M]`` int64 (contiguous).
        out_dtype: float32, or the table's dtype.
    Returns:
        ``[M, H]`` in ``out_dtype``.
    Raises:
        IndexError: an id outside ``[0, V)``. TypeError: an unsupported dtype pair (float32 table -> bfloat16).
        RuntimeError: the kernels are unavailable.
    """
    assert table.is_contiguous() and ids.dtype == torch.int64
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], table.shape[1], dtype=out_dtype)
    rc = (lib or _lib()).embed_rows(table.data_ptr(), _bf16_flag(table), table.shape[0], ids.data_ptr(), ids.shape[0],
                                    table.shape[1], out.data_ptr(), _bf16_flag(out))
    if rc == -1:
        raise IndexError(f"token id outside the embedding table of {table.shape[0]} rows")
    if rc != 0:
        raise TypeError(f"embed_rows: no {table.dtype} -> {out_dtype} path")
    return out


@dataclass(frozen=True)
class DecodeStepArgs:
    """The per-model arguments of ``decode_step.c`` (see :func:`decode_step`), made once by the model.

    Attributes:
        layer_ptrs: ``[num_layers, 9]`` int64 addresses (the tensors they point to must stay alive).
        final_norm: ``[H]`` in the activations' dtype. cos, sin: ``[max_position, head_dim]`` float32.
        block_size: tokens per KV block. eps: RMSNorm's epsilon. scale: attention's softmax scale.
        weight_fmt: 0 float32, 1 bfloat16, ``WEIGHT_FMT_INT8``, ``WEIGHT_FMT_GGUF``. kv_fmt: the cache's
            ``kv_quant.format_code`` (0 float32, 1 bfloat16, 2 int8, 3 fp8).
    """

    layer_ptrs: torch.Tensor
    final_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float
    weight_fmt: int
    kv_fmt: int


def decode_step_ptrs(args: DecodeStepArgs, x: int, out: int, positions: int, slot_mapping: int, block_tables: int,
                     seq_lens: int, max_blocks: int, m: int, h: int, x_bf16: int) -> None:
    """:func:`decode_step` on raw addresses (buffers the caller keeps, e.g. numpy arrays' ``ctypes.data``): no
    tensor is made. ``x``, ``out``: ``[m, h]`` activations (float32, or bfloat16 if ``x_bf16``); ``positions``,
    ``slot_mapping``, ``seq_lens``: ``[m]`` int64; ``block_tables``: ``[m, max_blocks]`` int64, C order.

    Raises:
        RuntimeError: the kernels are unavailable, or scratch memory could not be allocated.
    """
    rc = _lib().decode_step(
        x, out, args.layer_ptrs.data_ptr(), args.layer_ptrs.shape[0], args.final_norm.data_ptr(), positions,
        slot_mapping, block_tables, seq_lens, max_blocks, args.block_size, args.cos.data_ptr(), args.sin.data_ptr(),
        m, h, args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size, args.eps, args.scale,
        args.weight_fmt, x_bf16, args.kv_fmt, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode_step failed with code {rc}")


def prefill_features(lib: ctypes.CDLL | None = None) -> set[str]:
    """Paths compiled into ``prefill_attention.c``: ``"avx512"`` (512-bit vectors in the portable path) and
    ``"avx512_bf16"`` (the ``vdpbf16ps`` path for bf16 queries over a bf16 cache); empty for AVX2/SSE2 builds."""
    f = (lib or _lib()).prefill_attention_features()
    return {name for bit, name in ((1, "avx512"), (2, "avx512_bf16")) if f & bit}


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                            offsets: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Causal attention of prefill chunks over the paged KV cache, read in place (flash-attention style).

    Sequence ``s`` owns query rows ``q_start[s] .. q_start[s] + q_len[s] - 1``; its query ``i`` is at
    position ``offsets[s] + i`` and attends keys ``0 .. offsets[s] + i`` of its cache blocks (``offsets``:
    tokens cached before this chunk, 0 for a fresh prompt). This step's K/V must already be in the cache.
    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). Online softmax (Milakov &
    Gimelshein 2018; Dao et al. 2022, FlashAttention): ``softmax(q k^T * scale) v`` without the score matrix.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` float32 or bfloat16, on CPU; rows may be strided (a view
            into the fused QKV projection) but each row's heads must be contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or bfloat16, or 8-bit
            ``[..., row_elems(head_dim, dtype)]`` int8 / uint8 (fp8) rows of codes and scales (``kv_quant.py``),
            contiguous, one dtype.
        block_tables: ``[num_seqs, max_blocks]`` int64; entries past a sequence's keys are not read.
        q_start, q_len, offsets: ``[num_seqs]`` int64.
        scale: the softmax scale (``1 / sqrt(head_dim)``).
        out: optional ``[num_tokens, num_heads * head_dim]`` contiguous tensor of q's dtype to write into
            (rows no sequence owns are left as they are).
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[num_tokens, num_heads * head_dim]`` in q's dtype (``out`` when given). Math in float32; with
        bf16 q and cache on an AVX512-BF16 build, q.k and p.v are ``vdpbf16ps`` dot products (exact
        products, float32 sums) with the probabilities p rounded to bf16, as flash-attention kernels do.
    Raises:
        RuntimeError: the kernels are unavailable, memory could not be allocated, or an argument is out of
            range (rows past ``num_tokens``, keys past a block table, num_heads not a multiple of num_kv_heads).
        TypeError: a dtype other than float32 / bfloat16 (q) or float32 / bfloat16 / int8 / uint8 (caches), or
            k and v caches of different dtypes.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    q_bf16, kv_fmt = _bf16_flag(q), format_code(k_cache)
    row = row_elems(head_dim, k_cache.dtype) if kv_fmt >= 2 else head_dim  # 8-bit rows: codes, then scales
    if (cache_dim != row or v_cache.shape != k_cache.shape or num_heads % num_kv_heads
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise RuntimeError(f"paged_prefill_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
                           " (contiguous, num_heads a multiple of num_kv_heads)")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    if out.shape != (num_tokens, num_heads * head_dim) or out.dtype != q.dtype or not out.is_contiguous():
        raise RuntimeError(f"paged_prefill_attention: out must be a contiguous [{num_tokens}, {num_heads * head_dim}]"
                           f" {q.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    block_tables = block_tables.contiguous()
    q_start, q_len, offsets = q_start.contiguous(), q_len.contiguous(), offsets.contiguous()
    num_seqs = q_start.shape[0]
    if not (block_tables.dtype == q_start.dtype == q_len.dtype == offsets.dtype == torch.int64) or \
            block_tables.shape[0] != num_seqs or q_len.shape[0] != num_seqs or offsets.shape[0] != num_seqs:
        raise RuntimeError("paged_prefill_attention: block_tables [num_seqs, max_blocks] and q_start, q_len, "
                           "offsets [num_seqs] must be int64")
    rc = (lib or _lib()).paged_prefill_attention(
        q.data_ptr(), q.stride(0), q_bf16, k_cache.data_ptr(), v_cache.data_ptr(), kv_fmt, block_tables.data_ptr(),
        block_tables.shape[1], q_start.data_ptr(), q_len.data_ptr(), offsets.data_ptr(), num_seqs, num_tokens,
        out.data_ptr(), num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, scale, torch.get_num_threads())
    if rc != 0:
        reason = "out of memory" if rc == -1 else "an argument out of range"
        raise RuntimeError(f"paged_prefill_attention failed ({reason}, code {rc})")
    return out


def int8_features(lib: ctypes.CDLL | None = None) -> set[str]:
    """The int8 GEMM path compiled in: ``{"avx512_vnni"}`` (``vpdpbusd``), ``{"avx2"}`` (``vpmaddubsw``) or
    empty (portable C)."""
    f = (lib or _lib()).int8_gemm_features()
    return {1: {"avx512_vnni"}, 2: {"avx2"}}.get(f, set())


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W int8 in ``int8.pack_int8``'s layout, x quantized per token and group of 32.

    Args:
        x: ``[M, K]`` float32 or bfloat16 (a strided view is copied to contiguous first).
        packed: the ``[int8.packed_nbytes(n, K)]`` uint8 buffer of an ``[n, K]`` weight.
        n: output features.
        bias: ``[n]`` float32 or None.
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[M, n]`` in x's dtype, bitwise ``int8.int8_linear_reference``.
    Raises:
        RuntimeError: the kernels are unavailable, scratch memory could not be allocated, or K is over 2^24.
    """
    lib = lib or _lib()
    x = x.contiguous()
    m, k = x.shape
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.numel() == lib.int8_packed_nbytes(n, k)
    assert bias is None or (bias.dtype == torch.float32 and bias.numel() == n)
    out = torch.empty(m, n, dtype=x.dtype)
    rc = lib.int8_gemm(x.data_ptr(), _bf16_flag(x), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                       out.data_ptr(), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int8_gemm failed with code {rc}" + (f" (K = {k} > 2^24)" if rc == -2 else ""))
    return out


def int8_quantize_rows(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization alone (tests): ``[M, K]`` float32/bfloat16 -> (int8 ``[M, Kp]``,
    float32 ``[M, Kp / 32]`` scales), ``Kp`` = K rounded up to 32 (``int8.quantize_rows``'s shapes)."""
    x = x.contiguous()
    m, k = x.shape
    kp = -(-k // 32) * 32
    q = torch.empty(m, kp, dtype=torch.int8)
    scales = torch.empty(m, kp // 32, dtype=torch.float32)
    (lib or _lib()).int8_quantize_rows(x.data_ptr(), _bf16_flag(x), m, k, kp, q.data_ptr(), scales.data_ptr(), None,
                                       torch.get_num_threads())
    return q, scales


def pin_omp_threads(cpus: list[int]) -> int:
    """Pin the calling thread's OpenMP team (``torch.get_num_threads()`` threads, the caller being thread 0):
    thread ``t`` to CPU ``cpus[t % len(cpus)]`` (``csrc/threads.c``). Call it from the thread that computes.

    Returns:
        The team size, or -1 where it could not pin (not Linux, no OpenMP, a CPU outside the process's set).
    Raises:
        ValueError: ``cpus`` is empty.
    """
    if not cpus:
        raise ValueError("pin_omp_threads: no CPUs given")
    arr = (ctypes.c_int32 * len(cpus))(*cpus)
    return int(_lib().pin_omp_threads(ctypes.addressof(arr), len(cpus)))


def gguf_features(lib: ctypes.CDLL | None = None) -> set[str]:
    """The GGUF GEMM path compiled in: ``{"avx512_vnni"}`` (``vpdpbusd``), ``{"avx2"}`` (``vpmaddubsw``) or empty
    (portable C)."""
    f = (lib or _lib()).gguf_gemm_features()
    return {1: {"avx512_vnni"}, 2: {"avx2"}}.get(f, set())


def gguf_gemm(x: torch.Tensor, segments: torch.Tensor, n: int, bias: torch.Tensor | None = None,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W in GGUF blocks (``gguf_blocks.pack``'s layout), x quantized per token and group.

    Args:
        x: ``[M, K]`` float32 or bfloat16, K a multiple of 32 (a strided view is copied to contiguous first).
        segments: int64 ``[1 + 3 S]``: ``S``, then ``(format code, rows, address of its packed bytes)`` per segment,
            in output order (``GGUFLinear.segment_table``); the addresses must stay valid during the call.
        n: output features (the segments' rows summed).
        bias: ``[n]`` float32 or None.
        lib: a library from ``build_library`` (tests); default: the process's library.
    Returns:
        ``[M, n]`` in x's dtype: the dequantized weights times the quantized activations, float32 accumulation.
    Raises:
        RuntimeError: the kernels are unavailable, scratch memory could not be allocated, or the table is invalid
            (an unknown format, K not a multiple of a format's block, rows not summing to n).
    """
    lib = lib or _lib()
    x = x.contiguous()
    m, k = x.shape
    assert segments.dtype == torch.int64 and segments.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.numel() == n)
    out = torch.empty(m, n, dtype=x.dtype)
    rc = lib.gguf_gemm(x.data_ptr(), _bf16_flag(x), segments.data_ptr(), None if bias is None else bias.data_ptr(),
                       out.data_ptr(), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"gguf_gemm failed with code {rc}" + (" (invalid segment table)" if rc == -2 else ""))
    return out


def shm_arrive_wait(counters: torch.Tensor, rank: int, size: int, seq: int, pids: torch.Tensor,
                    timeout_s: float) -> int:
    """Publish operation ``seq`` as ``rank`` and wait for every rank of the shared-memory barrier
    (``csrc/shm_barrier.c``; used by ``distributed/shm_comm.py``).

    Args:
        counters: int64 view of the segment's header, one counter per rank 8 words apart (``[8 * size]`` at least).
        pids: ``[size]`` int64, the ranks' process ids (a dead one ends the wait).
    Returns:
        0 when every rank arrived; ``r + 1`` when rank r died first; -1 past ``timeout_s`` seconds.
    Raises:
        RuntimeError: the kernels are unavailable.
    """
    assert counters.dtype == torch.int64 and pids.dtype == torch.int64 and pids.numel() >= size
    return int(_lib().shm_arrive_wait(counters.data_ptr(), rank, size, seq, pids.data_ptr(), timeout_s))
