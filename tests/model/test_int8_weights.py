"""``--quantization int8`` through the engine, on tiny random models (a Qwen2 with QKV bias and an untied head,
a Llama with a tied head): the native path (``int8_gemm.c``, through the fused decode step) equals the torch
reference path token for token, the fused decode step equals the per-layer path bitwise, and the model holds
what the flag promises (int8 projections and head, the embedding table in the model dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers import cpu_kernels
from kvserve.layers.int8 import Int8Linear, packed_nbytes

PROMPTS = [[5, 17, 300], [(7 * i + 3) % 600 for i in range(19)], [(11 * i + 1) % 600 for i in range(70)]]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_int8_model_layout(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", quantization="int8")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32  # lookups in the model dtype, even when tied
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.packed.numel() == packed_nbytes(600, 128)
    # the planner's int8 weight bytes are the served model's, exactly
    from kvserve.planner.model_info import load_model_info

    served = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
                 if not name.startswith("rotary."))
    assert load_model_info(str(tiny_model)).int8_weight_bytes(4) == served
    float_llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32")
    assert llm.engine.fingerprint != float_llm.engine.fingerprint  # int8 KV never served to the float model
    # per-channel int8 of a random model: the first greedy tokens mostly follow the float model's
    same = [a[0] == b[0] for a, b in zip(_greedy(llm, PROMPTS), _greedy(float_llm, PROMPTS), strict=True)]
    assert sum(same) >= 2, same


def test_native_int8_equals_torch_reference(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched and single prompts, prefill (up to 70 rows) and decode: identical tokens with the native kernels
    (``int8_gemm``, fused decode steps) and with the torch path (``int8_linear_reference``, SDPA), in float32
    (as tests/model/test_native_paths.py does for float weights: bf16 attention kernels round differently)."""
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    kw = dict(skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", quantization="int8")
    native = LLM(str(tiny_model), **kw)  # type: ignore[arg-type]
    fused = []
    model = native.engine.runner.model
    orig = model._fused_decode

    def counting(*args: object) -> torch.Tensor:
        fused.append(1)
        return orig(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "_fused_decode", counting)
    got = _greedy(native, PROMPTS)
    assert fused, "int8 decode steps must go through decode_step.c"
    singles = [_greedy(native, [p])[0] for p in PROMPTS]
    monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    reference = LLM(str(tiny_model), **kw)  # type: ignore[arg-type]
    assert not reference.engine.runner.native_decode
    want = _greedy(reference, PROMPTS)
    assert got == want
    assert singles == want


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
def test_fused_int8_decode_step_equals_per_layer_path(tiny_model: Path, activations: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_step.c with weight code 2 (int8) chains the same int8_gemm calls as the per-layer path."""
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    if activations == "bfloat16":
        monkeypatch.setenv("KVSERVE_CPU_FLAGS", "avx2 fma avx512_bf16")
    from kvserve.core.request import Request
    from kvserve.core.scheduler_output import ScheduledRequest
    from kvserve.worker.input_batch import prepare_inputs

    llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype=activations, quantization="int8")
    runner, model = llm.engine.runner, llm.engine.runner.model
    assert model._weight_fmt() == cpu_kernels.WEIGHT_FMT_INT8
    bs, cpu, lens = runner.block_size, torch.device("cpu"), [5, 17, 30]
    tables, nxt = [], 0
    for n in lens:
        nb = -(-(n + 1) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb

    def scheduled(c: int, n: int, table: list[int]) -> ScheduledRequest:
        req = Request("r", [(7 * i + 3) % 600 for i in range(c + n)], SamplingParams(), None, 8)
        return ScheduledRequest(req, c, n, table, sample=True)  # type: ignore[arg-type]

    with torch.inference_mode():
        ids, pos, meta, _ = prepare_inputs([scheduled(0, n, t) for n, t in zip(lens, tables, strict=True)], 0, bs, cpu,
                                           native_decode=True)
        model(ids, pos, runner.kv_caches, meta)
        decode = [scheduled(n, 1, t) for n, t in zip(lens, tables, strict=True)]
        ids, pos, meta, _ = prepare_inputs(decode, len(decode), bs, cpu, native_decode=True)
        assert model._can_fuse_decode(model.embed_tokens(ids).to(model.compute_dtype), runner.kv_caches, meta)
        fused = model(ids, pos, runner.kv_caches, meta)
        model.fuse_decode = False
        per_layer = model(ids, pos, runner.kv_caches, meta)
    assert fused.dtype == model.compute_dtype
    assert torch.equal(fused, per_layer)
