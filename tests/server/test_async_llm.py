"""AsyncLLM and the app on a fake engine (no model): streams, aborts, 429, idle sleep, a dead loop -> 503."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvserve.core.scheduler import SchedulerStats
from kvserve.engine.async_llm import AsyncLLM, TooManyRequestsError
from kvserve.entrypoints.openai.server import build_app
from kvserve.entrypoints.openai.serving import ServerContext
from kvserve.errors import EngineDeadError, InvalidRequestError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass
class _Config:
    model: str = "fake"
    served_model_name: str | None = None
    max_num_seqs: int = 2


@dataclass
class _Scheduler:
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_sequences(self) -> int:
        return len(self.waiting)

    num_pending_forks = 0

    def make_stats(self) -> SchedulerStats:
        # kv usage: 0.1 per running request, so the gauge test sees it rise and return to 0
        return SchedulerStats(len(self.running), len(self.waiting), 0, 0, 0.1 * len(self.running), 0, 0, 0, 0, 0, 0)


class FakeEngine:
    """One token per running request per step (``delay_s``, default 5 ms); token id 7 fails its request;
    ``crash`` kills step(); ``steps`` counts the steps run."""

    def __init__(self, delay_s: float = 0.005) -> None:
        self.delay_s = delay_s
        self.steps = 0
        self.config = _Config()
        self.scheduler = _Scheduler()
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.crash = False
        self.wakeups = 0
        self.structured_outputs = None  # no grammar backend (requests without structured output only)
        self.num_threads = 1

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *args: Any) -> str:
        ids = prompt["prompt_token_ids"]
        if not ids:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        self.requests[request_id] = (ids, params, [])
        self.scheduler.waiting.append(request_id)
        return request_id

    def close(self) -> None:
        self.closed = True

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        for q in (self.scheduler.running, self.scheduler.waiting):
            if request_id in q:
                q.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        self.wakeups += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.crash:
            raise RuntimeError("boom")
        self.steps += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        s = self.scheduler
        while s.waiting and len(s.running) < self.config.max_num_seqs:
            s.running.append(s.waiting.pop(0))
        outs = []
        for rid in list(s.running):
            ids, params, out = self.requests[rid]
            out.append(7 if ids[0] == 7 else 1)
            error = out[-1] == 7
            done = error or len(out) >= (params.max_tokens or 4)
            reason = "error" if error else ("length" if done else None)
            outs.append(RequestOutput(rid, None, ids, [CompletionOutput(0, "a" * len(out), list(out),
                                                                        finish_reason=reason)],
                                      done, error="RuntimeError: bad" if error else None,
                                      metrics={"first_token_time": time.monotonic()}))
            if done:
                s.running.remove(rid)
                del self.requests[rid]
        return outs


def _params(max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


_MODE = {"inline": False}


@pytest.fixture(autouse=True, params=["thread", "inline"])
def engine_loop(request: pytest.FixtureRequest) -> str:
    """Every test runs with the engine loop on its own thread and inline on the event loop (``_started``)."""
    _MODE["inline"] = request.param == "inline"
    return str(request.param)


async def _started(engine: FakeEngine, **kwargs: Any) -> AsyncLLM:
    kwargs.setdefault("inline", _MODE["inline"])
    llm = AsyncLLM(engine, **kwargs)  # type: ignore[arg-type]
    llm.start()
    assert (llm._task is not None) == _MODE["inline"] and (llm._thread is not None) != _MODE["inline"]
    return llm


def test_stream_runs_to_the_end_and_is_counted() -> None:
    async def main() -> None:
        llm = await _started(FakeEngine())
        stream = llm.add_request({"prompt_token_ids": [1, 2]}, _params(3))
        await stream.accepted()
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [1, 1, 1]
        text = llm.metrics.render().decode()
        assert 'kvserve:generation_tokens_total{model_name="fake"} 3.0' in text
        assert 'kvserve:request_success_total{finished_reason="length",model_name="fake"} 1.0' in text
        assert not getattr(llm.engine, "closed", False)
        llm.shutdown()
        assert getattr(llm.engine, "closed", False)  # the offload tiers get their queued blocks

    asyncio.run(main())


def test_add_error_is_raised_by_accepted() -> None:
    async def main() -> None:
        llm = await _started(FakeEngine())
        stream = llm.add_request({"prompt_token_ids": []}, _params())
        with pytest.raises(InvalidRequestError):
            await stream.accepted()
        assert llm.num_open_streams == 0
        llm.shutdown()

    asyncio.run(main())


def test_abort_frees_and_gauges_return_to_zero() -> None:
    async def main() -> None:
        engine = FakeEngine()
        llm = await _started(engine)
        stream = llm.add_request({"prompt_token_ids": [1]}, _params(10_000))
        await stream.accepted()
        await stream.__anext__()
        stream.abort()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not engine.requests and 'num_requests_running{model_name="fake"} 0.0' in llm.metrics.render().decode():
                break
        text = llm.metrics.render().decode()
        assert not engine.requests and llm.num_open_streams == 0
        assert 'kvserve:num_requests_running{model_name="fake"} 0.0' in text
        assert 'kvserve:kv_cache_usage_perc{model_name="fake"} 0.0' in text
        assert 'kvserve:request_success_total{finished_reason="abort",model_name="fake"} 1.0' in text
        llm.shutdown()

    asyncio.run(main())


def test_too_many_waiting_requests_is_429() -> None:
    async def main() -> None:
        llm = await _started(FakeEngine(), max_waiting_requests=1)
        # 2 batch slots + 1 waiting are admitted in the same inbox batch; the 4th is refused.
        streams = [llm.add_request({"prompt_token_ids": [1]}, _params(50)) for _ in range(4)]
        results = await asyncio.gather(*(s.accepted() for s in streams), return_exceptions=True)
        assert [isinstance(r, TooManyRequestsError) for r in results] == [False, False, False, True]
        assert TooManyRequestsError.status_code == 429
        for s in streams:
            s.abort()
        llm.shutdown()

    asyncio.run(main())


def test_idle_loop_sleeps() -> None:
    async def main() -> None:
        engine = FakeEngine()
        llm = await _started(engine)
        await asyncio.sleep(0.05)
        before = engine.wakeups
        await asyncio.sleep(0.5)
        assert engine.wakeups - before <= 1  # no polling while idle
        llm.shutdown()

    asyncio.run(main())


def _app(llm: AsyncLLM) -> httpx.AsyncClient:
    ctx = ServerContext(llm=llm, tokenizer=None, served_model_name="fake", model_aliases=frozenset({"fake"}),
                        max_model_len=64)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)), base_url="http://test")


def test_error_in_one_request_fails_only_that_request() -> None:
    async def main() -> None:
        llm = await _started(FakeEngine())
        async with _app(llm) as client:
            bad, good = await asyncio.gather(
                client.post("/v1/completions", json={"prompt": [7, 1], "max_tokens": 3}),
                client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}))
            assert bad.status_code == 500 and "RuntimeError: bad" in bad.json()["error"]["message"]
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
            assert (await client.get("/health")).status_code == 200
        llm.shutdown()

    asyncio.run(main())


def test_dead_loop_fails_streams_and_health_is_503() -> None:
    async def main() -> None:
        engine = FakeEngine()
        llm = await _started(engine)
        engine.crash = True
        stream = llm.add_request({"prompt_token_ids": [1]}, _params())
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            llm.add_request({"prompt_token_ids": [1]}, _params())
        async with _app(llm) as client:
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert r.status_code == 503
        llm.shutdown()

    asyncio.run(main())


class _QueueOnlyEngine:
    """The real Scheduler behind a step that computes nothing: requests (and their n samples) stay queued."""

    def __init__(self, max_num_seqs: int) -> None:
        from kvserve.core.block_manager import BlockManager
        from kvserve.core.scheduler import Scheduler, SchedulerConfig

        self.config = _Config(max_num_seqs=max_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, 64, 128), BlockManager(64, 16))

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *args: Any) -> str:
        from kvserve.core.request import Request

        ids = prompt["prompt_token_ids"]
        leader = Request(request_id, ids, params, None, 8)
        self.scheduler.add_request(leader)
        self.scheduler.add_forks(leader, [Request(f"{request_id}#{i}", ids, params, None, 8)
                                          for i in range(1, params.n)])
        return request_id

    def close(self) -> None:
        self.closed = True

    def abort_request(self, request_id: str) -> None:
        from kvserve.core.request import RequestStatus

        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return []


def test_max_waiting_requests_counts_every_sample_and_prompt() -> None:
    """4 batch slots, at most 8 sequences waiting: requests of n=4 are 4 sequences each (the 4th is refused),
    and one request of 4 prompts x n=4 (16 sequences) is refused as a whole."""
    async def main() -> None:
        engine = _QueueOnlyEngine(max_num_seqs=4)
        llm = await _started(engine, max_waiting_requests=8)  # type: ignore[arg-type]
        params = SamplingParams(n=4, max_tokens=8, temperature=1.0)
        results = []
        for _ in range(4):
            stream = llm.add_request({"prompt_token_ids": [1, 2, 3]}, params)
            results.append(await asyncio.gather(stream.accepted(), return_exceptions=True))
        assert [isinstance(r[0], TooManyRequestsError) for r in results] == [False, False, False, True]
        assert engine.scheduler.num_waiting_sequences == 12
        for rid in list(engine.scheduler.requests):
            llm.abort(rid)
        await asyncio.sleep(0.05)
        assert engine.scheduler.num_waiting_sequences == 0
        ctx = ServerContext(llm=llm, tokenizer=None, served_model_name="fake", model_aliases=frozenset({"fake"}),
                            max_model_len=128)
        with pytest.raises(TooManyRequestsError, match="12 sequences queued and this request adds 4"):
            await ctx.submit([[1, 2]] * 4, params, "multi", 0, None)
        await asyncio.sleep(0.05)
        assert engine.scheduler.num_waiting_sequences == 0  # the prompts already queued were aborted
        llm.shutdown()

    asyncio.run(main())


def test_lockstep_hands_each_step_to_the_handlers_before_the_next_step() -> None:
    """lockstep: the handler of a stream sees output k while the engine has run exactly k steps (the loop
    thread waited); the default for an engine that is not on the CPU is off."""
    async def main() -> None:
        engine = FakeEngine(delay_s=0.0)  # steps take no time: without lockstep the engine runs ahead
        llm = await _started(engine, lockstep=True)
        assert llm.lockstep
        stream = llm.add_request({"prompt_token_ids": [1, 2]}, _params(20))
        await stream.accepted()
        seen = []
        async for out in stream:
            seen.append((len(out.outputs[0].token_ids), engine.steps))
            time.sleep(0.002)  # a slow handler holds the event loop: the engine must not run ahead
        assert [k for k, _ in seen] == list(range(1, 21))
        assert all(steps == k for k, steps in seen), seen
        llm.shutdown()
        assert not AsyncLLM(FakeEngine()).lockstep  # type: ignore[arg-type]

    asyncio.run(main())


def test_gauges_are_refreshed_when_the_snapshot_changes_and_for_every_drained_timing() -> None:
    """The loop skips the metrics update when the scheduler snapshot equals the last one shown (steady
    decoding), but never drops timings drained into a snapshot (KV transfer durations), even equal ones."""
    engine = FakeEngine()
    shown: list[SchedulerStats] = []

    class _Metrics:
        def update_engine_state(self, stats: SchedulerStats) -> None:
            shown.append(stats)

    llm = AsyncLLM(engine, metrics=_Metrics())  # type: ignore[arg-type]
    snaps: list[SchedulerStats] = []
    engine.scheduler.make_stats = lambda: snaps.pop(0)  # type: ignore[method-assign]

    def stats(running: int, transfer: Any = None) -> SchedulerStats:
        return SchedulerStats(running, 0, 0, 0, 0.1 * running, 0, 0, 0, 0, 0, 0, transfer=transfer)

    drained = SimpleNamespace(transfer_seconds=[0.25])
    snaps += [stats(1), stats(1), stats(2), stats(2, drained), stats(2, drained), stats(2, SimpleNamespace(
        transfer_seconds=[])), stats(2, SimpleNamespace(transfer_seconds=[]))]
    for _ in range(7):
        llm._update_gauges()
    assert [(s.num_running, s.transfer) for s in shown] == [
        (1, None), (2, None), (2, drained), (2, drained), (2, SimpleNamespace(transfer_seconds=[]))]


def test_inline_loop_runs_on_the_event_loop_thread_and_wakes_from_other_threads(engine_loop: str) -> None:
    """Inline: every step runs on the event loop's own thread, between two steps the handlers run (no step
    while a handler holds the loop), and ``_wake`` from another thread (a KV connector, a TP watcher) makes an
    idle engine poll at once; shutdown cancels the parked task and closes the engine."""
    if engine_loop != "inline":
        pytest.skip("inline mode only")

    async def main() -> None:
        import threading

        engine = FakeEngine(delay_s=0.0)
        step_threads: set[int] = set()
        polls: list[int] = []
        real_step = engine.step

        def step() -> list[RequestOutput]:
            step_threads.add(threading.get_ident())
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        engine.poll_background = lambda: polls.append(threading.get_ident())  # type: ignore[attr-defined]
        llm = await _started(engine)
        assert llm.lockstep and llm._thread is None
        stream = llm.add_request({"prompt_token_ids": [1, 2]}, _params(5))
        await stream.accepted()
        assert [len(o.outputs[0].token_ids) async for o in stream] == [1, 2, 3, 4, 5]
        assert step_threads == {threading.get_ident()}
        await asyncio.sleep(0.05)  # idle now: parked on the wake-up event, no polling
        before = len(polls)
        await asyncio.sleep(0.2)
        assert len(polls) == before
        waker = threading.Thread(target=llm._wake)
        waker.start()
        waker.join()
        for _ in range(100):
            await asyncio.sleep(0.005)
            if len(polls) > before:
                break
        assert len(polls) == before + 1 and polls[-1] == threading.get_ident()
        task = llm._task
        assert task is not None and not task.done()
        llm.shutdown()
        await asyncio.sleep(0)
        assert task.done() and engine.closed and not llm.is_dead

    asyncio.run(main())


def test_engine_loop_flag_picks_the_mode(monkeypatch: pytest.MonkeyPatch, engine_loop: str) -> None:
    """``--engine-loop thread|inline`` (default thread) and AsyncLLM's ``inline`` (implies lockstep)."""
    import argparse

    from kvserve.entrypoints.openai import server as server_module

    parser = argparse.ArgumentParser()
    server_module.add_server_args(parser)
    assert parser.parse_args([]).engine_loop == "thread"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-loop", "fiber"])
    assert not AsyncLLM(FakeEngine(), lockstep=True).inline  # type: ignore[arg-type]
    assert not AsyncLLM(FakeEngine(), lockstep=False).inline  # type: ignore[arg-type]
    assert AsyncLLM(FakeEngine(), inline=True, lockstep=False).lockstep  # type: ignore[arg-type]
    assert not AsyncLLM(FakeEngine(), inline=False, lockstep=True).inline  # type: ignore[arg-type]
