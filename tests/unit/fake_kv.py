"""A fake KV store for scheduler tests: what each device and host slot holds, as (token id, position).

It follows a ``SchedulerOutput`` exactly as the model runner does (swap out, swap in, copy-on-write, then
the forward's writes) and, before writing, asserts that every position a request will read holds that
request's own token: the property that makes cache hits, forks, copies, swaps and preemptions invisible
in the output.
"""

from __future__ import annotations

import random

from kvserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


class FakeKV:
    """Slot contents as (token id, position) on device and host, following the runner's order:
    swap out, swap in, copy-on-write, then the forward writes."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.device: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_host_blocks)]

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, copy-on-write, in the runner's order."""
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])

    def check_reads(self, s: ScheduledRequest) -> None:
        """Every position the row reads holds its request's own token."""
        r, table = s.request, s.block_table
        for t in range(s.num_computed_tokens):
            assert self.device[table[t // self.bs]][t % self.bs] == (r.all_token_ids[t], t), (r, t)

    def run(self, out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
        self.copy_blocks(out)
        ids, tokens = [], []
        for s in out.scheduled:
            r, table = s.request, s.block_table
            self.check_reads(s)
            for t in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                self.device[table[t // self.bs]][t % self.bs] = (r.all_token_ids[t], t)
            if s.sample:
                ids.append(r.request_id)
                tokens.append(rng.randint(0, 3))
        return ModelRunnerOutput(ids, [[t] for t in tokens])
