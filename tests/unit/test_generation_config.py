"""--generation-config auto|vllm|FOLDER: the model's sampling defaults (kvserve/engine/generation_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.engine.generation_config import load_generation_defaults
from kvserve.errors import InvalidRequestError

QWEN_LIKE = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
             "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 300,
             "transformers_version": "4.37.0"}


def _folder(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_model_folder(tmp_path: Path) -> None:
    model = _folder(tmp_path, QWEN_LIKE)
    assert load_generation_defaults("auto", model) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                       "repetition_penalty": 1.05, "max_tokens": 300}
    assert load_generation_defaults("vllm", model) == {}


def test_auto_without_a_config_and_gguf_give_nothing(tmp_path: Path) -> None:
    assert load_generation_defaults("auto", tmp_path) == {}
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _folder(tmp_path, QWEN_LIKE)
    assert load_generation_defaults("auto", gguf) == {}


def test_a_folder_source(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    folder = _folder(tmp_path / "cfg", {"temperature": 0.3})
    assert load_generation_defaults(str(folder), tmp_path / "elsewhere.gguf") == {"temperature": 0.3}


@pytest.mark.parametrize("config", [{"temperature": -1}, {"top_p": 0}, [1, 2]])
def test_bad_values_name_the_flag(tmp_path: Path, config: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        load_generation_defaults("auto", _folder(tmp_path, config))
    assert e.value.param == "generation_config"


def test_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_generation_defaults(str(tmp_path / "nope"), tmp_path)
