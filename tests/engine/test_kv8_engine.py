"""The 8-bit KV cache inside the engine, on a tiny random-weight Qwen2 (GQA 4/2, head_dim 64): blocks move
with their scales (export -> import, swap, copy-on-write, offload tier), so every way of getting a block
back gives the tokens of the same 8-bit engine that never moved it; capacity in exact block counts; the
configuration refusals.

Geometry as tests/engine/test_kv_offload.py: fp32, blocks of 4 tokens, a pool of 16 blocks, six prompts
of 24 token ids and 8 greedy tokens each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.block_hash import BlockHash
from kvserve.core.block_manager import BlockId
from kvserve.engine import llm_engine
from kvserve.engine.llm_engine import model_fingerprint
from kvserve.errors import InvalidRequestError
from kvserve.worker.kv_cache import GiB

BS = 4
POOL = 16
PROMPT_LEN = 24
HIT = (PROMPT_LEN - 1) // BS * BS
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_gen = torch.Generator().manual_seed(13)
PROMPTS = [torch.randint(0, 512, (PROMPT_LEN,), generator=_gen).tolist() for _ in range(6)]
KV8 = ["int8", "fp8"]
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64
ROW = {"int8": HEAD_DIM + 2 * 4, "fp8": HEAD_DIM + 4}  # codes + 4 float16 scales (one per 16) / one float32 scale


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2-kv8")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.2, rope_theta=10000.0)  # type: ignore[call-arg]
    Qwen2ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _llm(model: Path, kv: str, **kwargs: Any) -> LLM:
    return LLM(str(model), skip_tokenizer_init=True, dtype="float32", block_size=BS, kv_cache_dtype=kv,
               **{"num_gpu_blocks_override": POOL, "swap_space": 0.01, **kwargs})


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, list[list[int]]]:
    """Each prompt alone on a pool that never evicts, prefix caching off: no block ever moves."""
    refs = {}
    for kv in KV8:
        llm = _llm(model, kv, num_gpu_blocks_override=200, enable_prefix_caching=False)
        refs[kv] = [_run(llm, [p])[0][0] for p in PROMPTS]
    return refs


@pytest.mark.parametrize("kv", KV8)
def test_cache_layout_and_exact_block_counts(model: Path, kv: str) -> None:
    """Rows of head_dim codes + their scales (int8: a float16 per 16 channels, 72 bytes; fp8: a float32, 68); a
    budget holds floor(budget / block_bytes) blocks with block_bytes = block_size x 2 x layers x kv_heads x row:
    1.78x (int8) and 1.88x (fp8) the blocks of a bf16 cache."""
    llm = _llm(model, kv, num_gpu_blocks_override=None, kv_cache_memory=0.01)
    bf16 = _llm(model, "bfloat16", num_gpu_blocks_override=None, kv_cache_memory=0.01)
    runner = llm.engine.runner
    k_cache = runner.kv_caches[0][0]
    assert k_cache.dtype == {"int8": torch.int8, "fp8": torch.uint8}[kv]
    assert k_cache.shape[1:] == (BS, KV_HEADS, ROW[kv])
    assert llm.engine.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    block8 = BS * 2 * LAYERS * KV_HEADS * ROW[kv]
    block16 = BS * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # 6,144
    assert llm.engine.kv_block_bytes() == runner.block_bytes == block8 == {"int8": 3456, "fp8": 3264}[kv]
    assert bf16.engine.kv_block_bytes() == block16
    budget = int(0.01 * GiB)
    assert llm.engine.num_blocks == budget // block8 == {"int8": 3106, "fp8": 3289}[kv]
    assert bf16.engine.num_blocks == budget // block16 == 1747
    assert llm.engine.runner.host_kv_caches[0][0].shape[1:] == k_cache.shape[1:]  # the swap pool, scales too


@pytest.mark.parametrize("kv", KV8)
def test_export_import_round_trip_is_exact(model: Path, kv: str) -> None:
    """Payloads (offload tiers, PD transfer) hold one block's codes and scales: export -> import -> identical
    bytes, and the payload is exactly ``offload_block_shape`` bytes."""
    runner = _llm(model, kv).engine.runner
    g = torch.Generator().manual_seed(1)
    for k, v in runner.kv_caches:
        k.copy_(torch.randint(-128, 128, k.shape, generator=g, dtype=torch.int16).to(torch.uint8).view(k.dtype))
        v.copy_(torch.randint(-128, 128, v.shape, generator=g, dtype=torch.int16).to(torch.uint8).view(v.dtype))
    assert runner.offload_block_shape == (LAYERS, 2, BS, KV_HEADS, ROW[kv])
    src = [(BlockId(3), BlockHash(b"a"), False), (BlockId(9), BlockHash(b"b"), True)]
    payloads = runner.export_blocks(src)
    assert [len(p) for _, p, _ in payloads] == [LAYERS * 2 * BS * KV_HEADS * ROW[kv]] * 2
    runner.import_blocks([(BlockId(5), payloads[0][1]), (BlockId(12), payloads[1][1])])
    for k, v in runner.kv_caches:
        assert torch.equal(k[5], k[3]) and torch.equal(v[12], v[9])
    again = runner.export_blocks([(BlockId(5), BlockHash(b"a"), False), (BlockId(12), BlockHash(b"b"), False)])
    assert [p for _, p, _ in again] == [p for _, p, _ in payloads]
    with pytest.raises(ValueError, match="expected"):
        runner.import_blocks([(BlockId(1), payloads[0][1][:-(ROW[kv] - HEAD_DIM)])])  # the scales are part of it


@pytest.mark.parametrize("kv", KV8)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_the_unmoved_tokens(model: Path, reference: dict[str, list[list[int]]], kv: str,
                                             mode: str) -> None:
    """All six prompts in one batch on a pool of 14 blocks (two requests are admitted with 6 blocks each and
    grow to 8): requests are preempted (swapped out and in with their scales, or recomputed: quantization is
    deterministic) and still give the reference's tokens."""
    llm = _llm(model, kv, preemption_mode=mode, max_num_batched_tokens=32, enable_prefix_caching=False,
               num_gpu_blocks_override=14)
    tokens, _ = _run(llm, PROMPTS)
    counts = llm.engine.scheduler.num_preemptions_by_mode
    assert counts[mode] > 0, counts
    assert tokens == reference[kv]
    if mode == "swap":
        assert llm.engine.scheduler.swapped_bytes > 0
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kv", KV8)
def test_prefix_cache_hits_equal_misses(model: Path, reference: dict[str, list[list[int]]], kv: str) -> None:
    """A repeat reads the quantized blocks its first run wrote (BC-23's cache-hit == cache-miss), and a longer
    prompt continues from them (a chunk with an offset over cached 8-bit blocks)."""
    llm = _llm(model, kv, num_gpu_blocks_override=64)
    first, cached = _run(llm, PROMPTS[:2])
    assert first == reference[kv][:2] and cached == [0, 0]
    again, cached = _run(llm, PROMPTS[:2])
    assert again == first and cached == [HIT, HIT]
    # a prompt extending prompt 0: its prefix blocks hit, the rest is computed over them
    longer = PROMPTS[0] + PROMPTS[1][:6]
    ref = _run(_llm(model, kv, num_gpu_blocks_override=64, enable_prefix_caching=False), [longer])[0]
    out, cached = _run(llm, [longer])
    assert out == ref and cached == [PROMPT_LEN]


