"""Tensor-parallel failures: a worker that cannot load its shard, one whose step raises, one SIGKILLed mid-run or
while idle. Each surfaces in the parent as an error (the requests in flight finish with ``error``, later ones are
refused), within seconds, and leaves no worker process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineDeadError, ExecutorDeadError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_helpers import alive, descendants, save_tiny  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "tp_fault_script.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tp-fail"), "qwen2")


def _script(model: Path, fault: str) -> str:
    env = {**os.environ, "TP_FAULT": fault, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(model)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def _seconds_and_leftovers(out: str) -> tuple[float, str]:
    m = re.search(r"LEFT (\[.*?\]) SECONDS ([0-9.]+)", out)
    assert m, out
    return float(m.group(2)), m.group(1)


def test_a_worker_that_cannot_load_its_shard_fails_the_start_cleanly(model: Path) -> None:
    out = _script(model, "load")
    assert re.search(r"START-ERROR ExecutorDeadError: tensor-parallel rank 1 \(pid \d+\): OSError: injected: this "
                     r"rank cannot read the checkpoint", out), out
    seconds, left = _seconds_and_leftovers(out)
    assert left == "[]" and seconds < 120, out


def test_a_worker_step_that_raises_fails_the_requests_in_flight(model: Path) -> None:
    out = _script(model, "step")
    m = re.search(r"OUTPUTS (.*)", out)
    assert m, out
    outputs = eval(m.group(1))  # noqa: S307 - the script printed a list of tuples
    assert [(reason, n < 16) for reason, n, _ in outputs] == [("error", True), ("error", True)], out
    assert all("RuntimeError: injected: rank 1 fails its third step" in error for _, _, error in outputs), out
    assert "AFTER ExecutorDeadError" in out
    seconds, left = _seconds_and_leftovers(out)
    assert left == "[]" and seconds < 120, out


def _engine_children() -> set[int]:
    """This process's live children other than multiprocessing's resource tracker (it serves every spawn)."""
    return {p for p in descendants(os.getpid()) if alive(p)
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()}


def test_a_worker_killed_mid_run_fails_its_requests_without_hanging(model: Path) -> None:
    before = _engine_children()
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=2,
              kv_cache_memory=0.01)
    engine = llm.engine
    (worker,) = engine.executor.worker_pids  # type: ignore[attr-defined]
    assert _engine_children() - before == {worker}
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(None, p, sp) for p in ([1, 2, 3], [4, 5, 6, 7], [8, 9])]
    for _ in range(3):
        engine.step()
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    finished = {}
    while len(finished) < len(ids) and time.monotonic() - t0 < 30:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert time.monotonic() - t0 < 30 and set(finished) == set(ids)
    for out in finished.values():
        assert out.outputs[0].finish_reason == "error" and 0 < len(out.outputs[0].token_ids) < 200
        assert out.error is not None and "tensor-parallel rank 1" in out.error
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
        engine.add_request(None, [1, 2], sp)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
    engine.close()
    assert not alive(worker) and _engine_children() - before == set()


def test_a_worker_killed_while_idle_is_noticed_before_the_next_request(model: Path) -> None:
    before = _engine_children()
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=2,
              kv_cache_memory=0.01)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4
    (worker,) = llm.engine.executor.worker_pids  # type: ignore[attr-defined]
    woken: list[bool] = []
    llm.engine.executor.wakeup = lambda: woken.append(True)  # (the server's loop sets this)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not woken and time.monotonic() < deadline:
        time.sleep(0.05)
    assert woken, "the executor did not notice its worker's death"
    with pytest.raises(ExecutorDeadError, match=rf"tensor-parallel rank 1 \(pid {worker}\) exited \(exit code -9\)"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    llm.engine.close()
    assert _engine_children() - before == set()


def test_workers_exit_when_the_engine_process_is_killed(model: Path) -> None:
    env = {**os.environ, "TP_FAULT": "parent", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(model)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"WORKERS \[(\d+)\]", line)
        assert m, line
        worker = int(m.group(1))
        assert alive(worker)
        proc.kill()  # SIGKILL: no exit handler runs; the worker sees its pipe close
        proc.wait(10)
        deadline = time.monotonic() + 20
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "the worker outlived the engine process"
    finally:
        if proc.poll() is None:
            proc.kill()


class _FailOn:
    """A logits processor that raises for requests whose first prompt token is ``token`` (rank 0 only, after the
    step's collectives)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, logits: object, requests: list[object]) -> None:
        if any(r.prompt_token_ids[0] == self.token for r in requests):  # type: ignore[attr-defined]
            raise ValueError("injected: a logits processor fails")

    def release(self, request_ids: object) -> None:
        pass


def test_a_rank_0_failure_after_the_collectives_fails_only_that_step(model: Path) -> None:
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=2,
              kv_cache_memory=0.01)
    llm.engine.runner.logits_processors.add(_FailOn(7))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bad = llm.generate([[7, 8, 9]], sp, use_tqdm=False)[0]
    assert bad.outputs[0].finish_reason == "error" and "injected: a logits processor fails" in (bad.error or "")
    good = llm.generate([[1, 2, 3], [4, 5]], sp, use_tqdm=False)  # the ranks are still in step
    assert [len(o.outputs[0].token_ids) for o in good] == [6, 6] and llm.engine.dead_error is None
    one = LLM(str(model), skip_tokenizer_init=True, dtype="float32", num_threads=1, kv_cache_memory=0.01)
    assert [o.outputs[0].token_ids for o in good] == [o.outputs[0].token_ids
                                                      for o in one.generate([[1, 2, 3], [4, 5]], sp, use_tqdm=False)]
    llm.engine.close()
