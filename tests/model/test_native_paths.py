"""Model-level checks of the CPU hot path: the native kernels and the torch fallback both reproduce HF
transformers token for token (fp32), a bf16 KV cache under an fp32 model stays close to fp32, and
``--dtype auto`` follows the CPU's flags."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import resolve_device_dtype, resolve_kv_cache_dtype
from kvserve.layers import cpu_kernels


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A random Qwen2 (QKV bias, untied head, GQA, head_dim 64) as an HF folder, prompts and HF's greedy
    continuations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=600, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.2, rope_theta=10000.0)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 600, (n,), generator=g).tolist() for n in (3, 19, 40)]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                              attention_mask=torch.ones(1, len(ids)), pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(ids):].tolist())
    return path, prompts, refs


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_both_paths_match_transformers(tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]], native: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched decode (M = 3 <= SMALL_M_MAX takes the small-M kernel) and single-token decodes."""
    path, prompts, refs = tiny_qwen2
    if native and not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    if not native:
        monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32")
    assert llm.engine.runner.native_decode is native
    assert llm.engine.runner.native_prefill is native
    assert _greedy(llm, prompts) == refs
    assert [_greedy(llm, [p])[0] for p in prompts] == refs


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_chunked_prefill_and_prefix_hits_match_transformers(
        tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]], native: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts split over steps by a 10-token budget (chunks continuing a cached prefix, mixed with decodes),
    then the same prompts again: their full blocks are prefix-cache hits, so their first chunk starts past
    position 0. With the native kernels every prefill chunk goes through ``paged_prefill_attention``
    (counted, including chunks with an offset); forced to torch, through the SDPA groups. Both equal HF."""
    from kvserve.layers import attention

    path, prompts, refs = tiny_qwen2
    if native and not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    if not native:
        monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    calls: list[list[int]] = []
    kernel = attention.paged_prefill_attention

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[6].tolist())  # type: ignore[attr-defined]  # offsets
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "paged_prefill_attention", counting)
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", block_size=4,
              max_num_batched_tokens=10, enable_prefix_caching=True)
    assert llm.engine.runner.native_prefill is native
    assert _greedy(llm, prompts) == refs
    hits = llm.get_prefix_cache_stats()["hits"]
    assert _greedy(llm, prompts) == refs
    assert llm.get_prefix_cache_stats()["hits"] > hits  # the second pass reused cached prompt blocks
    if native:
        assert calls and any(c > 0 for offsets in calls for c in offsets)
    else:
        assert not calls


@pytest.mark.slow
def test_bf16_kv_cache_under_fp32_model() -> None:
    """``--kv-cache-dtype bfloat16`` halves the KV bytes; SmolLM2 in fp32 over a bf16 cache follows the
    all-fp32 engine as vLLM's ``check_logprobs_close``: identical up to the first divergence, where each
    side's token is in the other's top-5."""
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors of the rainbow:\n1."]
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
    fp32 = LLM("smollm2-135m-instruct", kv_cache_memory=0.05, dtype="float32")
    llm = LLM("smollm2-135m-instruct", kv_cache_memory=0.05, dtype="float32", kv_cache_dtype="bfloat16")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert llm.engine.kv_block_bytes() * 2 == fp32.engine.kv_block_bytes()
    assert llm.engine.num_blocks // 2 == fp32.engine.num_blocks  # (the budget floors each count)
    assert llm.engine.fingerprint != fp32.engine.fingerprint
    for a, b in zip(fp32.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, sp, use_tqdm=False),
                    strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        assert ta[0] == tb[0]
        for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
            if x != y:
                top_a = {t for t, _ in la[i].top}  # type: ignore[union-attr]
                top_b = {t for t, _ in lb[i].top}  # type: ignore[union-attr]
                assert x in top_b and y in top_a, f"position {i}: {x} vs {y}"
                break
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("flags,expected", [
    ("fpu sse2 avx avx2 fma", torch.float32),
    ("avx2 fma avx512f avx512bw avx512_vnni", torch.float32),
    ("avx2 avx512f avx512_bf16", torch.bfloat16),
    ("avx2 avx512f amx_tile amx_bf16", torch.bfloat16),
])
def test_dtype_auto_follows_cpu_flags(flags: str, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVSERVE_CPU_FLAGS", flags)
    caplog.set_level(logging.INFO, logger="kvserve.engine.llm_engine")
    device, dtype = resolve_device_dtype(EngineConfig(dtype="auto", device="cpu"))
    assert (device.type, dtype) == ("cpu", expected)
    assert f"--dtype auto -> {str(expected).removeprefix('torch.')}" in caplog.text
    assert "avx2" in caplog.text  # the flags that decided it are logged
    assert resolve_kv_cache_dtype(EngineConfig(), dtype) == dtype  # the KV cache follows the model
    assert resolve_kv_cache_dtype(EngineConfig(kv_cache_dtype="float32"), dtype) == torch.float32
    # an explicit dtype is never overridden
    assert resolve_device_dtype(EngineConfig(dtype="float32", device="cpu"))[1] == torch.float32


def test_kv_cache_auto_follows_the_weights_not_the_activations(
        tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without bf16 dot products (forced: AVX2 flags), ``--dtype bfloat16`` computes in float32 over a
    bfloat16 KV cache (``auto`` = the model dtype, as vLLM and ``kvserve plan`` size it), and the decode step
    runs natively over it; ``--kv-cache-dtype float32`` still gives a float32 cache."""
    monkeypatch.setenv("KVSERVE_CPU_FLAGS", "avx avx2 fma")
    path, _, _ = tiny_qwen2
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="bfloat16")
    e = llm.engine
    assert (e.dtype, e.compute_dtype, e.kv_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert e.runner.kv_caches[0][0].dtype == torch.bfloat16
    if cpu_kernels.native_available():
        assert e.runner.model.native_greedy_decode_ok(e.runner.kv_caches)
    out = llm.generate([[5, 9, 23, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    fp32_kv = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="bfloat16",
                  kv_cache_dtype="float32")
    assert fp32_kv.engine.kv_dtype == torch.float32
    assert fp32_kv.engine.kv_block_bytes() == 2 * e.kv_block_bytes()


def test_kv_cache_dtype_flag_is_validated() -> None:
    from kvserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("dtype,activations,kv", [("float32", "float32", None), ("bfloat16", "float32", None),
                                                  ("bfloat16", "bfloat16", None), ("float32", "float32", "int8"),
                                                  ("float32", "float32", "fp8"), ("bfloat16", "bfloat16", "int8"),
                                                  ("bfloat16", "float32", "bfloat16"),
                                                  ("float32", "float32", "bfloat16")])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_fused_decode_step_equals_per_layer_path(tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]],
                                                 dtype: str, activations: str, kv: str | None, num_seqs: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_step.c`` chains the same kernels as the per-layer path: the final hidden states are
    bitwise equal (fp32 weights; bf16 weights under fp32 activations, as on CPUs without bf16 dot
    products; bf16 weights, activations and KV cache, as on AVX512-BF16 hosts: forced here by the flags
    the dtype choice sees, so it runs on every host; the GEMM then takes whichever bf16 path the host has;
    a bf16 cache under float32 activations (k, v rounded as they are written); and over 8-bit caches,
    ``kv``: rope_write_kv8 and the 8-bit decode attention in both paths)."""
    if activations == "bfloat16":
        monkeypatch.setenv("KVSERVE_CPU_FLAGS", "avx2 fma avx512_bf16")
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    from kvserve.core.request import Request
    from kvserve.core.scheduler_output import ScheduledRequest
    from kvserve.worker.input_batch import prepare_inputs

    path, _, _ = tiny_qwen2
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype=dtype, kv_cache_dtype=kv or activations)
    runner, model = llm.engine.runner, llm.engine.runner.model
    assert model.compute_dtype == getattr(torch, activations)
    if kv == "bfloat16":
        assert runner.kv_caches[0][0].dtype == torch.bfloat16
        assert model.decode_step_args(runner.kv_caches).kv_fmt == 1  # kv_quant.format_code of a bf16 cache
    bs, cpu = runner.block_size, torch.device("cpu")
    lens = [5, 17, 30][:num_seqs]
    tables, next_block = [], 0
    for n in lens:
        nb = -(-(n + 1) // bs)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb

    def scheduled(c: int, n: int, table: list[int]) -> ScheduledRequest:
        req = Request("r", [(7 * i + 3) % 600 for i in range(c + n)], SamplingParams(), None, 8)
        return ScheduledRequest(req, c, n, table, sample=True)  # type: ignore[arg-type]

    with torch.inference_mode():
        prefill = [scheduled(0, n, t) for n, t in zip(lens, tables, strict=True)]
        ids, pos, meta, _ = prepare_inputs(prefill, 0, bs, cpu, native_decode=True)
        model(ids, pos, runner.kv_caches, meta)
        decode = [scheduled(n, 1, t) for n, t in zip(lens, tables, strict=True)]
        ids, pos, meta, _ = prepare_inputs(decode, len(decode), bs, cpu, native_decode=True)
        assert model._can_fuse_decode(model.embed_tokens(ids).to(model.compute_dtype), runner.kv_caches, meta)
        fused = model(ids, pos, runner.kv_caches, meta)
        model.fuse_decode = False
        per_layer = model(ids, pos, runner.kv_caches, meta)
    assert fused.dtype == per_layer.dtype == model.compute_dtype
    assert torch.equal(fused, per_layer)


def test_step_token_budget_defaults_by_device(tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No --max-num-batched-tokens: 512 on CPU (measured faster there, docs/performance-log.md), raised to
    max_model_len when chunked prefill is off; a given value is kept; the scheduler gets the value in force."""
    from kvserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

    path = str(tiny_qwen2[0])
    assert EngineConfig().max_num_batched_tokens is None
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == {"cpu": 512, "cuda": 2048}

    def budget(**kwargs: object) -> int:
        engine = LLM(path, device="cpu", dtype="float32", kv_cache_memory=0.01, **kwargs).engine
        assert engine.config.max_num_batched_tokens == engine.max_num_batched_tokens
        assert engine.scheduler.config.max_num_batched_tokens == engine.max_num_batched_tokens
        return engine.max_num_batched_tokens

    assert budget() == 512
    assert budget(max_num_batched_tokens=96) == 96
    assert budget(enable_chunked_prefill=False, max_model_len=200) == 512
    monkeypatch.setitem(DEFAULT_MAX_NUM_BATCHED_TOKENS, "cpu", 64)
    assert budget() == 64
    assert budget(enable_chunked_prefill=False, max_model_len=200) == 200  # a whole prompt fits one step


def test_burst_budget_defaults_and_bounds(tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]]) -> None:
    """No flags on CPU: 2,048-token steps under a burst (DEFAULT_BURST_BATCHED_TOKENS); a given
    --max-num-batched-tokens turns it off unless --burst-batched-tokens is given too; a burst budget below the
    step budget is refused, naming the field."""
    from kvserve.config import DEFAULT_BURST_BATCHED_TOKENS
    from kvserve.errors import InvalidRequestError

    path = str(tiny_qwen2[0])
    assert EngineConfig().burst_batched_tokens is None
    assert DEFAULT_BURST_BATCHED_TOKENS == {"cpu": 2048, "cuda": 0}

    def budgets(**kwargs: object) -> tuple[int, int, int]:
        engine = LLM(path, device="cpu", dtype="float32", kv_cache_memory=0.01, **kwargs).engine
        cfg = engine.scheduler.config
        assert cfg.burst_batched_tokens == engine.burst_batched_tokens
        return cfg.max_num_batched_tokens, cfg.burst_batched_tokens, cfg.max_step_tokens

    assert budgets() == (512, 2048, 2048)
    assert budgets(max_num_batched_tokens=96) == (96, 0, 96)
    assert budgets(max_num_batched_tokens=96, burst_batched_tokens=1024) == (96, 1024, 1024)
    assert budgets(burst_batched_tokens=0) == (512, 0, 512)
    assert budgets(enable_chunked_prefill=False, max_model_len=200) == (512, 2048, 2048)
    with pytest.raises(InvalidRequestError, match="burst_batched_tokens: 256 must be 0") as err:
        budgets(burst_batched_tokens=256)
    assert err.value.param == "burst_batched_tokens"
    with pytest.raises(InvalidRequestError, match="burst_batched_tokens"):
        EngineConfig(burst_batched_tokens=-1)


@pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")
def test_bind_compute_threads_follows_the_flag(tiny_qwen2: tuple[Path, list[list[int]], list[list[int]]]) -> None:
    """``auto`` pins only when the engine's threads use every CPU of the process; ``none`` never; a list pins
    thread t to its t-th CPU. Called in a throwaway thread (as AsyncLLM's loop thread calls it), and the
    pinned engine still computes the same tokens."""
    import os
    import threading

    path, prompts, refs = tiny_qwen2
    allowed = sorted(os.sched_getaffinity(0))
    threads_before = torch.get_num_threads()

    def bind(**kw: object) -> tuple[list[int] | None, list[list[int]]]:
        out: dict[str, object] = {}

        def run() -> None:
            llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", **kw)
            out["pinned"] = llm.engine.bind_compute_threads()
            out["tokens"] = _greedy(llm, prompts)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out["pinned"], out["tokens"]  # type: ignore[return-value]

    try:
        assert bind(num_threads=len(allowed), cpu_threads_bind="none")[0] is None
        pinned, tokens = bind(num_threads=len(allowed))
        assert pinned == allowed and tokens == refs
        if len(allowed) > 1:
            assert bind(num_threads=1)[0] is None  # fewer threads than CPUs: left to the OS
        pinned, tokens = bind(num_threads=2, cpu_threads_bind=str(allowed[-1]))
        assert pinned == [allowed[-1], allowed[-1]] and tokens == refs
    finally:
        torch.set_num_threads(threads_before)
