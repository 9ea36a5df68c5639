"""Tensor parallelism without processes: the step message's token deltas, the checkpoint split, CPU pinning,
and the configurations refused before any worker starts."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import re
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.block_manager import BlockId
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.distributed.data_parallel import add_data_parallel_args, check_data_parallel_args
from kvserve.distributed.tp_group import rank_cpus
from kvserve.errors import InvalidRequestError
from kvserve.executor.launch import check_gpu_count
from kvserve.executor.worker_step import StepDecoder, StepEncoder
from kvserve.models.registry import ModelArchConfig
from kvserve.models.tp_shard import shard_arch, shard_weights, vocab_shard_size


def _req(request_id: str, prompt: list[int], **params: Any) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8, **params), None, 8)


def _row(req: Request, computed: int, scheduled: int, blocks: list[int], sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(req, computed, scheduled, [BlockId(b) for b in blocks], sample)


def _roundtrip(enc: StepEncoder, dec: StepDecoder, so: SchedulerOutput) -> tuple[SchedulerOutput, Any]:
    msg = pickle.loads(pickle.dumps(enc.encode(so)))  # as it crosses the pipe
    return dec.decode(msg), msg


def _assert_same_inputs(a: SchedulerOutput, b: SchedulerOutput) -> None:
    """The worker's rebuilt step computes the same tokens at the same positions into the same blocks."""
    assert len(a.scheduled) == len(b.scheduled)
    for x, y in zip(a.scheduled, b.scheduled, strict=True):
        end = x.num_computed_tokens + x.num_scheduled_tokens
        assert (y.request.request_id, y.num_computed_tokens, y.num_scheduled_tokens, y.block_table, y.sample) == (
            x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens, x.block_table, x.sample)
        assert y.request.all_token_ids[:end] == x.request.all_token_ids[:end]
        assert y.request.prompt_token_ids == x.request.prompt_token_ids
        assert y.request.sampling_params.prompt_logprobs == x.request.sampling_params.prompt_logprobs


def test_step_message_sends_token_deltas_and_survives_preemption_and_id_reuse() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    a, b = _req("a", [1, 2, 3, 4, 5], prompt_logprobs=2), _req("b", [6, 7, 8, 9])
    # step 1: a's first chunk (3 of 5), b's whole prompt
    so = SchedulerOutput([_row(a, 0, 3, [0], sample=False), _row(b, 0, 4, [1])])
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert [r.tokens for r in msg.rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]  # first sight: whole prompts
    assert [r.new[0] if r.new else None for r in msg.rows] == [5, 4]
    b.append_output_token(99)
    # step 2: a's last chunk, b decodes: b sends its one new token only
    so = SchedulerOutput([_row(b, 4, 1, [1, 2]), _row(a, 3, 2, [0])], blocks_to_copy=[(BlockId(1), BlockId(2))])
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert [(r.start, r.tokens, r.new) for r in msg.rows] == [(4, [99], None), (3, [4, 5], None)]
    assert got.blocks_to_copy == [(1, 2)]
    a.append_output_token(42)
    b.append_output_token(98)
    # step 3: b preempted by recompute (its KV dropped): it recomputes prompt + outputs from 0; a decodes
    so = SchedulerOutput([_row(a, 5, 1, [0, 3]), _row(b, 0, 6, [4, 5])], preempted_request_ids=["b"])
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert [(r.start, r.tokens) for r in msg.rows] == [(5, [42]), (0, [6, 7, 8, 9, 99, 98])]
    # step 4: a finished (reported), a new request reuses its id with another prompt: sent whole, not as a delta
    a2 = _req("a", [11, 12, 13])
    so = SchedulerOutput([_row(a2, 0, 3, [0])], finished_request_ids=["a"])
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert msg.rows[0].new is not None and msg.rows[0].tokens == [11, 12, 13] and set(dec.mirrors) == {"a", "b"}
    # b finishes on a step that runs no model (the engine tells the executor); a later "b" is new again
    enc.forget(["b"])
    b2 = _req("b", [21, 22])
    so = SchedulerOutput([_row(b2, 0, 2, [6])])
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert msg.finished_request_ids == ["b"] and msg.rows[0].tokens == [21, 22]
    assert dec.mirrors["b"].prompt_token_ids == [21, 22]


def test_an_id_reused_by_another_request_object_is_sent_whole() -> None:
    """Even when no step reported the first request's end, another Request under the same id is new."""
    enc, dec = StepEncoder(), StepDecoder()
    _roundtrip(enc, dec, SchedulerOutput([_row(_req("x", [1, 2, 3, 4]), 0, 4, [0])]))
    other = _req("x", [1, 2, 9, 9, 9])
    so = SchedulerOutput([_row(other, 2, 3, [0])])  # (a prefix-cache hit of 2 tokens)
    got, msg = _roundtrip(enc, dec, so)
    _assert_same_inputs(so, got)
    assert msg.rows[0].start == 0 and msg.rows[0].tokens == [1, 2, 9, 9, 9]


