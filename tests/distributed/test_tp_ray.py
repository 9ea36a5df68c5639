"""``--distributed-executor-backend ray``: the tensor-parallel worker as a Ray actor on a local cluster (started on
127.0.0.1 for the engine and shut down with it), through ``kvserve generate``: the same text as one process, and no
process of the cluster or the worker outlives the command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_helpers import alive, descendants, save_tiny  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (Path(sys.executable).parent / "ray").exists(), reason="needs Ray")]

REPO = Path(__file__).resolve().parents[2]


def test_ray_workers_generate_the_same_text_and_leave_nothing(tmp_path: Path) -> None:
    model = save_tiny(tmp_path / "tiny", "qwen2", tokenizer_of="smollm2-135m-instruct")
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "generate", "--model", str(model), "--dtype", "float32",
           "--num-threads", "1", "--kv-cache-memory", "0.01", "--max-tokens", "12", "--ignore-eos",
           "--prompt", "The capital of France is", "--prompt", "def fibonacci(n):"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    one = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    proc = subprocess.Popen([*cmd, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= descendants(proc.pid)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    assert "tensor parallelism: 2 ranks (ray backend), 1 thread(s) each" in err
    assert out == one.stdout and out.count("12 tokens, finish_reason=length") == 2
    assert len(seen) >= 3  # the GCS, the raylet, the worker actor, ...
    deadline = time.monotonic() + 30
    while any(alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in seen if alive(p)], "processes of the local Ray cluster outlived the command"
