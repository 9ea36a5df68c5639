"""A measured speculative-decoding acceptance for ``kvserve plan``: from a running server or a benchmark JSON.

* ``--metrics-url URL``: the server's Prometheus text (``GET URL``, ``/metrics`` appended when the URL has
  no path). ``α = spec_decode_num_accepted_tokens_total / spec_decode_num_draft_tokens_total``, each summed
  over its label sets (one per model name), under the prefix ``kvserve:`` or vLLM's ``vllm:``.
  ``spec_decode_num_drafts_total`` (rounds) and the accepted-by-position counter are read when present:
  mean accepted length ``1 + accepted / rounds`` and ``accepted at position 0 / rounds`` (the chance that
  a round's first draft token is accepted: an estimate of the per-token acceptance).
* ``--bench-json FILE``: the JSON ``benchmarks/spec_decode.py`` writes; its top-level ``acceptance`` holds
  one entry per section (``ngram``, ``draft``, ``load``) with the same counts.

``α`` is vLLM's "draft acceptance rate" (accepted / draft tokens). It is at most the per-token acceptance
of the cost model's i.i.d. formula (a round stops at its first rejection, so later drafts of a round are
never verified and count as not accepted); docs/planner.md says how to read the highlighted row.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError

PREFIXES = ("kvserve:", "vllm:")
BENCH_SECTIONS = ("ngram", "draft", "load")


@dataclass(frozen=True)
class MeasuredAcceptance:
    """Attributes:
        alpha: accepted / draft tokens, in [0, 1].
        source: where it came from (the URL, or the file and section), for the table caption.
        num_drafts: verification rounds with at least one draft token (None: not reported).
        alpha_token: an estimate of the cost model's per-token acceptance (None: not reported): from
            metrics, accepted drafts at position 0 / rounds; from the benchmark, its geometric estimate
            accepted / (accepted + rounds that ended at a rejection).
    """

    alpha: float
    num_accepted_tokens: float
    num_draft_tokens: float
    source: str
    num_drafts: float | None = None
    alpha_token: float | None = None

    @property
    def mean_accepted_len(self) -> float | None:
        """Tokens emitted per round: 1 + accepted / rounds (None without the rounds)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_accepted_len": self.mean_accepted_len}


def _make(accepted: float, draft: float, source: str, param: str, num_drafts: float | None = None,
          first_pos: float | None = None) -> MeasuredAcceptance:
    if draft <= 0:
        raise InvalidRequestError(f"{source}: no draft tokens verified yet (speculative decoding off, or no "
                                  "request has decoded with it): no acceptance to show", param=param)
    if not 0 <= accepted <= draft:
        raise InvalidRequestError(f"{source}: {accepted:g} accepted of {draft:g} draft tokens is not a valid count",
                                  param=param)
    first = first_pos / num_drafts if first_pos is not None and num_drafts else None
    return MeasuredAcceptance(accepted / draft, accepted, draft, source, num_drafts, first)


def _sample_totals(text: str) -> dict[tuple[str, str | None], float]:
    """Prometheus text -> sum of sample values per (sample name, ``position`` label or None)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("position"))
            totals[key] = totals.get(key, 0.0) + float(s.value)
    return totals


def acceptance_from_metrics_text(text: str, source: str = "metrics") -> MeasuredAcceptance:
    """The acceptance in a ``/metrics`` exposition (``kvserve:`` or ``vllm:`` names; the first found wins).

    Raises:
        InvalidRequestError: unparsable text, no spec-decode counters, or no draft tokens yet.
    """
    try:
        totals = _sample_totals(text)
    except ValueError as e:
        raise InvalidRequestError(f"{source}: not Prometheus text ({e})", param="metrics_url") from e
    for prefix in PREFIXES:
        accepted = totals.get((f"{prefix}spec_decode_num_accepted_tokens_total", None))
        draft = totals.get((f"{prefix}spec_decode_num_draft_tokens_total", None))
        if accepted is None or draft is None:
            continue
        drafts = totals.get((f"{prefix}spec_decode_num_drafts_total", None))
        first = totals.get((f"{prefix}spec_decode_num_accepted_tokens_per_pos_total", "0"))
        return _make(accepted, draft, source, "metrics_url", drafts, first)
    raise InvalidRequestError(
        f"{source}: no spec_decode_num_accepted_tokens_total / spec_decode_num_draft_tokens_total counters "
        f"(prefix {' or '.join(PREFIXES)}); is the server running with --speculative-config?", param="metrics_url")


def metrics_url(url: str) -> str:
    """``URL`` as given, or with ``/metrics`` when it has no path (``http://host:8000`` -> ``.../metrics``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidRequestError(f"--metrics-url: {url!r} is not an http(s) URL", param="metrics_url")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def fetch_metrics_text(url: str, timeout: float = 10.0) -> str:
    """``GET`` the metrics text.

    Raises:
        InvalidRequestError: not an http(s) URL, the server cannot be reached, or it answers with an error.
    """
    full = metrics_url(url)
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:  # noqa: S310 - http(s) only, checked above
            return str(resp.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        raise InvalidRequestError(f"--metrics-url: cannot read {full}: {e}", param="metrics_url") from e


def acceptance_from_metrics_url(url: str, timeout: float = 10.0) -> MeasuredAcceptance:
    """Fetch ``url`` (see :func:`metrics_url`) and read the acceptance from it."""
    return acceptance_from_metrics_text(fetch_metrics_text(url, timeout), metrics_url(url))


def acceptance_from_bench_json(path: str | Path, section: str | None = None) -> MeasuredAcceptance:
    """The acceptance ``benchmarks/spec_decode.py`` recorded for ``section`` (default: the first of ngram,
    draft, load that the file has).

    Raises:
        InvalidRequestError: unreadable or not JSON, no ``acceptance`` record, or not for that section.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"--bench-json: cannot read {p}: {e}", param="bench_json") from e
    acc = data.get("acceptance") if isinstance(data, dict) else None
    if not isinstance(acc, dict) or not acc:
        raise InvalidRequestError(f"--bench-json: {p} has no acceptance record (written by "
                                  "benchmarks/spec_decode.py after a section with drafts)", param="bench_json")
    if section is None:
        section = next((s for s in BENCH_SECTIONS if s in acc), next(iter(acc)))
    entry = acc.get(section)
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"--bench-json: {p} has no acceptance for section {section!r} (it has: "
                                  f"{', '.join(acc)})", param="bench_json")
    try:
        accepted, draft = float(entry["num_accepted_tokens"]), float(entry["num_draft_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequestError(f"--bench-json: {p} acceptance[{section!r}] lacks the token counts",
                                  param="bench_json") from e
    drafts = entry.get("num_drafts")
    variants = entry.get("variants") or []
    where = f"{p.name}, {section}" + (f" ({', '.join(variants)})" if variants else "")
    m = _make(accepted, draft, where, "bench_json", float(drafts) if drafts else None)
    return MeasuredAcceptance(m.alpha, m.num_accepted_tokens, m.num_draft_tokens, m.source, m.num_drafts,
                              entry.get("alpha_token"))
