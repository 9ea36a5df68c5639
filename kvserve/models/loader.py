"""Load a model's config, weights and tokenizer from a GGUF file or an HF folder (safetensors).

GGUF tensors (Q4_1, Q8_0, ...) are dequantized to float32 (the formats of ``layers/gguf_formats.py`` by
``gguf_blocks.dequantize``, others by the ``gguf`` package: the same bits), then cast to the engine's dtype;
with ``--quantization gguf`` (``load_gguf_blocks``) they stay blocks (``layers/gguf_blocks.py``).
llama.cpp's converter permutes the rows of Llama's q/k projections (it uses interleaved RoPE); we undo that
permutation so the weights match HF's layout and HF's rotate-half RoPE, exactly as transformers' own GGUF loader
does (on blocks: whole rows move, each row's blocks unchanged).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.layers.gguf_blocks import GGUFTensor, dequantize, from_numpy_rows
from kvserve.layers.gguf_formats import FORMATS
from kvserve.models.catalog import cache_dir
from kvserve.models.registry import ModelArchConfig, gguf_arch_config, open_gguf

logger = logging.getLogger(__name__)

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: its rows are ``[head, half, 2]`` (interleaved pairs); HF's
    rotate-half layout wants ``[head, 2, half]``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """GGUF file -> (config, HF-named float32 tensors)."""
    cfg, weights = _read_gguf(path, keep_blocks=False)
    return cfg, {name: t for name, t in weights.items() if isinstance(t, torch.Tensor)}


def load_gguf_blocks(path: Path) -> tuple[ModelArchConfig, dict[str, torch.Tensor | GGUFTensor]]:
    """GGUF file -> (config, HF-named tensors) for ``--quantization gguf``: every quantized tensor kept as its
    blocks (a ``GGUFTensor``: the file's bytes of each row, rows in HF order), float tensors (F32, F16, BF16) as
    float32 tensors."""
    return _read_gguf(path, keep_blocks=True)


def _read_gguf(path: Path, keep_blocks: bool) -> tuple[ModelArchConfig, dict[str, torch.Tensor | GGUFTensor]]:
    import gguf

    reader = open_gguf(path)
    cfg = gguf_arch_config(reader)
    weights: dict[str, torch.Tensor | GGUFTensor] = {}
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for t in reader.tensors:
        name = t.name
        if name in _GGUF_NAMES:
            hf = _GGUF_NAMES[name]
        else:
            parts = name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
                logger.debug("skipping GGUF tensor %s", name)
                continue
            hf = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
        # GGUF lists dims fastest-first; torch wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        if keep_blocks and t.tensor_type not in floats and len(shape) == 2:
            rows = np.asarray(t.data).reshape(shape[0], -1)  # [rows, row bytes]: blocks never straddle rows
            if cfg.architecture == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
                n = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
                rows = _unpermute(rows, n)  # whole rows move, so their blocks stay intact
            weights[hf] = GGUFTensor(int(t.tensor_type), shape[0], shape[1], from_numpy_rows(rows))
            continue
        if int(t.tensor_type) in FORMATS:
            # our torch dequantization: the gguf package's bits (tests/unit/test_gguf_gemm.py), 3-12x faster on
            # the catalog's Q8_0 / Q4_1 / Q5_0 tensors, multi-threaded
            rows = np.asarray(t.data).reshape(int(np.prod(shape[:-1])), -1)
            arr = dequantize(torch.from_numpy(rows.copy()), int(t.tensor_type)).numpy().reshape(shape)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if cfg.architecture == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
            arr = _unpermute(arr, n)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            arr = arr.copy()
        weights[hf] = torch.from_numpy(arr)
    return cfg, weights


def load_hf_folder(path: Path) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """HF folder (config.json + *.safetensors) -> (config, tensors)."""
    from safetensors.torch import load_file

    cfg = ModelArchConfig.from_hf_config(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return cfg, weights


def load_weights(path: Path) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """A resolved model path (``.gguf`` file or HF folder) -> (config, HF-named tensors)."""
    return load_gguf(path) if path.suffix == ".gguf" else load_hf_folder(path)


def load_hf_tokenizer(path: Path) -> Any:
    """The HF fast tokenizer (with chat template) of a GGUF file or an HF folder.

    Rebuilding a tokenizer from GGUF metadata takes ~10 s, so the result is saved once under the cache
    directory, keyed by the file's name, size and mtime, and loaded from there afterwards.
    """
    from transformers import AutoTokenizer

    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    st = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = cached.with_name(cached.name + ".partial")
        tok.save_pretrained(str(tmp))
        tmp.replace(cached)
    except OSError as e:  # a read-only cache only costs time
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return tok
