"""Measurements for ``kvserve plan``, from a running server or a benchmark JSON: the speculative-decoding
acceptance and the prefill/decode KV transfer bandwidth. One source may hold either or both; a source lacking
one leaves that part unmeasured (:func:`from_metrics_url`, :func:`from_bench_json`).

* ``--metrics-url URL``: the server's Prometheus text (``GET URL``, ``/metrics`` appended when the URL has
  no path). ``α = spec_decode_num_accepted_tokens_total / spec_decode_num_draft_tokens_total``, each summed
  over its label sets (one per model name), under the prefix ``kvserve:`` or vLLM's ``vllm:``.
  ``spec_decode_num_drafts_total`` (rounds) and the accepted-by-position counter are read when present:
  mean accepted length ``1 + accepted / rounds`` and ``accepted at position 0 / rounds`` (the chance that
  a round's first draft token is accepted: an estimate of the per-token acceptance).
* ``--bench-json FILE``: the JSON ``benchmarks/spec_decode.py`` writes; its top-level ``acceptance`` holds
  one entry per section (``ngram``, ``draft``, ``load``) with the same counts.

KV transfer bandwidth (bytes/s; a decode instance's metrics): ``kv_transfer_bytes_received_total /
kv_transfer_seconds_sum`` (each pull timed from asking the prefill instance to having its blocks), only when
``kv_transfer_seconds_count > 0``; from ``benchmarks/disagg.py``'s JSON, its top-level ``kv_transfer`` record
(``kv_transfer_bandwidth_bytes_per_s`` over every workload, and one entry per workload under ``workloads``).

``α`` is vLLM's "draft acceptance rate" (accepted / draft tokens). It is at most the per-token acceptance
of the cost model's i.i.d. formula (a round stops at its first rejection, so later drafts of a round are
never verified and count as not accepted); docs/planner.md says how to read the highlighted row.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidRequestError

PREFIXES = ("kvserve:", "vllm:")
BENCH_SECTIONS = ("ngram", "draft", "load")
TRANSFER_SECTIONS = ("itl", "mixed")  # the workloads of benchmarks/disagg.py


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


@dataclass(frozen=True)
class MeasuredTransfer:
    """A measured prefill -> decode KV transfer speed (what one prompt's pull achieved, on average).

    Attributes:
        bandwidth_bytes_per_s: ``bytes_received / transfer_seconds`` (bytes/s).
        bytes_received: KV bytes the decode instance pulled (bytes).
        transfer_seconds: the pulls' durations summed (s), each from asking the prefill instance to having
            its blocks: pulls that overlap each count whole, so this is the speed one pull sees, which is
            what the PD interconnect check needs (a prompt's transfer time), not the link's aggregate.
        num_transfers: pulls timed (``kv_transfer_seconds_count``; None: not recorded).
        source: where it came from (the URL, or the file and section), for the go/no-go reason.
    """

    bandwidth_bytes_per_s: float
    bytes_received: float | None
    transfer_seconds: float | None
    num_transfers: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measurements:
    """What one ``--metrics-url`` / ``--bench-json`` source measured; ``None``: that part is unmeasured, and
    ``notes`` says why (one line per unmeasured part)."""

    acceptance: MeasuredAcceptance | None = None
    transfer: MeasuredTransfer | None = None
    notes: tuple[str, ...] = ()


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


def _parse(text: str, source: str) -> dict[tuple[str, str | None], float]:
    try:
        return _sample_totals(text)
    except ValueError as e:
        raise InvalidRequestError(f"{source}: not Prometheus text ({e})", param="metrics_url") from e


def metric_totals(text: str, source: str = "metrics") -> dict[str, float]:
    """Prometheus text -> each sample's value summed over its label sets, by sample name
    (``kvserve:kv_transfer_bytes_received_total``, ``kvserve:kv_transfer_seconds_sum``, ...; a histogram's
    ``_bucket`` sums over ``le`` mean nothing: use ``_sum`` and ``_count``).

    Raises:
        InvalidRequestError: unparsable text.
    """
    return _by_name(_parse(text, source))


def _by_name(totals: dict[tuple[str, str | None], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, _), v in totals.items():
        out[name] = out.get(name, 0.0) + v
    return out


def acceptance_from_metrics_text(text: str, source: str = "metrics") -> MeasuredAcceptance:
    """The acceptance in a ``/metrics`` exposition (``kvserve:`` or ``vllm:`` names; the first found wins).

    Raises:
        InvalidRequestError: unparsable text, no spec-decode counters, or no draft tokens yet.
    """
    return _acceptance_from_totals(_parse(text, source), source)


def _acceptance_from_totals(totals: dict[tuple[str, str | None], float], source: str) -> MeasuredAcceptance:
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


def transfer_from_totals(totals: dict[str, float], source: str = "metrics") -> MeasuredTransfer:
    """The KV transfer bandwidth in :func:`metric_totals` (or a difference of two, for one run):
    ``kv_transfer_bytes_received_total / kv_transfer_seconds_sum`` (bytes/s), under ``kvserve:`` or ``vllm:``.

    Raises:
        InvalidRequestError: no KV transfer metrics (not a decode instance), or no pull timed yet
            (``kv_transfer_seconds_count`` is 0).
    """
    for prefix in PREFIXES:
        received = totals.get(f"{prefix}kv_transfer_bytes_received_total")
        seconds = totals.get(f"{prefix}kv_transfer_seconds_sum")
        count = totals.get(f"{prefix}kv_transfer_seconds_count")
        if received is None or seconds is None or count is None:
            continue
        if count <= 0 or seconds <= 0:
            raise InvalidRequestError(f"{source}: no KV transfer timed yet (kv_transfer_seconds_count is "
                                      f"{count:g}): no bandwidth to show", param="metrics_url")
        return MeasuredTransfer(received / seconds, received, seconds, count, source)
    raise InvalidRequestError(
        f"{source}: no kv_transfer_bytes_received_total / kv_transfer_seconds counters (prefix "
        f"{' or '.join(PREFIXES)}); is it a decode instance (--kv-transfer-config with kv_role kv_consumer)?",
        param="metrics_url")


def transfer_from_metrics_text(text: str, source: str = "metrics") -> MeasuredTransfer:
    """The KV transfer bandwidth in a decode instance's ``/metrics`` exposition (:func:`transfer_from_totals`).

    Raises:
        InvalidRequestError: unparsable text, no KV transfer metrics, or no pull timed yet.
    """
    return transfer_from_totals(metric_totals(text, source), source)


def _either(source: str, param: str, acceptance: Callable[[], MeasuredAcceptance],
            transfer: Callable[[], MeasuredTransfer]) -> Measurements:
    """Run the two readers; a part whose reader raises is unmeasured (its message becomes a note).

    Raises:
        InvalidRequestError: both raised (the message holds both reasons).
    """
    notes: list[str] = []
    acc: MeasuredAcceptance | None = None
    xfer: MeasuredTransfer | None = None
    try:
        acc = acceptance()
    except InvalidRequestError as e:
        notes.append(f"spec-decode acceptance not measured: {e.message}")
    try:
        xfer = transfer()
    except InvalidRequestError as e:
        notes.append(f"KV transfer bandwidth not measured: {e.message}")
    if acc is None and xfer is None:
        raise InvalidRequestError(f"{source}: nothing to measure ({'; '.join(notes)})", param=param)
    return Measurements(acc, xfer, tuple(notes))


def from_metrics_text(text: str, source: str = "metrics") -> Measurements:
    """The acceptance and the KV transfer bandwidth in one exposition; either may be missing.

    Raises:
        InvalidRequestError: unparsable text, or neither measurement is there.
    """
    totals = _parse(text, source)
    return _either(source, "metrics_url", lambda: _acceptance_from_totals(totals, source),
                   lambda: transfer_from_totals(_by_name(totals), source))


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


def from_metrics_url(url: str, timeout: float = 10.0) -> Measurements:
    """Fetch ``url`` (see :func:`metrics_url`, ``timeout`` in seconds) and read both measurements from it.

    Raises:
        InvalidRequestError: the server cannot be read, or it has neither measurement.
    """
    return from_metrics_text(fetch_metrics_text(url, timeout), metrics_url(url))


def _read_bench_json(path: str | Path) -> tuple[Path, Any]:
    p = Path(path)
    try:
        return p, json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"--bench-json: cannot read {p}: {e}", param="bench_json") from e


def acceptance_from_bench_json(path: str | Path, section: str | None = None) -> MeasuredAcceptance:
    """The acceptance ``benchmarks/spec_decode.py`` recorded for ``section`` (default: the first of ngram,
    draft, load that the file has).

    Raises:
        InvalidRequestError: unreadable or not JSON, no ``acceptance`` record, or not for that section.
    """
    p, data = _read_bench_json(path)
    return _acceptance_from_data(p, data, section)


def _acceptance_from_data(p: Path, data: Any, section: str | None) -> MeasuredAcceptance:
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


def transfer_from_bench_json(path: str | Path, section: str | None = None) -> MeasuredTransfer:
    """The KV transfer bandwidth ``benchmarks/disagg.py`` recorded: its ``kv_transfer`` record over every
    workload, or the workload ``section`` names (``itl``, ``mixed``; another section name, such as a
    spec-decode one, takes every workload).

    Raises:
        InvalidRequestError: unreadable or not JSON, no ``kv_transfer`` record, no such workload, or no
            positive ``kv_transfer_bandwidth_bytes_per_s`` in it.
    """
    p, data = _read_bench_json(path)
    return _transfer_from_data(p, data, section)


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _transfer_from_data(p: Path, data: Any, section: str | None) -> MeasuredTransfer:
    rec = data.get("kv_transfer") if isinstance(data, dict) else None
    if not isinstance(rec, dict):
        raise InvalidRequestError(f"--bench-json: {p} has no kv_transfer record (written by benchmarks/disagg.py "
                                  "after a disagg run)", param="bench_json")
    where, entry = f"{p.name}, all workloads", rec
    if section in TRANSFER_SECTIONS:
        workloads: Any = rec.get("workloads")
        if not isinstance(workloads, dict):
            workloads = {}
        entry = workloads.get(section)
        if not isinstance(entry, dict):
            raise InvalidRequestError(f"--bench-json: {p} has no kv_transfer for workload {section!r} (it has: "
                                      f"{', '.join(workloads) or 'none'})", param="bench_json")
        where = f"{p.name}, {section}"
    bw = _float_or_none(entry.get("kv_transfer_bandwidth_bytes_per_s"))
    if bw is None or bw <= 0:
        raise InvalidRequestError(f"--bench-json: {p} ({where}) has no measured kv_transfer_bandwidth_bytes_per_s "
                                  "(no KV transfer was timed)", param="bench_json")
    return MeasuredTransfer(bw, _float_or_none(entry.get("bytes_received")),
                            _float_or_none(entry.get("transfer_seconds")), _float_or_none(entry.get("num_transfers")),
                            where)


def from_bench_json(path: str | Path, section: str | None = None) -> Measurements:
    """Both measurements of a benchmark JSON (spec_decode.py's ``acceptance``, disagg.py's ``kv_transfer``);
    either may be missing. ``section`` picks a spec-decode section (ngram, draft, load) for the acceptance or
    a disagg workload (itl, mixed) for the bandwidth; the other part then takes its default.

    Raises:
        InvalidRequestError: unreadable or not JSON, or neither measurement is there.
    """
    p, data = _read_bench_json(path)
    acc_section = None if section in TRANSFER_SECTIONS else section
    return _either(f"--bench-json: {p}", "bench_json", lambda: _acceptance_from_data(p, data, acc_section),
                   lambda: _transfer_from_data(p, data, section))
