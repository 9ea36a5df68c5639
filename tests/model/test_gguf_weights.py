"""``--quantization gguf`` through the engine, on tiny random models written as GGUF files with quantized tensors:

* ``qwen2`` (QKV bias, untied head, GQA) with every format in play and formats varying inside a fused projection
  and between layers, as Qwen2.5-Coder's files do: q/k Q5_0 + v Q8_0 (layer 0) or Q5_0 (layer 1), o Q4_1,
  gate/up Q4_K, down Q6_K (layer 0) or Q4_K (layer 1), Q4_0 embeddings, Q6_K head;
* ``llama`` with a tied head, as SmolLM2's file: Q4_1 projections, a Q8_0 table that is also the head.

The native path (``gguf_gemm.c``, through the fused decode step) equals the torch reference path token for token,
the fused decode step equals the per-layer path bitwise, the model holds the file's blocks, and it stays close to
the same file served dequantized (today's loader), the activations' quantization being the only difference.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import Q, quantize_q4_k, quantize_q6_k, write_tiny_gguf

from kvserve import LLM, SamplingParams
from kvserve.layers import cpu_kernels
from kvserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear

PROMPTS = [[5, 17, 300], [(7 * i + 3) % 600 for i in range(19)], [(11 * i + 1) % 600 for i in range(70)]]

QWEN_FORMATS = {"token_embd": Q.Q4_0, "output": Q.Q6_K, "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_output": Q.Q4_1,
                "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K}


def _qwen_format(kind: str, layer: int) -> Q:
    if kind == "attn_v":
        return Q.Q8_0 if layer == 0 else Q.Q5_0
    if kind == "ffn_down":
        return Q.Q6_K if layer == 0 else Q.Q4_K
    return QWEN_FORMATS[kind]


def _llama_format(kind: str, layer: int) -> Q:
    return Q.Q8_0 if kind == "token_embd" else Q.Q4_1


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"tiny_gguf_{request.param}") / "model.gguf"
    if request.param == "qwen2":
        return write_tiny_gguf(path, "qwen2", _qwen_format, hidden=256, intermediate=512, bias=True)
    return write_tiny_gguf(path, "llama", _llama_format, hidden=128, intermediate=96, tied=True)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("qtype,fn", [(Q.Q4_K, quantize_q4_k), (Q.Q6_K, quantize_q6_k)])
def test_k_quant_writer_round_trips_through_gguf(qtype: Q, fn: object) -> None:
    """The test files' own Q4_K / Q6_K quantizer, checked against the gguf package's dequantization."""
    w = np.random.default_rng(0).normal(0, 0.1, (8, 512))
    got = gguf.quants.dequantize(fn(w), qtype).reshape(8, 512)  # type: ignore[operator]
    step = (w.max() - w.min()) / (15 if qtype == Q.Q4_K else 63)
    assert np.abs(got - w).max() < step and np.abs(got - w).mean() < step / 3


def test_gguf_model_holds_the_files_blocks(tiny_gguf: Path) -> None:
    llm = _llm(tiny_gguf, quantization="gguf")
    model = llm.engine.runner.model
    reader = gguf.GGUFReader(str(tiny_gguf))
    tensors = {t.name: t for t in reader.tensors}
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and isinstance(model.embed_tokens, GGUFEmbedding)
    assert all(isinstance(m, GGUFLinear) for layer in model.layers
               for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert not any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in model.modules())
    if model.config.architecture == "qwen2":  # parts of one projection in their own formats, merged where equal
        assert [(gguf.GGMLQuantizationType(c).name, r) for c, r in qkv.segments] == [("Q5_0", 384), ("Q8_0", 128)]
        assert model.layers[1].self_attn.qkv_proj.segments == [(int(Q.Q5_0), 512)]
        assert [c for c, _ in model.layers[1].mlp.down_proj.segments] == [int(Q.Q4_K)]
        assert qkv.bias is not None
        head = tensors["output.weight"]
        assert np.array_equal(model.lm_head.blocks()[0][1].numpy(), np.asarray(head.data))  # the file's bytes
        assert model.layers[0].self_attn.qkv_proj.blocks()[1][1].numpy().tobytes() == \
            np.asarray(tensors["blk.0.attn_v.weight"].data).tobytes()
    else:  # the tied head multiplies the table's own Q8_0 blocks: one buffer
        assert isinstance(model.lm_head, GGUFLinear)
        assert model.lm_head.packed.data_ptr() == model.embed_tokens.packed.data_ptr()
    emb = tensors["token_embd.weight"]
    ids = torch.tensor([3, 599, 0, 3])
    want = gguf.quants.dequantize(np.asarray(emb.data)[ids.numpy()], emb.tensor_type)
    assert np.array_equal(model.embed_tokens(ids).numpy(), want)  # only the looked-up rows, dequantized exactly
    # the planner's GGUF weight bytes are the served model's, exactly
    from kvserve.planner.model_info import load_model_info

    served = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
                 if not name.startswith("rotary."))
    assert load_model_info(str(tiny_gguf)).gguf_weight_bytes(4) == served
    float_llm = _llm(tiny_gguf)
    assert llm.engine.fingerprint != float_llm.engine.fingerprint  # gguf KV never served to the float model
    int8_llm = _llm(tiny_gguf, quantization="int8")
    assert llm.engine.fingerprint != int8_llm.engine.fingerprint
    # the same blocks, dequantized at load: only the activations' quantization differs
    got, ref = _greedy(llm, PROMPTS), _greedy(float_llm, PROMPTS)
    firsts = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), 16)
              for g, r in zip(got, ref, strict=True)]
    print(f"\nfirst greedy divergence from the dequantized model: {firsts} of 16")
    assert sum(firsts) >= 24, firsts


def test_loader_dequantizes_every_format_as_the_gguf_package(tiny_gguf: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The float loader's torch dequantization (every format of the file) gives the gguf package's bits, tensor
    for tensor, and ``open_gguf``'s faster reader sees the same fields and tensor bytes as ``GGUFReader``."""
    from kvserve.models import loader
    from kvserve.models.registry import open_gguf

    _, got = loader.load_gguf(tiny_gguf)
    monkeypatch.setattr(loader, "FORMATS", {})  # every tensor through gguf.quants.dequantize
    _, want = loader.load_gguf(tiny_gguf)
    assert got.keys() == want.keys() and len(got) > 10
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape, name
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), name
    fast, slow = open_gguf(tiny_gguf), gguf.GGUFReader(str(tiny_gguf))
    assert type(fast.data) is np.ndarray and fast.fields.keys() == slow.fields.keys()
    for key in slow.fields:
        assert fast.fields[key].contents() == slow.fields[key].contents(), key
    assert [(t.name, int(t.tensor_type)) for t in fast.tensors] == [(t.name, int(t.tensor_type)) for t in slow.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, slow.tensors, strict=True))


