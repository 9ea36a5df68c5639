"""A real 2-node Ray cluster on one machine for the data-parallel tests: the head on the host, a worker node in
a network namespace joined by a veth pair (``10.213.0.1/30`` host side, ``10.213.0.2`` inside). Needs root and
``ip netns``; everything it creates (namespace, veth, Ray processes, temp dir) is removed on exit, failure
included (a run killed before its cleanup, e.g. by SIGKILL, leaves its namespace and veth, named by its pid:
the next run removes them). Traffic stays on the machine: the namespace has no other link and no route out.

Both Ray nodes run in the foreground (``ray start --block``), so they are stopped by PID (SIGTERM: Ray's
own shutdown of the node's processes), never by ``ray stop``, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"
RAY = str(Path(sys.executable).parent / "ray")
# Ray's worker processes bind one port each from this range (Ray's default is 10002-19999)
WORKER_PORTS = ("--min-worker-port", "20400", "--max-worker-port", "20499")


def remove_stale() -> None:
    """Remove the namespaces and veths of runs that were killed before their cleanup (their pid is gone)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in out.splitlines() if line.startswith("kvs-dp-")):
        tag = name.removeprefix("kvs-dp-")
        if tag.isdigit() and not Path(f"/proc/{tag}").exists():
            subprocess.run(["ip", "link", "del", f"kvh{tag}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def unavailable_reason() -> str | None:
    """Why the cluster cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (it creates a network namespace and a veth pair)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "ip netns is not available"
    if not Path(RAY).exists():
        return "needs Ray (pip install ray; the test extra has it)"
    remove_stale()
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    if HOST_IP in addrs:
        return f"{HOST_IP} is already assigned on this machine (another run of this test?)"
    return None


@dataclass
class Cluster:
    address: str  # the head's GCS, HOST:PORT
    netns: str
    temp_dir: str
    env: dict[str, str]

    def in_netns(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_nodes(cluster: Cluster, n: int, timeout_s: float = 60.0) -> None:
    code = (f"import ray, time; ray.init(address={cluster.address!r}, logging_level='ERROR')\n"
            f"t = time.monotonic()\n"
            f"while len([x for x in ray.nodes() if x['Alive']]) < {n} and time.monotonic() - t < {timeout_s}:\n"
            f"    time.sleep(0.2)\n"
            f"print(len([x for x in ray.nodes() if x['Alive']]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cluster.env,
                         timeout=timeout_s + 60)
    if out.stdout.strip().splitlines()[-1:] != [str(n)]:
        raise RuntimeError(f"the Ray cluster has not {n} nodes:\n{out.stdout}\n{out.stderr[-3000:]}")


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int = 1) -> Iterator[Cluster]:
    """The cluster (see the module docstring); yields once both nodes are alive."""
    tag = str(os.getpid())  # remove_stale() reads the owner's pid back from the names
    netns, veth_host, veth_ns = f"kvs-dp-{tag}", f"kvh{tag}", f"kvn{tag}"  # interface names: 15 bytes at most
    # a short path: Ray's Unix sockets live under it (108 bytes at most)
    temp_dir = tempfile.mkdtemp(prefix="kvray", dir="/tmp")
    # token auth (Ray's default) with a token of this run's own, handed to every node, driver and replica
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_worker_niceness": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        _run("ip", "link", "set", veth_ns, "netns", netns)
        _run("ip", "addr", "add", f"{HOST_IP}/30", "dev", veth_host)
        _run("ip", "link", "set", veth_host, "up")
        _run("ip", "netns", "exec", netns, "ip", "addr", "add", f"{NS_IP}/30", "dev", veth_ns)
        _run("ip", "netns", "exec", netns, "ip", "link", "set", veth_ns, "up")
        _run("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")
        port = _free_port(HOST_IP)
        cluster = Cluster(f"{HOST_IP}:{port}", netns, temp_dir, env)
        common = ["--num-cpus", str(cpus_per_node), "--disable-usage-stats", "--block",
                  "--object-store-memory", str(100 * 2**20), *WORKER_PORTS]
        for name, cmd in (("head", [RAY, "start", "--head", "--node-ip-address", HOST_IP, "--port", str(port),
                                    "--include-dashboard=false", "--temp-dir", temp_dir, *common]),
                          ("worker", cluster.in_netns(RAY, "start", "--address", cluster.address,
                                                      "--node-ip-address", NS_IP, *common))):
            log = open(Path(temp_dir) / f"{name}.out", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            if name == "head":
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with contextlib.suppress(OSError), socket.create_connection((HOST_IP, port), timeout=1):
                        break
                    if procs[0].poll() is not None:
                        raise RuntimeError((Path(temp_dir) / "head.out").read_text())
                    time.sleep(0.2)
        _wait_nodes(cluster, 2)
        yield cluster
    finally:
        for p in reversed(procs):
            _stop(p)
        for log in logs:
            log.close()
        subprocess.run(["ip", "link", "del", veth_host], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
