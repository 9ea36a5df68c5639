"""The executor: how the engine runs its model, on one process or on tensor-parallel ranks (vLLM's word).

    LLMEngine ──SchedulerOutput──▶ Executor.execute_model ──▶ ModelRunnerOutput
                                     │
         UniProcExecutor             │ today's ModelRunner, in this process
         MultiprocExecutor / Ray     │ rank 0's ModelRunner in this process, ranks 1..N-1 in workers

The engine talks to the runner only through this interface for what every rank must do (a step, the
start-up prefill probe); what only rank 0 holds (the sampler's logits processors, the swap-bandwidth probe,
KV export for features refused under tensor parallelism) it reads from ``driver``, rank 0's runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.model_runner import ModelRunner


class Executor(ABC):
    """Runs steps on every rank of the model.

    Attributes:
        driver: rank 0's runner, in this process (it samples).
        wakeup: called from another thread when the executor dies while the engine is idle (the server's loop
            sets it, so that it notices at once); None: nobody to wake.
    """

    driver: ModelRunner
    wakeup: Callable[[], None] | None = None

    @property
    def world_size(self) -> int:
        """The tensor-parallel size (1: one process)."""
        return 1

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (``ModelRunner.execute_model``) on every rank; rank 0's output.

        Raises:
            ExecutorDeadError: a rank died or the ranks fell out of step (no further step can run).
            Exception: whatever rank 0's runner raised after the step's collectives (the engine fails the step's
                requests and goes on).
        """

    @abstractmethod
    def measure_prefill_speed(self, num_tokens: int) -> float:
        """Tokens/s of one dummy prefill forward on every rank together (``ModelRunner.measure_prefill_speed``).

        Raises:
            ExecutorDeadError: as ``execute_model``.
        """

    def measure_copy_bandwidth(self) -> float:
        """Bytes/s of a swap round trip of rank 0's blocks (every rank swaps its own share in parallel, so rank
        0's rate over its bytes is the step's)."""
        return self.driver.measure_copy_bandwidth()

    @abstractmethod
    def forget_requests(self, request_ids: list[str]) -> None:
        """Drop the per-request state of finished requests whose ids no executed step reported (the engine skips
        the runner on steps with nothing to compute)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise ``ExecutorDeadError`` when a rank has died (cheap, never blocks)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and leave the process group (idempotent)."""


class UniProcExecutor(Executor):
    """One process: the engine's own ``ModelRunner``, unchanged."""

    def __init__(self, runner: ModelRunner) -> None:
        self.driver = runner

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute_model(so)

    def measure_prefill_speed(self, num_tokens: int) -> float:
        return self.driver.measure_prefill_speed(num_tokens)

    def forget_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.driver.generators.pop(request_id, None)
        self.driver.logits_processors.release(request_ids)

    def check_health(self) -> None:
        """(One process: alive while this code runs.)"""

    def shutdown(self) -> None:
        """(Nothing to stop.)"""