def test_native_gguf_equals_torch_reference(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched and single prompts, prefill (up to 70 rows) and decode: the same tokens with the native kernels
    (``gguf_gemm``, fused decode steps) and with the torch path (``gguf_linear_reference``, SDPA), float32."""
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    native = _llm(tiny_gguf, quantization="gguf")
    fused = []
    model = native.engine.runner.model
    orig = model._fused_decode

    def counting(*args: object) -> torch.Tensor:
        fused.append(1)
        return orig(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "_fused_decode", counting)
    got = _greedy(native, PROMPTS)
    assert fused, "gguf decode steps must go through decode_step.c"
    singles = [_greedy(native, [p])[0] for p in PROMPTS]
    monkeypatch.setattr(cpu_kernels, "_library", lambda: None)
    reference = _llm(tiny_gguf, quantization="gguf")
    assert not reference.engine.runner.native_decode
    want = _greedy(reference, PROMPTS)
    assert got == want
    assert singles == want


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
def test_fused_gguf_decode_step_equals_per_layer_path(tiny_gguf: Path, activations: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_step.c with weight code 3 (GGUF segment tables) chains the same gguf_gemm calls as the per-layer
    path: bitwise equal."""
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    if activations == "bfloat16":
        monkeypatch.setenv("KVSERVE_CPU_FLAGS", "avx2 fma avx512_bf16")
    from kvserve.core.request import Request
    from kvserve.core.scheduler_output import ScheduledRequest
    from kvserve.worker.input_batch import prepare_inputs

    llm = LLM(str(tiny_gguf), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype=activations, quantization="gguf")
    runner, model = llm.engine.runner, llm.engine.runner.model
    assert model._weight_fmt() == cpu_kernels.WEIGHT_FMT_GGUF
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


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path) -> None:
    """An HF folder with ``quantization="gguf"``: a clear error naming the field; an unknown value likewise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.config import EngineConfig
    from kvserve.errors import InvalidRequestError

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64)).save_pretrained(tmp_path)
    with pytest.raises(InvalidRequestError, match=r"quantization: gguf .* not a \.gguf file") as e:
        LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, quantization="gguf")
    assert e.value.param == "quantization"
    assert EngineConfig(quantization="gguf").quantization == "gguf"
    with pytest.raises(InvalidRequestError, match="quantization: must be None or one of int8, gguf, got 'q4'"):
        EngineConfig(quantization="q4")


def test_unserved_block_format_is_refused_by_name(tmp_path: Path) -> None:
    """A Q5_1 projection: the error names the tensor, its type and the formats served."""
    path = write_tiny_gguf(tmp_path / "q51.gguf", "llama",
                           lambda kind, layer: Q.Q5_1 if kind == "ffn_up" else Q.Q8_0, hidden=64, intermediate=64,
                           layers=1, tied=True)
    with pytest.raises(ValueError, match=r"gguf serves Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K blocks; "
                                         r"model\.layers\.0\.mlp\.up_proj\.weight is Q5_1"):
        _llm(path, quantization="gguf")
    assert _greedy(_llm(path), [[1, 2, 3]], 2)  # served dequantized without the flag
