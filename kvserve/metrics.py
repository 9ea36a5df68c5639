"""Prometheus metrics of a serving engine, named as vLLM's with the prefix ``kvserve:`` (``--metrics-prefix vllm``
gives ``vllm:``, so that vLLM's Grafana dashboards work unchanged).

Every metric lives in the registry of one :class:`EngineMetrics` (not the process-global one), so two
servers in one process, or a test that builds several, never clash. :class:`EngineMetrics` is fed by the
engine loop thread of :class:`kvserve.engine.async_llm.AsyncLLM`; ``prometheus_client`` metrics are
thread-safe, and the HTTP thread only renders them.

| metric | kind | meaning |
|---|---|---|
| ``num_requests_running`` / ``num_requests_waiting`` | gauge | sequences in the scheduler's queues |
| ``kv_cache_usage_perc`` | gauge | fraction (0..1) of KV blocks in use |
| ``num_requests_swapped`` | gauge | requests preempted by swap, waiting to resume |
| ``num_partial_prefills`` | gauge | running requests whose prompt is not fully computed (mid-prefill) |
| ``num_preemptions_total{mode}`` | counter | preemptions since start, by ``recompute`` / ``swap`` |
| ``swapped_bytes_total`` | counter | KV bytes copied between device and host swap pool (out + in) |
| ``prompt_tokens_total`` / ``generation_tokens_total`` | counter | prefilled / generated tokens |
| ``request_success_total{finished_reason}`` | counter | finished requests (stop, length, abort, error) |
| ``time_to_first_token_seconds`` ... | histogram | see ``docs/metrics.md`` |
| ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` | counter | prompt tokens asked / hit, once per request |
| ``gpu_cache_usage_perc`` | gauge | vLLM's older name of ``kv_cache_usage_perc`` (its dashboard reads it) |
| ``time_per_output_token_seconds`` | histogram | vLLM's older name of ``inter_token_latency_seconds`` |
| ``request_prompt_tokens``, ``request_generation_tokens`` | histogram | per finished request |
| ``request_max_num_generation_tokens`` | histogram | the longest sample of a finished request |
| ``request_prefill_time_seconds`` | histogram | first scheduled -> first token |
| ``request_decode_time_seconds`` | histogram | first token -> finish |
| ``request_inference_time_seconds`` | histogram | first scheduled -> finish |
| ``spec_decode_num_drafts_total`` | counter | verification rounds with at least one draft token |
| ``spec_decode_num_draft_tokens_total`` | counter | draft tokens verified |
| ``spec_decode_num_accepted_tokens_total`` | counter | draft tokens accepted |
| ``spec_decode_num_accepted_tokens_per_pos_total{position}`` | counter | accepted drafts by position in the round |
| ``spec_decode_mean_k`` | gauge | mean draft length over the decoding requests of the latest step |
| ``kv_offload_queries_total{tier}`` / ``kv_offload_hits_total{tier}`` | counter | tokens looked up / found |
| ``kv_offload_loaded_tokens_total{tier}`` | counter | tokens loaded from a tier into device blocks |
| ``kv_offload_bytes_stored_total{tier}`` / ``..._bytes_loaded_total{tier}`` | counter | payload bytes |
| ``kv_offload_load_seconds{tier}`` | histogram | time to load one request's run of blocks from a tier |
| ``kv_offload_errors_total{tier,kind}`` | counter | misses by cause (timeout, connection, checksum, ...) |
| ``kv_offload_stores_dropped_total`` | counter | blocks not stored: the writer queue was full |
| ``prompt_tokens_computed_total`` | counter | prompt tokens run through the model (not prefix hits, not loaded KV) |
| ``kv_transfer_pulls_total`` / ``kv_transfer_bytes_received_total`` | counter | decode side: prompts' KV pulled |
| ``kv_transfer_seconds`` | histogram | decode side: one pull, asked to received |
| ``kv_transfer_bytes_sent_total`` / ``kv_transfer_blocks_sent_total`` | counter | prefill side: KV served |
| ``kv_transfer_failures_total{kind}`` | counter | pulls that failed (timeout, unknown, hash, checksum, ...) |
| ``kv_transfer_recomputed_requests_total`` | counter | decode requests that recomputed their prompt |
| ``kv_transfer_pinned_blocks`` | gauge | prefill side: blocks held for a decode instance |
| ``kv_transfer_pins_expired_total`` | counter | prefill side: pins freed by kv_transfer_timeout_s |

Gauges are refreshed after every loop iteration, including the ones that only process aborts, so they
return to 0 as soon as the engine is idle (no stale values after a wave of cancellations).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from kvserve.core.scheduler import SchedulerStats
from kvserve.kv_offload.manager import OffloadSnapshot
from kvserve.outputs import RequestOutput

PREFIX = "kvserve:"  # the default; ``EngineMetrics(prefix=...)`` changes it

# No ``*_created`` timestamp samples (as vLLM): they double the exposition and no dashboard uses them.
disable_created_metrics()

# Bucket edges in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


def _1_2_5_buckets(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit``. ``100`` -> (1, 2, 5, 10, 20, 50, 100)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


@dataclass
class _Progress:
    """What the metrics have already counted of one live request."""

    arrival_time: float
    num_generated: int = 0
    last_token_time: float = 0.0


class EngineMetrics:
    """The Prometheus metrics of one engine, with a label ``model_name``.

    Args:
        model_name: the served model name (the label value).
        prefix: the metric name prefix before ``:`` (``kvserve``; ``vllm`` for vLLM's dashboards).
        max_model_len: the largest bucket of the per-request token histograms.
    """

    def __init__(self, model_name: str, prefix: str = "kvserve", max_model_len: int = 131072) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        pfx = f"{prefix}:"

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(pfx + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(pfx + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(pfx + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Sequences running (in the batch).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to the host pool.")
        self.num_partial_prefills = gauge("num_partial_prefills", "Running requests still prefilling their prompt.")
        self._preemptions = Counter(pfx + "num_preemptions", "Preemptions since start, by mode.",
                                    ["model_name", "mode"], registry=r)
        for mode in ("recompute", "swap"):
            self._preemptions.labels(model_name, mode)
        self.swapped_bytes = counter("swapped_bytes", "KV bytes copied by swap-out and swap-in.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted at the first token).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(pfx + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)  # export every reason at 0 from the start
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of a request (s).",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish (s).", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling (s).",
                                    _REQUEST_BUCKETS)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # vLLM's older names, still read by its Grafana dashboard.
        self.gpu_cache_usage_perc = gauge("gpu_cache_usage_perc", "Same as kv_cache_usage_perc (vLLM's older name).")
        self.tpot = histogram("time_per_output_token_seconds", "Same as inter_token_latency_seconds (older name).",
                              _ITL_BUCKETS)
        tokens = _1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request (all samples).", tokens)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Most tokens generated by one sample of a finished request.", tokens)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token (s).",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish (s).", _REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finish (s).",
                                        _REQUEST_BUCKETS)
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative rounds with at least one draft token.")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(pfx + "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position in the round (0-based).",
                                     ["model_name", "position"], registry=r)
        self.spec_mean_k = gauge("spec_decode_mean_k", "Mean draft length k over the latest step's decodes.")
        tier_labels = ["model_name", "tier"]

        def tier_counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(pfx + name, doc, tier_labels + (extra or []), registry=r)

        self._off_queries = tier_counter("kv_offload_queries", "Prompt tokens looked up in an offload tier.")
        self._off_hits = tier_counter("kv_offload_hits", "Prompt tokens found in an offload tier.")
        self._off_loaded = tier_counter("kv_offload_loaded_tokens", "Tokens loaded from a tier into device blocks.")
        self._off_stored = tier_counter("kv_offload_bytes_stored", "KV payload bytes stored in a tier.")
        self._off_bytes_loaded = tier_counter("kv_offload_bytes_loaded", "KV payload bytes loaded from a tier.")
        self._off_errors = tier_counter("kv_offload_errors", "Offload misses and refusals by cause.", ["kind"])
        self._off_load_seconds = Histogram(pfx + "kv_offload_load_seconds",
                                           "Time to load one request's run of blocks from a tier (s).",
                                           tier_labels, buckets=_ITL_BUCKETS, registry=r)
        self.kv_offload_stores_dropped = counter("kv_offload_stores_dropped",
                                                 "KV blocks not stored: the offload writer queue was full.")
        self.prompt_tokens_computed = counter(
            "prompt_tokens_computed", "Prompt tokens run through the model (not prefix-cache hits, not KV loaded "
            "from a tier or transferred from a prefill instance).")
        self.kv_transfer_pulls = counter("kv_transfer_pulls", "Prompts' KV pulled from a prefill instance.")
        self.kv_transfer_bytes_received = counter("kv_transfer_bytes_received",
                                                  "KV bytes pulled from prefill instances.")
        self.kv_transfer_bytes_sent = counter("kv_transfer_bytes_sent", "KV bytes served to decode instances.")
        self.kv_transfer_blocks_sent = counter("kv_transfer_blocks_sent", "KV blocks served to decode instances.")
        self._kv_transfer_failures = Counter(pfx + "kv_transfer_failures", "KV pulls that failed, by kind.",
                                             ["model_name", "kind"], registry=r)
        self.kv_transfer_recomputed = counter("kv_transfer_recomputed_requests",
                                              "Decode requests that recomputed their prompt (the pull failed).")
        self.kv_transfer_pinned_blocks = gauge("kv_transfer_pinned_blocks",
                                               "KV blocks held for a decode instance to pull.")
        self.kv_transfer_pins_expired = counter("kv_transfer_pins_expired",
                                                "Pinned prompts freed by kv_transfer_timeout_s, never pulled.")
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "One KV pull, asked to received (s).",
                                             _ITL_BUCKETS)
        self._progress: dict[str, _Progress] = {}
        self._last: SchedulerStats | None = None

    # ---- fed by the engine loop thread ---------------------------------------------------------
    def on_added(self, request_id: str, arrival_time: float) -> None:
        """A request entered the engine (``arrival_time``: ``time.monotonic()`` seconds)."""
        self._progress[request_id] = _Progress(arrival_time)

    def on_output(self, out: RequestOutput, now: float) -> None:
        """Count the tokens of one step's output and observe latencies (``now``: ``time.monotonic()``)."""
        p = self._progress.get(out.request_id)
        if p is None:
            return
        num = sum(len(c.token_ids) for c in out.outputs)
        new = num - p.num_generated
        if new > 0:
            self.generation_tokens.inc(new)
            if p.num_generated == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(out.metrics.get("first_token_time", now) - p.arrival_time)
                scheduled = out.metrics.get("first_scheduled_time")
                if scheduled is not None:
                    self.queue_time.observe(max(scheduled - p.arrival_time, 0.0))
            else:
                self.itl.observe(now - p.last_token_time)
                self.tpot.observe(now - p.last_token_time)
            p.num_generated, p.last_token_time = num, now
        if out.finished:
            self._observe_finished(out, now)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason == "error"), None)
            self._finish(out.request_id, reason or (out.outputs[0].finish_reason or "stop"), now)

    def _observe_finished(self, out: RequestOutput, now: float) -> None:
        lengths = [len(c.token_ids) for c in out.outputs]
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(lengths))
        self.request_max_num_generation_tokens.observe(max(lengths, default=0))
        scheduled, first = out.metrics.get("first_scheduled_time"), out.metrics.get("first_token_time")
        if scheduled is not None and first is not None:
            self.prefill_time.observe(max(first - scheduled, 0.0))
            self.decode_time.observe(max(now - first, 0.0))
            self.inference_time.observe(max(now - scheduled, 0.0))

    def on_aborted(self, request_id: str, now: float) -> None:
        """A live request was aborted (client gone); finished requests are ignored."""
        if request_id in self._progress:
            self._finish(request_id, "abort", now)

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        p = self._progress.pop(request_id)
        self._success.labels(self._model_name, reason).inc()
        self.e2e.observe(now - p.arrival_time)

    def update_engine_state(self, stats: SchedulerStats) -> None:
        """Refresh the gauges from a scheduler snapshot and advance the counters by its new totals."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.gpu_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_requests_swapped.set(stats.num_swapped)
        self.num_partial_prefills.set(stats.num_partial_prefills)
        last = self._last
        self._preemptions.labels(self._model_name, "recompute").inc(
            stats.num_preemptions_recompute - (last.num_preemptions_recompute if last else 0))
        self._preemptions.labels(self._model_name, "swap").inc(
            stats.num_preemptions_swap - (last.num_preemptions_swap if last else 0))
        self.swapped_bytes.inc(stats.swapped_bytes - (last.swapped_bytes if last else 0))
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        if stats.spec is not None:
            s, ls = stats.spec, last.spec if last is not None else None
            self.spec_num_drafts.inc(s.num_drafts - (ls.num_drafts if ls else 0))
            self.spec_num_draft_tokens.inc(s.num_draft_tokens - (ls.num_draft_tokens if ls else 0))
            self.spec_num_accepted_tokens.inc(s.num_accepted_tokens - (ls.num_accepted_tokens if ls else 0))
            for pos, n in enumerate(s.accepted_per_pos):
                prev = ls.accepted_per_pos[pos] if ls and pos < len(ls.accepted_per_pos) else 0
                self._spec_per_pos.labels(self._model_name, str(pos)).inc(n - prev)
            self.spec_mean_k.set(s.last_mean_k)
        if stats.offload is not None:
            self._update_offload(stats.offload, last.offload if last is not None else None)
        self.prompt_tokens_computed.inc(stats.prompt_tokens_computed - (last.prompt_tokens_computed if last else 0))
        if stats.transfer is not None:
            t, lt = stats.transfer, last.transfer if last is not None else None
            self.kv_transfer_pulls.inc(t.pulls - (lt.pulls if lt else 0))
            self.kv_transfer_bytes_received.inc(t.bytes_received - (lt.bytes_received if lt else 0))
            self.kv_transfer_bytes_sent.inc(t.bytes_sent - (lt.bytes_sent if lt else 0))
            self.kv_transfer_blocks_sent.inc(t.blocks_served - (lt.blocks_served if lt else 0))
            self.kv_transfer_recomputed.inc(t.recomputed_requests - (lt.recomputed_requests if lt else 0))
            self.kv_transfer_pins_expired.inc(t.pins_expired - (lt.pins_expired if lt else 0))
            for kind, n in t.failures.items():
                prev = lt.failures.get(kind, 0) if lt else 0
                self._kv_transfer_failures.labels(self._model_name, kind).inc(n - prev)
            self.kv_transfer_pinned_blocks.set(t.pinned_blocks)
            for seconds in t.transfer_seconds:
                self.kv_transfer_seconds.observe(seconds)
        self._last = stats

    def _update_offload(self, o: OffloadSnapshot, lo: OffloadSnapshot | None) -> None:
        m = self._model_name
        for name, t in o.tiers.items():
            prev = lo.tiers.get(name) if lo is not None else None
            self._off_queries.labels(m, name).inc(t.queries_tokens - (prev.queries_tokens if prev else 0))
            self._off_hits.labels(m, name).inc(t.hits_tokens - (prev.hits_tokens if prev else 0))
            self._off_stored.labels(m, name).inc(t.bytes_stored - (prev.bytes_stored if prev else 0))
            self._off_bytes_loaded.labels(m, name).inc(t.bytes_loaded - (prev.bytes_loaded if prev else 0))
            self._off_loaded.labels(m, name).inc(o.loaded_tokens.get(name, 0) - (
                lo.loaded_tokens.get(name, 0) if lo is not None else 0))
            for kind, n in t.errors.items():
                self._off_errors.labels(m, name, kind).inc(n - (prev.errors.get(kind, 0) if prev else 0))
        self.kv_offload_stores_dropped.inc(o.stores_dropped - (lo.stores_dropped if lo is not None else 0))
        for name, seconds in o.load_seconds:
            self._off_load_seconds.labels(m, name).observe(seconds)

    # ---- read by the HTTP side -----------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
