"""``kvserve serve --tensor-parallel-size 2`` as a subprocess: completions and a stream equal one process's greedy
text (a stop string and a seeded choice constraint too: rank 0 applies them to the gathered logits), and a worker
SIGKILLed mid-stream ends that stream with an OpenAI error event, stops the server (exit code 1) and leaves no
process behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.structured.params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_harness import Server, sse_events  # noqa: E402
from tp_helpers import alive, descendants, save_tiny  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with SmolLM2's tokenizer (49,152 ids): text in, text out."""
    return save_tiny(tmp_path_factory.mktemp("tp-served"), "qwen2", tokenizer_of="smollm2-135m-instruct")


def _workers(pid: int) -> set[int]:
    return {p for p in descendants(pid) if alive(p)
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()}


def test_served_completions_stream_and_a_dead_worker(model: Path) -> None:
    offline = LLM(str(model), dtype="float32", num_threads=1, kv_cache_memory=0.01)
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    assert expected
    stop = expected[len(expected) // 2:][:3]  # a stop string that starts mid-output
    choices = ["red", "green", "blue"]
    constrained = {"temperature": 0.9, "seed": 3, "max_tokens": 8, "ignore_eos": False,
                   "structured_outputs": {"choice": choices}}
    picked = offline.generate([PROMPT], SamplingParams(temperature=0.9, seed=3, max_tokens=8,
                                                       structured_outputs=StructuredOutputsParams(choice=choices)),
                              use_tqdm=False)[0].outputs[0].text
    assert picked in choices
    server = Server("--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-memory", "0.01",
                    positional_model=str(model))
    try:
        (worker,) = _workers(server.proc.pid)
        started = descendants(server.proc.pid)  # the worker and multiprocessing's resource tracker
        body = {"model": str(model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected and r.json()["usage"]["completion_tokens"] == 12
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == expected
        # on rank 0, on the gathered logits: stop strings, a grammar (a choice), seeded sampling
        r = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60)
        assert r.json()["choices"][0]["text"] == expected[:expected.index(stop)], r.text
        r = httpx.post(server.url + "/v1/completions", json={**body, **constrained}, timeout=60)
        assert r.json()["choices"][0]["text"] == picked, r.text
        # a long stream; its worker dies after the first events
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={**body, "max_tokens": 200, "stream": True}) as s:
            lines = s.iter_lines()
            first = sse_events(line for line, _ in zip(lines, range(6), strict=False))
            os.kill(worker, signal.SIGKILL)
            rest = sse_events(lines)
        assert len(first) == 3 and all(e["choices"][0]["text"] for e in first) and rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["code"] == 500 and "tensor-parallel rank 1" in error["message"], rest[-3:]
        rc = server.proc.wait(30)
        assert rc == 1, server.log_text()
        assert "stopping the server" in server.log_text()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if alive(p)], "processes of the server outlived it"
    finally:
        server.stop()