@pytest.mark.parametrize("kv", KV8)
def test_offload_cpu_tier_round_trip(model: Path, reference: dict[str, list[list[int]]], kv: str) -> None:
    """Blocks evicted from the 16-block pool go to the cpu tier as payloads with their scales and come back
    for a repeat: same tokens, the prefix taken from the tier."""
    llm = _llm(model, kv, kv_offload_cpu_gib=0.002)
    try:
        for i in range(6):
            assert _run(llm, [PROMPTS[i]]) == ([reference[kv][i]], [0])
        offload = llm.engine.offload
        assert offload is not None
        offload.flush()
        assert offload.block_nbytes == LAYERS * 2 * BS * KV_HEADS * ROW[kv]
        for i in (0, 1):  # evicted from the device by the prompts after them
            assert _run(llm, [PROMPTS[i]]) == ([reference[kv][i]], [HIT])
        assert offload.tiers[0].stats.loads == 2 * HIT // BS
    finally:
        llm.engine.close()


def test_8bit_dtypes_are_named_and_others_refused(model: Path) -> None:
    """vLLM's spellings: fp8 = fp8_e4m3 (one cache, one fingerprint); int8 and fp8 blocks never mix with each
    other or with float caches (the fingerprint names the KV dtype); an unsupported name fails at start-up."""
    engines = {kv: _llm(model, kv).engine for kv in ("int8", "fp8", "fp8_e4m3", "float32")}
    prints = {kv: e.fingerprint for kv, e in engines.items()}
    assert prints["fp8"] == prints["fp8_e4m3"]
    assert len({prints["int8"], prints["fp8"], prints["float32"]}) == 3
    # the int8 row layout (a float16 scale per 16 channels) is named too: a block of the earlier per-row int8
    # layout (68 bytes a row at head_dim 64; as wide as the grouped row at head_dim 17-32) never matches
    e = engines["int8"]
    args = (e.model_path, e.arch, e.tokenizer, e.kv_dtype, e.dtype, e.compute_dtype)
    assert prints["int8"] == model_fingerprint(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "layout_tag", lambda dtype: None)
        assert model_fingerprint(*args) != prints["int8"]
    for bad in ("fp8_e5m2", "uint8", "int4"):
        with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
