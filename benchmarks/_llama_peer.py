"""llama.cpp's ``llama-server`` as a batch-1 decode peer on a given GGUF file (benchmarks/quantization.py).

The server runs one slot (``-np 1``) with ``-t``/``-tb`` threads; between measurements it is SIGSTOPped, so it takes
no CPU from the engine measured next. A measurement is one ``/completion`` request: the prompt as token ids,
``n_predict`` tokens, greedy (``top_k 1``), ``ignore_eos``, no prompt cache; the decode speed is the server's own
``timings.predicted_per_second`` (generated tokens over the time spent generating them, HTTP excluded), the number
kvserve's side reports as well (engine steps after the first token, no HTTP).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` on ``gguf``; use as a context manager (started, stopped, killed on exit).

    Raises:
        FileNotFoundError: no ``WORK/bin/llama-server``.
        RuntimeError: the server exited or did not answer ``/health`` within ``timeout_s``.
    """

    def __init__(self, work: Path, gguf: Path, threads: int, ctx: int = 4096, timeout_s: float = 300.0) -> None:
        self.exe = work / "bin" / "llama-server"
        if not self.exe.is_file():
            raise FileNotFoundError(f"{self.exe} not found (build the peers with ../shared/bench/setup_peers.sh WORK)")
        self.port = _free_port()
        self.cmd = [str(self.exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
                    "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / "logs" / f"quantization-llama-server-{self.port}.log"

    def version(self) -> str:
        out = subprocess.run([str(self.exe), "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        return " | ".join(lines[-2:])

    def __enter__(self) -> LlamaServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        self.pause()
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not answer /health within {self.timeout_s:.0f} s (log: {self.log})")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def decode(self, prompt: list[int], n_predict: int) -> dict[str, Any]:
        """One greedy request (resumed for it, paused after): the server's timings and the token count."""
        body = dict(prompt=prompt, n_predict=n_predict, ignore_eos=True, top_k=1, temperature=0.0,
                    cache_prompt=False, stream=False)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        self.resume()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        finally:
            self.pause()
        t = out["timings"]
        return dict(tok_s=round(float(t["predicted_per_second"]), 2), tokens=int(t["predicted_n"]),
                    predicted_ms=round(float(t["predicted_ms"]), 1), prompt_n=int(t["prompt_n"]))
