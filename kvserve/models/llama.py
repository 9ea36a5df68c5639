"""Llama-family decoder (Llama, Qwen2): GQA, RoPE, RMSNorm, SwiGLU, optional QKV bias, tied or untied head.

Written against kvserve's paged attention: a forward pass takes the flat tokens of a whole step
(``[num_tokens]``, many requests) and the KV cache, not padded batches.
Reference: Touvron et al. 2023 (Llama 2); HF transformers' modeling_llama.py / modeling_qwen2.py for the
exact numerics we must reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers import cpu_kernels, onednn
from kvserve.layers.attention import AttentionMetadata, paged_attention, write_kv
from kvserve.layers.gguf_blocks import GGUFTensor, block_format
from kvserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from kvserve.layers.int8 import Int8Linear
from kvserve.layers.kv_quant import format_code, is_kv8
from kvserve.layers.layernorm import RMSNorm
from kvserve.layers.linear import Linear, small_m_max, use_native
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.vocab_parallel import VocabParallelEmbedding
from kvserve.models.registry import ModelArchConfig
from kvserve.models.tp_shard import vocab_shard_size

if TYPE_CHECKING:
    from kvserve.distributed.tp_group import TPGroup


class Attention(nn.Module):
    """Self-attention over the paged KV cache. Under tensor parallelism ``cfg`` is this rank's shard
    (``tp_shard.shard_arch``: its query and KV heads), and ``o_proj``'s partial sums are all-reduced."""

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k, v fused into one matmul: [q_size + 2 * kv_size, hidden]
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        if use_native(qkv) and kv_cache[0].dtype in (torch.float32, torch.bfloat16):
            # One call: RoPE on q and k in place, k and v into their cache slots (converted where the dtypes differ).
            cpu_kernels.rope_write_kv(qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache[0], kv_cache[1],
                                      meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        elif use_native(qkv) and is_kv8(kv_cache[0].dtype):
            # The same into an 8-bit cache: k and v quantized as ``kv_quant.write_kv8`` does, bit for bit.
            cpu_kernels.rope_write_kv8(qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache[0], kv_cache[1],
                                       meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, q, k)
            write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = self.o_proj(paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale))
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel: sum the ranks' partial sums


