"""Start a tensor-parallel engine (size 2) whose worker fails, for test_tp_failures.py; prints what the parent saw.

    TP_FAULT=load|step|parent python tp_fault_script.py MODEL_DIR

The spawned worker imports this file as ``__mp_main__`` (``multiprocessing``'s spawn does that), so the patch
below runs in the worker only: ``load`` makes its shard fail to load, ``step`` makes its third step raise.
``parent``: the engine starts, prints its worker's pid and waits (for the test to kill this process).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

FAULT = os.environ.get("TP_FAULT", "")

if __name__ == "__mp_main__":  # a spawned child imports the parent's main module under this name: the worker
    import kvserve.executor.worker as worker
    from kvserve.worker.model_runner import ModelRunner

    if FAULT == "load":
        def broken_load(*args: Any, **kwargs: Any) -> Any:
            raise OSError("injected: this rank cannot read the checkpoint")

        worker.load_weights = broken_load  # type: ignore[assignment]
    elif FAULT == "step":
        execute = ModelRunner.execute_model
        steps = [0]

        def failing_step(self: ModelRunner, so: Any) -> Any:
            steps[0] += 1
            if steps[0] == 3:
                raise RuntimeError("injected: rank 1 fails its third step")
            return execute(self, so)

        ModelRunner.execute_model = failing_step  # type: ignore[method-assign]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tp_helpers import alive, descendants

    from kvserve import LLM, SamplingParams

    t0 = time.monotonic()
    if FAULT == "parent":  # start, say the worker's pid, then wait to be killed
        llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=2,
                  kv_cache_memory=0.01)
        print("WORKERS", llm.engine.executor.worker_pids, flush=True)  # type: ignore[attr-defined]
        time.sleep(600)
    try:
        llm = LLM(sys.argv[1], skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=2,
                  kv_cache_memory=0.01)
    except Exception as e:  # noqa: BLE001 - what the test checks
        print(f"START-ERROR {type(e).__name__}: {e}", flush=True)
    else:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], sp, use_tqdm=False)
        print("OUTPUTS", [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids), o.error) for o in outs], flush=True)
        try:
            llm.generate([[1, 2]], sp, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - what the test checks
            print(f"AFTER {type(e).__name__}", flush=True)
        llm.engine.close()
    time.sleep(0.5)
    left = [p for p in descendants(os.getpid()) if alive(p)
            and "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    print(f"LEFT {left} SECONDS {time.monotonic() - t0:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
