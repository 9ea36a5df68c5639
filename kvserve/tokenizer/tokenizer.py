"""Tokenizer: HF tokenizers/transformers behind the few calls the engine makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.models.loader import load_hf_tokenizer


class Tokenizer:
    """Encode, decode and chat templates of one model.

    Args:
        hf_tokenizer: a transformers fast tokenizer (``backend_tokenizer`` is a ``tokenizers.Tokenizer``).
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_path(cls, path: Path) -> Tokenizer:
        return cls(load_hf_tokenizer(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (BOS added when the model's tokenizer config says so)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages -> prompt token ids through the model's own template.

        ``tools``: OpenAI-shaped tool definitions, rendered by templates that support them (Qwen2.5's, Hermes').

        ``continue_final_message``: end the prompt inside the last (assistant) message, so that the model
        continues it instead of starting a new turn (transformers' option of the same name).

        Raises:
            InvalidRequestError: no messages, a message without ``role``/``content``, or no template.
        """
        if not messages:
            raise InvalidRequestError("messages: must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}]: needs a 'role' and a string 'content'", param="messages")
        if not self.hf.chat_template:
            raise InvalidRequestError("messages: this model has no chat template", param="messages")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools)
        # The template already writes any BOS it wants.
        return self.encode(text, add_special_tokens=False)
