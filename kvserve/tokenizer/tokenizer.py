"""Tokenizer: HF tokenizers/transformers behind the few calls the engine makes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve.errors import InvalidRequestError
from kvserve.models.loader import load_hf_tokenizer

# GPT-2's byte-level alphabet: every byte is one printable character in a byte-level BPE vocabulary.
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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
        self._byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        self._added_ids = frozenset(self.backend.get_added_tokens_decoder())
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_path(cls, path: Path) -> Tokenizer:
        return cls(load_hf_tokenizer(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (BOS added when the model's tokenizer config says so).

        Raises:
            InvalidRequestError: the text holds a lone UTF-16 surrogate (no valid text; the server refuses
                such bodies earlier, naming the field).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(f"prompt: not valid Unicode text: a lone UTF-16 surrogate at character "
                                      f"{e.start}", param="prompt") from None
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token contributes to decoded text (cached).

        A byte-level BPE token may hold part of a UTF-8 character (an emoji split over tokens): its bytes are
        read from the vocabulary through the byte <-> unicode table, not decoded (a lone piece decodes to
        U+FFFD). Byte-fallback pieces (``<0xF0>``) give their byte. Other tokens, and added tokens, give
        the UTF-8 of their decoded text. Unknown ids give ``b""``.
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raw = b""
        elif token_id in self._added_ids:
            raw = self.decode([token_id], skip_special_tokens=False).encode()
        elif self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = self.decode([token_id], skip_special_tokens=False).encode()
        self._token_bytes[token_id] = raw
        return raw

    def logprob_token(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or ``bytes:\\xf0\\x9f`` when its bytes are not whole UTF-8
        characters (OpenAI's spelling for such tokens; ``token_bytes`` gives the bytes themselves)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

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