@cache
def _vector_silu(dtype: torch.dtype) -> bool:
    """The native silu_mul is vectorised for ``dtype`` activations: faster than torch's silu + mul at any size.

    AVX-512 builds: both dtypes (its own exp). AVX2 builds: float32 only (libmvec's 8-lane expf). Zen 3, 2 threads,
    float32 [rows, 2 x 1,536]: native 1.61 / 0.24 ms vs torch 2.54 / 0.61 ms at 2,048 / 512 rows (max difference
    1e-6). AVX2's bfloat16 rows (``silu_mul_row8``: its own exp and the bf16 roundings) serve decode, but at
    prefill sizes torch's SiLU is faster: 3.32 vs 3.09 ms at 2,048 rows, 0.79 vs 0.71 ms at 512 (best of 15)."""
    if not cpu_kernels.native_available():
        return False
    features = cpu_kernels.gemm_features()
    return "avx512" in features or (dtype == torch.float32 and "avx2_panel" in features)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (prefill in bfloat16 on
    CPU: two oneDNN GEMMs with SiLU and the product in their epilogues, ``onednn.swiglu``). Under tensor
    parallelism ``cfg.intermediate_size`` is this rank's slice, and ``down_proj``'s partial sums are
    all-reduced."""

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fuse_swiglu = True  # tests switch it off to compare with the reference path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        if (self.fuse_swiglu and isinstance(proj, Linear) and x.shape[0] > small_m_max(x.dtype)
                and onednn.available(x, proj.weight)):
            w = proj.weight
            i, packed = w.shape[0] // 2, proj.onednn_weights  # [gate rows; up rows]
            out = self.down_proj(onednn.swiglu(x, packed.get("gate", w[:i]), packed.get("up", w[i:])))
            return out if self.tp is None else self.tp.all_reduce(out)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if use_native(gate_up) and (gate_up.shape[0] <= small_m_max(gate_up.dtype) or _vector_silu(gate_up.dtype)):
            # One call instead of three ops. Where the kernel's loop is scalar (bf16 without AVX-512), prefill-sized
            # inputs take torch's vectorized SiLU (5x faster at 2,048 bf16 rows), which computes the same values.
            out = self.down_proj(cpu_kernels.silu_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with ``residual`` None); residual: the
        running sum of the residual stream so far. Returns ``(mlp_out, residual)``: the layer's output is
        their sum, which the next norm takes fused (the same additions, in the same order, as
        ``x = x + attn(norm(x)); x = x + mlp(norm(x))``)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns hidden states; ``compute_logits`` applies the LM head only to
    the rows that sample (logits for every prompt token would cost a fifth of SmolLM2's FLOPs).

    Tensor parallelism (``tp`` given): ``cfg`` is this rank's shard (``tp_shard.shard_arch``), the embedding
    and the LM head hold this rank's rows of the vocabulary, and every rank runs ``forward`` on the same inputs
    (its collectives pair with the other ranks').
    """

    def __init__(self, cfg: ModelArchConfig, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens: nn.Embedding | GGUFEmbedding = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head_rows = cfg.vocab_size if tp is None else vocab_shard_size(cfg.vocab_size, tp.size)
        self.lm_head: Linear | Int8Linear | GGUFLinear = Linear(cfg.hidden_size, head_rows, bias=False)
        # Whole decode steps in one native call where possible (see ``_can_fuse_decode``); tests switch it
        # off to compare with the per-layer path.
        self.fuse_decode = True
        self._layer_ptrs: tuple[tuple[int, int], cpu_kernels.DecodeStepArgs] | None = None
        self._weight_fmt_cache: tuple[int | None] | None = None
        self._layer_keepalive: list[torch.Tensor] = []
        if cfg.tie_word_embeddings:
            cast(Linear, self.lm_head).weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions ``[num_tokens]`` -> hidden states ``[num_tokens, hidden_size]``."""
        x = self.embed_tokens(input_ids).to(self.compute_dtype)  # (a no-op unless weights are narrower)
        if self._can_fuse_decode(x, kv_caches, meta):
            return self._fused_decode(x, positions, kv_caches, meta)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)

    def _can_fuse_decode(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                         meta: AttentionMetadata) -> bool:
        """A pure-decode CPU step (float32 or bfloat16 activations over a cache of the same dtype, or over an
        8-bit cache whose native decode variant is built), small enough for the small-M kernels:
        ``decode_step.c`` runs it whole (the per-layer path below is its reference, bitwise)."""
        kv_dtype = kv_caches[0][0].dtype
        emb = self.embed_tokens
        return (meta.native_decode is not None and meta.num_decode_tokens == x.shape[0] <= small_m_max(x.dtype)
                and not meta.prefill_groups and meta.native_prefill is None and use_native(x)
                and self._decode_fusable(x.dtype, kv_dtype)
                and (isinstance(emb, GGUFEmbedding) or emb.weight.dtype in (torch.float32, torch.bfloat16)))

    def _decode_fusable(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """``decode_step.c`` can run this model with ``dtype`` activations over a ``kv_dtype`` cache: a cache of the
        same dtype, a bfloat16 one under float32 activations, or an 8-bit one whose native variant is built; one
        weight format for every projection, the fused decode switched on, no tensor parallelism."""
        return ((kv_dtype == dtype or (dtype, kv_dtype) == (torch.float32, torch.bfloat16)
                 or (is_kv8(kv_dtype) and "decode" in cpu_kernels.kv8_features()))
                and self.fuse_decode and self._weight_fmt() is not None and self.tp is None)

    def native_greedy_decode_ok(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether ``worker/greedy_decode.py`` may run this model's decode steps: ``_can_fuse_decode``'s conditions
        that do not depend on the step, plus a float32 / bfloat16 embedding table the activations equal or
        widen exactly, and a plain float32 / bfloat16 LM head (which ``Linear`` sends to ``small_gemm``)."""
        dtype, kv_dtype = self.compute_dtype, kv_caches[0][0].dtype
        emb, head = self.embed_tokens, self.lm_head
        return (dtype in (torch.float32, torch.bfloat16) and kv_caches[0][0].device.type == "cpu"
                and cpu_kernels.native_available() and self._decode_fusable(dtype, kv_dtype)
                and type(emb) is nn.Embedding and emb.weight.device.type == "cpu"
                and (emb.weight.dtype == dtype or (emb.weight.dtype, dtype) == (torch.bfloat16, torch.float32))
                and type(head) is Linear and head.bias is None and head.weight.dtype in (torch.float32, torch.bfloat16)
                and head.weight.is_contiguous() and emb.weight.is_contiguous())

    def _fused_decode(self, x: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        assert meta.native_decode is not None
        block_tables, seq_lens = meta.native_decode
        args = self.decode_step_args(kv_caches)
        return cpu_kernels.decode_step(
            x.contiguous(), args.layer_ptrs, self.norm.weight, positions, meta.slot_mapping, block_tables,
            seq_lens, args.block_size, self.rotary.cos, self.rotary.sin, args.num_heads, args.num_kv_heads,
            args.head_dim, args.intermediate_size, args.eps, args.scale, args.weight_fmt, args.kv_fmt)

    def decode_step_args(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> cpu_kernels.DecodeStepArgs:
        """What ``decode_step.c`` needs of this model and its KV cache (the per-layer weight and cache addresses),
        made once per cache and kept. Only meaningful where ``_can_fuse_decode`` holds (a float, int8 or GGUF
        weight format shared by every projection)."""
        key = (kv_caches[0][0].data_ptr(), len(kv_caches))
        if self._layer_ptrs is None or self._layer_ptrs[0] != key:
            rows = []
            biases: list[torch.Tensor] = []  # float32 copies the pointers refer to, kept alive below
            layers = cast(list[DecoderLayer], list(self.layers))
            for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                bias: torch.Tensor | None = attn.qkv_proj.bias
                if bias is not None:  # the kernel takes float32 biases (as Linear passes them)
                    bias = bias.detach().float()
                    biases.append(bias)
                rows.append([layer.input_layernorm.weight.data_ptr(), _weight_ptr(attn.qkv_proj),
                             0 if bias is None else bias.data_ptr(), _weight_ptr(attn.o_proj),
                             layer.post_attention_layernorm.weight.data_ptr(), _weight_ptr(mlp.gate_up_proj),
                             _weight_ptr(mlp.down_proj), k_cache.data_ptr(), v_cache.data_ptr()])
            cfg, cache = self.config, kv_caches[0][0]
            args = cpu_kernels.DecodeStepArgs(
                torch.tensor(rows, dtype=torch.int64), self.norm.weight, self.rotary.cos, self.rotary.sin,
                cache.shape[1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.rms_norm_eps, cast(DecoderLayer, self.layers[0]).self_attn.scale,
                cast(int, self._weight_fmt()), format_code(cache))
            self._layer_ptrs = (key, args)
            self._layer_keepalive = biases
        return self._layer_ptrs[1]

    def _weight_fmt(self) -> int | None:
        """decode_step's weight code of the decoder layers' projections: 0 float32, 1 bfloat16, 2 int8, 3 GGUF
        blocks; None when they differ (a GGUF file with some projections in float: the per-layer path runs).
        Computed once (a Python walk over every layer's modules, which ran twice per decode step);
        ``use_int8_weights``, ``use_gguf_weights`` and ``load_weights`` forget it."""
        if self._weight_fmt_cache is None:
            self._weight_fmt_cache = (self._compute_weight_fmt(),)
        return self._weight_fmt_cache[0]

    def _compute_weight_fmt(self) -> int | None:
        codes = set()
        for layer in cast(list[DecoderLayer], list(self.layers)):
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if isinstance(lin, Int8Linear):
                    codes.add(cpu_kernels.WEIGHT_FMT_INT8)
                elif isinstance(lin, GGUFLinear):
                    codes.add(cpu_kernels.WEIGHT_FMT_GGUF)
                else:
                    codes.add(int(cast(nn.Linear, lin).weight.dtype == torch.bfloat16))
        return codes.pop() if len(codes) == 1 else None

    def use_int8_weights(self, lm_head: bool = True) -> None:
        """``--quantization int8``: replace every projection of the decoder layers (and the LM head, unless
        ``lm_head`` is False) by an ``Int8Linear``, before the weights are loaded (``load_weights`` then
        quantizes each float tensor as it arrives). Call on the meta device, so that no float storage is
        ever allocated for them. A tied LM head stops sharing the embedding: the table keeps the model
        dtype for lookups; the head holds its own int8 copy."""
        self._weight_fmt_cache = None
        self._layer_ptrs = None  # (the weights the pointers referred to changed)
        targets: list[tuple[nn.Module, str]] = [(self, "lm_head")] if lm_head else []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            targets += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                        (layer.mlp, "down_proj")]
        for parent, name in targets:
            old = getattr(parent, name)
            assert isinstance(old, nn.Linear)
            setattr(parent, name, Int8Linear(old.in_features, old.out_features, bias=old.bias is not None))

    def use_gguf_weights(self, weights: Mapping[str, torch.Tensor | GGUFTensor]) -> None:
        """``--quantization gguf``: every projection, the embedding table and the LM head whose tensors ``weights``
        (``loader.load_gguf_blocks``) holds as GGUF blocks become ``GGUFLinear`` / ``GGUFEmbedding`` sized for those
        blocks (a fused projection gets one segment per part, each in its own format); float tensors keep their
        float modules. Call on the meta device, before ``load_weights``.

        Raises:
            ValueError: a tensor missing, a format the kernels do not serve, or a fused projection mixing float
                and quantized parts.
        """
        self._weight_fmt_cache = None
        self._layer_ptrs = None  # (the weights the pointers referred to changed)
        cfg = self.config

        def parts(names: list[str]) -> list[GGUFTensor] | None:
            missing = [n for n in names if n not in weights]
            if missing:
                raise ValueError(f"weight {missing[0]} missing from the checkpoint")
            got = [weights[n] for n in names]
            blocks = [t for t in got if isinstance(t, GGUFTensor)]
            if blocks and len(blocks) != len(got):
                raise ValueError(f"quantization: gguf cannot fuse {', '.join(names)}: some are float, some blocks")
            for name, t in zip(names, blocks, strict=False):
                fmt = block_format(t.code, name)  # raises for a format the kernels do not serve
                if t.cols % fmt.elems:
                    raise ValueError(f"quantization: {name} has {t.cols} columns, not a multiple of "
                                     f"{fmt.name}'s {fmt.elems}")
            return blocks or None

        targets: list[tuple[nn.Module, str, list[str]]] = []
        for i, layer in enumerate(cast(list[DecoderLayer], list(self.layers))):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            targets += [(layer.self_attn, "qkv_proj", [a + f"{n}_proj.weight" for n in "qkv"]),
                        (layer.self_attn, "o_proj", [a + "o_proj.weight"]),
                        (layer.mlp, "gate_up_proj", [m + "gate_proj.weight", m + "up_proj.weight"]),
                        (layer.mlp, "down_proj", [m + "down_proj.weight"])]
        emb = parts(["model.embed_tokens.weight"])
        if emb:
            self.embed_tokens = GGUFEmbedding(cfg.vocab_size, cfg.hidden_size, emb[0].code)
        if not cfg.tie_word_embeddings:
            targets.append((self, "lm_head", ["lm_head.weight"]))
        elif emb:  # a tied head: the table's blocks, shared (``load_weights`` ties the buffers)
            self.lm_head = GGUFLinear(cfg.hidden_size, [(emb[0].code, cfg.vocab_size)], bias=False)
        for parent, name, names in targets:
            blocks = parts(names)
            if blocks:
                old = getattr(parent, name)
                setattr(parent, name, GGUFLinear(old.in_features, [(t.code, t.rows) for t in blocks],
                                                 bias=old.bias is not None))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'); linear and embedding weights may be narrower (bf16)."""
        return self.norm.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> float32 logits ``[num_rows, vocab_size]``.

        Under tensor parallelism a collective (every rank calls it with the same rows): rank 0 gets the whole
        vocabulary's logits gathered from the ranks' shards; another rank gets its own shard's logits
        ``[num_rows, vocab_shard]`` (which no caller reads: only rank 0 samples).
        """
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        full = self.tp.gather_to_driver(logits)
        if full is None:
            return logits
        vocab = self.config.vocab_size
        return full if full.shape[-1] == vocab else full[:, :vocab].contiguous()  # (drop the padding rows)

    def load_weights(self, weights: Mapping[str, torch.Tensor | GGUFTensor]) -> None:
        """Load HF-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...), fusing q/k/v and gate/up.
        GGUF blocks (``GGUFTensor``) go to the GGUF modules ``use_gguf_weights`` made for them.

        Raises:
            ValueError: a tensor is missing or has the wrong shape or format.
        """
        self._weight_fmt_cache = None
        self._layer_ptrs = None  # (the weights the pointers referred to changed)
        cfg = self.config
        params = dict(self.named_parameters())

        def take(name: str) -> torch.Tensor | GGUFTensor:
            if name not in weights:
                raise ValueError(f"weight {name} missing from the checkpoint")
            return weights[name]

        def float_tensor(name: str) -> torch.Tensor:
            t = take(name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"weight {name} is kept as GGUF blocks: load it with --quantization gguf")
            return t

        def put(name: str, value: torch.Tensor) -> None:
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, Int8Linear) and leaf == "weight":
                module.load_weight(value)  # quantized from the checkpoint's float tensor
                return
            p = params[name]
            if p.shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(p.shape)}, got {tuple(value.shape)}")
            with torch.no_grad():
                p.copy_(value)

        def put_linear(dst: str, sources: list[str]) -> None:
            """A (fused) projection's weight from its parts: GGUF segments, or float rows concatenated."""
            module = self.get_submodule(dst)
            if isinstance(module, GGUFLinear):
                module.load_segments([cast(GGUFTensor, take(n)) for n in sources])
            else:
                put(dst + ".weight", torch.cat([float_tensor(n) for n in sources], dim=0))

        if isinstance(self.embed_tokens, GGUFEmbedding):
            self.embed_tokens.load(cast(GGUFTensor, take("model.embed_tokens.weight")))
        else:
            put("embed_tokens.weight", float_tensor("model.embed_tokens.weight"))
        put("norm.weight", float_tensor("model.norm.weight"))
        if cfg.tie_word_embeddings and isinstance(self.lm_head, GGUFLinear):
            assert isinstance(self.embed_tokens, GGUFEmbedding)
            self.lm_head.tie_to(self.embed_tokens)  # one buffer for lookups and the head
        elif not cfg.tie_word_embeddings or isinstance(self.lm_head, Int8Linear):
            # (a tied head under int8: its own codes, quantized from the embedding's float32 tensor)
            put_linear("lm_head", ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
        for i in range(cfg.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(dst + "input_layernorm.weight", float_tensor(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", float_tensor(src + "post_attention_layernorm.weight"))
            put_linear(dst + "self_attn.qkv_proj", [attn + f"{n}_proj.weight" for n in "qkv"])
            if cfg.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat([float_tensor(attn + f"{n}_proj.bias") for n in "qkv"]))
            put_linear(dst + "self_attn.o_proj", [attn + "o_proj.weight"])
            mlp = src + "mlp."
            put_linear(dst + "mlp.gate_up_proj", [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            put_linear(dst + "mlp.down_proj", [mlp + "down_proj.weight"])


def _weight_ptr(linear: nn.Module) -> int:
    """The address decode_step.c reads a projection's weight from (an int8 linear's packed buffer, a GGUF linear's
    segment table, which the module keeps alive)."""
    if isinstance(linear, Int8Linear):
        return int(linear.packed.data_ptr())
    if isinstance(linear, GGUFLinear):
        return int(linear.segment_table().data_ptr())
    return int(cast(nn.Linear, linear).weight.data_ptr())


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with a bias on q/k/v (``attention_bias``) and, for most sizes, an untied head."""


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
