"""Shared fixtures: the default real model, loaded once per test session, and its HF transformers twin."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import kvserve.engine.llm_engine as llm_engine_module
from kvserve import cpu_features
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_weights

# The fp32 equality tests (HF token for token) rely on `--dtype auto` = float32 on CPU. On a host with native
# bf16 dot products auto would pick bfloat16, so the dtype choice is shown the host's flags without them
# (also in server subprocesses, through the environment); kernel tests read the real flags (host_flags).
os.environ.setdefault("KVSERVE_CPU_FLAGS",
                      " ".join(sorted(cpu_features.host_flags() - set(cpu_features.BF16_FLAGS))) or "none")

# Tests share 2 cores with whatever else runs; 2 OpenMP threads under contention can be 10x slower.
torch.set_num_threads(int(os.environ.get("KVSERVE_TEST_THREADS", "1")))

DEFAULT_MODEL = "smollm2-135m-instruct"


@functools.lru_cache(maxsize=2)
def _cached_weights(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    return load_weights(path)


@pytest.fixture(autouse=True, scope="session")
def _share_loaded_weights() -> Any:
    """Dequantizing the GGUF takes seconds; every engine in the session reuses one copy of the tensors."""
    mp = pytest.MonkeyPatch()
    mp.setattr(llm_engine_module, "load_weights", _cached_weights)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path) -> Any:
    """HF transformers' own model from the same GGUF file: the correctness oracle (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random HF folder: qwen2 (QKV bias, untied head, GQA) or llama (tied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    torch.manual_seed(0)
    common = dict(vocab_size=600, hidden_size=128, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.2,
                  rope_theta=10000.0)
    if request.param == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common)).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        hf = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common)).eval()
    hf.save_pretrained(path)
    return path
