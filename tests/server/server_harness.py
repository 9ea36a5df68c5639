"""Run a real ``kvserve serve`` subprocess on a free loopback port, and read its metrics.

Used by tests/server and tests/cases (which put this folder on ``sys.path``). The server gets one torch
thread and a small KV cache: this machine has 2 shared cores.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"
_STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``kvserve serve`` child process; ``url`` is ``http://127.0.0.1:PORT``.

    Args:
        *flags: extra CLI flags (engine and server flags).
        positional_model: serve this model given positionally (``kvserve serve MODEL``, vLLM's spelling)
            instead of ``--model MODEL``.
    """

    def __init__(self, *flags: str, positional_model: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvserve-server-", suffix=".log")[1])
        model = ["--model", MODEL] if positional_model is None else [positional_model]
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *model, "--host", "127.0.0.1",
               "--port", str(self.port), "--num-threads", "1", "--kv-cache-memory", "0.2",
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not healthy after {_STARTUP_TIMEOUT_S} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()
        self.log.unlink(missing_ok=True)

    # ---- helpers -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples summed over labels except ``finished_reason`` (kept as ``name{reason}``)."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_for(self, pred: Callable[[dict[str, float]], bool], timeout_s: float) -> dict[str, float]:
        """Poll metrics until ``pred`` holds; returns the last sample (the caller asserts on it)."""
        deadline = time.monotonic() + timeout_s
        m = self.metrics()
        while not pred(m) and time.monotonic() < deadline:
            time.sleep(0.05)
            m = self.metrics()
        return m

    def wait_idle(self, timeout_s: float = 5.0) -> dict[str, float]:
        return self.wait_for(is_idle, timeout_s)

    def alive(self) -> bool:
        """The cases' "server alive": /health 200 and a trivial completion within a few seconds."""
        if httpx.get(self.url + "/health", timeout=5).status_code != 200:
            return False
        r = httpx.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                       timeout=30)
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


_SAMPLE = re.compile(r'^(kvserve:[a-z_]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$')
_REASON = re.compile(r'finished_reason="([a-z]+)"')


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        reason = _REASON.search(labels)
        key = f"{name}{{{reason.group(1)}}}" if reason else name
        out[key] = out.get(key, 0.0) + value
    return out


def is_idle(m: dict[str, float]) -> bool:
    return (m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
            and m["kvserve:kv_cache_usage_perc"] == 0)


def sse_events(lines: Any) -> list[Any]:
    """Parse SSE ``data:`` lines into JSON objects; the final ``[DONE]`` is returned as the string."""
    import json

    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
