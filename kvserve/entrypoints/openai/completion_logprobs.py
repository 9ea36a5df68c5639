"""The ``logprobs`` object of one completions choice (OpenAI's legacy shape), streamed or whole.

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}

With ``echo`` the prompt's tokens come first: the first has ``null`` logprobs (nothing predicts it), the
others their prompt logprobs. ``text_offset`` is the character index in the choice's text (echo included)
where each token starts, computed from the tokens' *bytes*, never from their display strings: a token that
holds part of a character (an emoji split over two tokens, shown as ``bytes:\\xf0\\x9f``) starts at that
character, special tokens the text leaves out take no room, and offsets are clamped to the final text (a
stop string cuts the text after its tokens were generated). Offsets are thus a function of the tokens
alone; a stream holds back an entry until the text up to its offset was sent, so the streamed entries
equal the non-streamed ones whatever a stop string holds back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvserve.core.scheduler_output import TokenLogprobs
from kvserve.entrypoints.openai.serving import finite_logprob
from kvserve.outputs import PromptLogprobs


class _TokenSource(Protocol):
    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class _CharCounter:
    """Characters spanned by a growing byte string: one per UTF-8 lead byte (anything but ``0b10xxxxxx``)."""

    def __init__(self) -> None:
        self.chars = 0

    def start_of(self, piece: bytes) -> int:
        """The index of the character ``piece``'s first byte belongs to; then ``piece`` is appended."""
        start = self.chars - (1 if piece and 0x80 <= piece[0] < 0xC0 and self.chars else 0)
        self.chars += sum(1 for b in piece if not 0x80 <= b < 0xC0)
        return start


class CompletionLogprobs:
    """Builds one choice's logprobs, a chunk at a time.

    Args:
        source: token strings and bytes (the server context).
        echo: the echoed prompt text ("" without echo).
        prompt_ids: the prompt's token ids when echo shows its logprobs, else None.
        zero_width: token ids the text leaves out (special tokens, when skipped).
    """

    def __init__(self, source: _TokenSource, echo: str, prompt_ids: Sequence[int] | None,
                 zero_width: frozenset[int]) -> None:
        self._source = source
        self._echo_len = len(echo)
        self._prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self._zero_width = zero_width
        self._output = _CharCounter()
        self._num_output = 0
        # Entries not sent yet: (token id, logprob or None, top [(id, logprob)] or None, offset).
        self._pending: list[tuple[int, float | None, list[tuple[int, float]] | None, int]] = []

    def update(self, logprobs: Sequence[TokenLogprobs | None] | None, prompt_logprobs: PromptLogprobs | None,
               visible_len: int, finished: bool) -> dict[str, Any] | None:
        """The logprobs object of the entries that can be sent now, or None when there are none.

        Args:
            logprobs: the choice's output logprobs so far (cumulative).
            prompt_logprobs: the request's prompt logprobs (read once, with echo).
            visible_len: characters of the choice's text sent so far, echo included (the whole text once
                finished).
            finished: the choice is done: every entry goes out, offsets clamped to ``visible_len``.
        """
        if self._prompt_ids is not None:
            self._queue_prompt(self._prompt_ids, prompt_logprobs)
            self._prompt_ids = None
        for lp in (logprobs or [])[self._num_output:]:
            if lp is not None:
                piece = b"" if lp.token_id in self._zero_width else self._source.token_bytes(lp.token_id)
                offset = self._echo_len + self._output.start_of(piece)
                self._pending.append((lp.token_id, lp.logprob, list(lp.top), offset))
        self._num_output = len(logprobs or [])
        ready = len(self._pending) if finished else next(
            (i for i, e in enumerate(self._pending) if e[3] > visible_len), len(self._pending))
        if ready == 0:
            return None
        entries, self._pending = self._pending[:ready], self._pending[ready:]
        text = self._source.token_text
        return {
            "tokens": [text(t) for t, _, _, _ in entries],
            "token_logprobs": [None if lp is None else finite_logprob(lp) for _, lp, _, _ in entries],
            "top_logprobs": [None if lp is None else {**{text(i): finite_logprob(v) for i, v in top or []},
                                                      text(t): finite_logprob(lp)} for t, lp, top, _ in entries],
            "text_offset": [min(offset, visible_len) for _, _, _, offset in entries],
        }

    def _queue_prompt(self, prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None) -> None:
        counter = _CharCounter()
        for i, token_id in enumerate(prompt_ids):
            piece = b"" if token_id in self._zero_width else self._source.token_bytes(token_id)
            offset = min(counter.start_of(piece), self._echo_len)
            row = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
            if row is None or token_id not in row:
                self._pending.append((token_id, None, None, offset))
                continue
            top = [(t, lp.logprob) for t, lp in row.items() if t != token_id]
            self._pending.append((token_id, row[token_id].logprob, top, offset))


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]``."""
    if prompt_logprobs is None:
        return None
    return [None if row is None else {
        str(t): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in row.items()} for row in prompt_logprobs]
