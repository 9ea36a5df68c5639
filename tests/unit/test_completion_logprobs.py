"""Completions logprobs: text_offset from token bytes (split characters, skipped special tokens, a stop
string's cut), and streamed chunks that add up to the non-streamed object whatever the text held back."""

from __future__ import annotations

from typing import Any

from kvserve.core.scheduler_output import TokenLogprobs
from kvserve.entrypoints.openai.completion_logprobs import CompletionLogprobs
from kvserve.entrypoints.openai.json_body import parse_json_object
from kvserve.errors import InvalidRequestError

# id -> bytes: "Hi", " " + first two bytes of U+1F30A (wave), its last two bytes, "!", an EOS-like special.
PIECES = {1: b"Hi", 2: b" \xf0\x9f", 3: b"\x8c\x8a", 4: b"!", 5: b"<eos>"}


class _Source:
    def token_text(self, token_id: int) -> str:
        raw = PIECES[token_id]
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> bytes:
        return PIECES[token_id]


def _lps(ids: list[int]) -> list[TokenLogprobs | None]:
    return [TokenLogprobs(t, -0.5 * (i + 1), 1, [(t, -0.5 * (i + 1))]) for i, t in enumerate(ids)]


def _merge(chunks: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for key in out:
            out[key] += (ch or {}).get(key, [])
    return out


def test_offsets_follow_bytes_not_display_strings() -> None:
    text = "Hi \U0001f30a!"
    whole = CompletionLogprobs(_Source(), "", None, frozenset({5})).update(_lps([1, 2, 3, 4, 5]), None, len(text),
                                                                           True)
    assert whole is not None
    assert whole["tokens"] == ["Hi", "bytes:\\x20\\xf0\\x9f", "bytes:\\x8c\\x8a", "!", "<eos>"]
    # " \xf0\x9f" starts at the space (2); "\x8c\x8a" continues the wave, at 3; "!" at 4; EOS takes no room.
    assert whole["text_offset"] == [0, 2, 3, 4, 5]
    assert b"".join(PIECES[t] for t in [1, 2, 3, 4]).decode() == text


def test_stream_holds_entries_back_until_their_text_was_sent() -> None:
    ids = [1, 2, 3, 4]
    final_text = "Hi \U0001f30a"  # a stop string "!" cut the text after its token came
    whole = CompletionLogprobs(_Source(), "", None, frozenset()).update(_lps(ids), None, len(final_text), True)
    assert whole is not None and whole["text_offset"] == [0, 2, 3, 4]  # "!" clamped to the text's end
    stream = CompletionLogprobs(_Source(), "", None, frozenset())
    # The detokenizer held text back: "Hi" sent after two tokens, nothing more until the end.
    chunks = [stream.update(_lps(ids[:2]), None, 2, False), stream.update(_lps(ids[:3]), None, 2, False),
              stream.update(_lps(ids), None, len(final_text), True)]
    assert chunks[0] is not None and chunks[0]["tokens"] == ["Hi", "bytes:\\x20\\xf0\\x9f"]
    assert chunks[1] is None  # "\x8c\x8a" starts at 3 > 2 characters sent
    assert _merge(chunks) == whole


def test_echo_puts_the_prompt_first_with_a_null_first_logprob() -> None:
    from kvserve.outputs import Logprob

    prompt_lps = [None, {4: Logprob(-1.0, 3, None), 1: Logprob(-0.1, 1, None)}]
    text = "Hi! \U0001f30a"  # echo "Hi!" (tokens 1, 4), then the output " \U0001f30a" (tokens 2, 3)
    out = CompletionLogprobs(_Source(), "Hi!", [1, 4], frozenset()).update(_lps([2, 3]), prompt_lps, len(text), True)
    assert out is not None
    assert out["tokens"] == ["Hi", "!", "bytes:\\x20\\xf0\\x9f", "bytes:\\x8c\\x8a"]
    assert out["token_logprobs"] == [None, -1.0, -0.5, -1.0] and out["top_logprobs"][0] is None
    assert out["top_logprobs"][1] == {"Hi": -0.1, "!": -1.0}
    assert out["text_offset"] == [0, 2, 3, 4]


def test_json_body_depth_and_surrogates() -> None:
    assert parse_json_object('{"a": [[1]], "b": "\\ud83d\\ude00"}') == {"a": [[1]], "b": "\U0001f600"}
    for text, param in (('{"p": ' + "[" * 129 + "]" * 129 + "}", "p"), ("[" * 5000 + "]" * 5000, None),
                        ('{"m": [{"c": "x\\ud800"}]}', "m[0].c"), ('{"k\\udc00": 1}', None)):
        try:
            parse_json_object(text)
        except InvalidRequestError as e:
            assert e.param == param, (text[:20], e.param)
        else:
            raise AssertionError(f"accepted {text[:30]!r}")
