"""Tiny random-weight models for the tensor-parallel tests, and process-tree helpers.

Both models split at size 2 (4 query heads, 2 KV heads, MLP 128) and have a vocabulary of 515 ids, not a
multiple of 2, so the last rank's vocabulary shard is zero-padded (the padded logits must never be sampled).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 515


def save_tiny(path: Path, arch: str = "qwen2", seed: int = 0, tokenizer_of: str | None = None) -> Path:
    """A random-weight ``qwen2`` (QKV biases, untied head) or ``llama`` (tied embeddings) as an HF folder.

    Args:
        tokenizer_of: a catalog model whose tokenizer is saved with it (its vocabulary size then replaces
            ``VOCAB``), so that text prompts work; None: no tokenizer (prompts must be token ids).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = VOCAB
    if tokenizer_of is not None:
        from kvserve.models.catalog import resolve_model_path
        from kvserve.models.loader import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(resolve_model_path(tokenizer_of))
        tokenizer.save_pretrained(path)
        vocab = len(tokenizer)
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rope_theta=10000.0)
    hf: torch.nn.Module
    if arch == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **shape)).eval()  # type: ignore[arg-type]
        with torch.no_grad():  # random biases (the default init zeroes them, which would not test their split)
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        hf = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **shape)).eval()  # type: ignore[arg-type]
    hf.save_pretrained(path)
    return path


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state.lower()
