"""A model's architecture and weight sizes without loading its weights.

GGUF (catalog names, ``.gguf`` paths): ``gguf.GGUFReader`` memory-maps the file and parses the header;
no tensor is read or dequantized. HF folders: ``config.json`` and the JSON header of each
``*.safetensors`` file (8-byte little-endian length, then the header). The parameter count is the sum of
tensor elements (a tied embedding counts once); the bytes a decode step reads are that count times the
serving dtype's element size (kvserve dequantizes GGUF tensors to its dtype; cost-model.md "Decode roofline").
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.models.registry import ModelArchConfig


@dataclass(frozen=True)
class ModelInfo:
    """Attributes: ``num_params`` (elements of all tensors), ``file_bytes`` (tensor bytes as stored on disk),
    ``gguf_tensors`` (a GGUF file's tensors as ``name: (ggml type id, shape slowest-first)``; empty otherwise)."""

    name: str
    path: str
    arch: ModelArchConfig
    num_params: int
    file_bytes: int
    gguf_tensors: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights as served in a dtype of ``dtype_bytes`` per element."""
        return self.num_params * dtype_bytes

    def int8_weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights as served with ``--quantization int8`` (``layers/int8.py``): every projection of
        the decoder layers and the LM head at 1 byte per weight plus a float32 scale per output row (rows padded
        to 16 and input features to 32, as the kernel's layout); the embedding table, norms and biases in a
        dtype of ``dtype_bytes``. A tied head gets its own int8 copy (the table stays for lookups)."""
        a = self.arch

        def pad(x: int, to: int) -> int:
            return -(-x // to) * to

        h, qkv = a.hidden_size, (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
        shapes = [(qkv, h), (h, a.num_attention_heads * a.head_dim), (2 * a.intermediate_size, h),
                  (h, a.intermediate_size)]
        linear = a.num_hidden_layers * sum(pad(n, 16) * (pad(k, 32) + 4) for n, k in shapes)
        linear += pad(a.vocab_size, 16) * (pad(h, 32) + 4)
        untied_head = 0 if a.tie_word_embeddings else a.vocab_size * h  # elements of num_params the head owns
        rest = self.num_params - a.num_hidden_layers * sum(n * k for n, k in shapes) - untied_head
        return linear + rest * dtype_bytes  # (rest: the embedding table, norms and biases)


    def gguf_weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights as served with ``--quantization gguf`` (``layers/gguf_linear.py``): each projection,
        the embedding table and the LM head stored as blocks in the file keep them (rows padded to 16, a fused
        projection's parts of one format merged, each part's bytes padded to 64; ``gguf_formats.linear_nbytes``),
        a tied head shares the table's; float tensors (norms, biases, any float projection) in a dtype of
        ``dtype_bytes``.

        Raises:
            ValueError: not a GGUF file, or a block format the kernels do not serve.
        """
        from kvserve.layers.gguf_formats import linear_nbytes, packed_nbytes

        if not self.gguf_tensors:
            raise ValueError(f"quantization: gguf needs a .gguf model; {self.name} is not one")
        floats = (0, 1, 30)  # F32, F16, BF16
        a, t = self.arch, self.gguf_tensors
        groups = [["token_embd.weight"], *([["output.weight"]] if "output.weight" in t else [])]
        for i in range(a.num_hidden_layers):
            groups += [[f"blk.{i}.attn_{p}.weight" for p in "qkv"], [f"blk.{i}.attn_output.weight"],
                       [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"], [f"blk.{i}.ffn_down.weight"]]
        total = elements = 0
        for names in groups:
            parts = [t[n] for n in names]
            elements += sum(math.prod(shape) for _, shape in parts)
            cols = parts[0][1][1]
            if any(code in floats for code, _ in parts):
                total += sum(math.prod(shape) for _, shape in parts) * dtype_bytes
            elif names == ["token_embd.weight"]:
                total += packed_nbytes(parts[0][0], a.vocab_size, cols)
            else:
                total += linear_nbytes([(code, shape[0]) for code, shape in parts], cols)
        return total + (self.num_params - elements) * dtype_bytes  # norms and biases


def _gguf_info(name: str, path: Path) -> ModelInfo:
    from kvserve.models.registry import gguf_arch_config, open_gguf

    reader = open_gguf(path)
    arch = gguf_arch_config(reader)
    params = sum(int(t.n_elements) for t in reader.tensors)
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    tensors = {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    return ModelInfo(name, str(path), arch, params, stored, tensors)


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def _hf_info(name: str, path: Path) -> ModelInfo:
    arch = ModelArchConfig.from_hf_config(path / "config.json")
    params = stored = 0
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            count = math.prod(t["shape"])
            params += count
            stored += count * _SAFETENSORS_BYTES.get(t["dtype"], 4)
    return ModelInfo(name, str(path), arch, params, stored)


def load_model_info(model: str) -> ModelInfo:
    """A catalog name, ``.gguf`` path or HF folder -> its :class:`ModelInfo`.

    Raises:
        ModelNotFoundError: unknown or uninstalled model (the message names the install command).
        InvalidRequestError: an unsupported architecture.
    """
    from kvserve.models.catalog import resolve_model_path

    path = resolve_model_path(model)
    return _gguf_info(model, path) if path.suffix == ".gguf" else _hf_info(model, path)