ARCH = ModelArchConfig("qwen2", vocab_size=515, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=2, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=True)


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a, d = ARCH, ARCH.head_dim
    shapes = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
              "lm_head.weight": (a.vocab_size, a.hidden_size), "model.norm.weight": (a.hidden_size,)}
    p = "model.layers.0."
    kv = a.num_key_value_heads * d
    for n, rows in (("q", a.num_attention_heads * d), ("k", kv), ("v", kv)):
        shapes[p + f"self_attn.{n}_proj.weight"] = (rows, a.hidden_size)
        shapes[p + f"self_attn.{n}_proj.bias"] = (rows,)
    shapes[p + "self_attn.o_proj.weight"] = (a.hidden_size, a.num_attention_heads * d)
    shapes[p + "mlp.gate_proj.weight"] = (a.intermediate_size, a.hidden_size)
    shapes[p + "mlp.up_proj.weight"] = (a.intermediate_size, a.hidden_size)
    shapes[p + "mlp.down_proj.weight"] = (a.hidden_size, a.intermediate_size)
    shapes[p + "input_layernorm.weight"] = (a.hidden_size,)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_shards_reassemble_the_checkpoint() -> None:
    full = _checkpoint()
    shards = [shard_weights(full, ARCH, r, 2) for r in range(2)]
    p = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight"):  # column-parallel: rows split, in rank order
        half = (full[p + name].shape[0] // 2, *full[p + name].shape[1:])
        assert [tuple(s[p + name].shape) for s in shards] == [half, half]
        assert torch.equal(torch.cat([s[p + name] for s in shards]), full[p + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel: input columns split
        assert torch.equal(torch.cat([s[p + name] for s in shards], dim=1), full[p + name])
    for name in ("model.norm.weight", p + "input_layernorm.weight"):
        assert all(s[name] is full[name] for s in shards)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 515 rows -> 258 + 257 and one zero row
        assert vocab_shard_size(515, 2) == 258 and [s[name].shape[0] for s in shards] == [258, 258]
        assert torch.equal(torch.cat([s[name] for s in shards])[:515], full[name])
        assert not shards[1][name][-1].any()
    local = shard_arch(ARCH, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 6)
    assert (local.vocab_size, local.hidden_size, local.head_dim) == (515, 8, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "inter", "size", "what"), [
    (9, 3, 1536, 2, "9 attention (query) heads"),  # SmolLM2-135M
    (14, 2, 4864, 4, "14 attention (query) heads"),  # Qwen2.5-Coder-0.5B at 4
    (16, 2, 4864, 4, "2 KV heads"),  # more ranks than KV heads: vLLM replicates them, kvserve refuses
    (4, 2, 129, 2, "129 MLP intermediate size"),
    (4, 2, 128, 0, None),
])
def test_shard_arch_refuses_what_does_not_split(heads: int, kv_heads: int, inter: int, size: int,
                                                what: str | None) -> None:
    arch = dataclasses.replace(ARCH, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter)
    with pytest.raises(InvalidRequestError, match=re.escape("tensor_parallel_size: " + (
            f"{size} does not divide the model's {what}" if what else "must be >= 1"))) as e:
        shard_arch(arch, size)
    assert e.value.param == "tensor_parallel_size"


def test_ranks_get_disjoint_cpus_or_none() -> None:
    assert rank_cpus(2, 2, set(range(8))) == [{0, 1}, {2, 3}]
    assert rank_cpus(2, 1, {3, 5}) == [{3}, {5}]
    assert rank_cpus(3, 1, {0, 1}) is None  # more threads than CPUs: the OS places them
    check_gpu_count(2, 2)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: 4 ranks need 4 GPUs .* has 1"):
        check_gpu_count(4, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size: must be >= 1, got 0"),
    ({"distributed_executor_backend": "threads"}, "distributed_executor_backend: must be mp or ray, got 'threads'"),
    ({"tensor_parallel_size": 2, "quantization": "int8"}, "--tensor-parallel-size 2 cannot be combined with "
                                                          "--quantization int8"),
    ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "cannot be combined with --speculative-config"),
    ({"tensor_parallel_size": 2, "kv_offload_cpu_gib": 1.0}, "cannot be combined with the KV offload tiers"),
    ({"tensor_parallel_size": 2, "kv_transfer_config": {"kv_connector": "ZmqConnector", "kv_role": "kv_both"}},
     "cannot be combined with --kv-transfer-config"),
])
def test_config_refusals_name_the_flags(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**kwargs)
    assert EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_dtype="int8")


def test_data_and_tensor_parallel_together_are_refused() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    add_data_parallel_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--data-parallel-size", "2"])
    with pytest.raises(InvalidRequestError, match="data_parallel_size: .* with --tensor-parallel-size > 1"):
        check_data_parallel_args(args)
    args = parser.parse_args(["-tp", "2", "--distributed-executor-backend", "ray"])
    assert EngineConfig.from_cli_args(args).tensor_parallel_size == 2 and not check_data_parallel_args(args)


@pytest.mark.slow
def test_smollm2_at_size_2_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: 2 does not divide the model's 9 attention "
                                                  r"\(query\) heads \(it has 9 query and 3 KV heads\)"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2, kv_cache_memory=0.05)
