"""Run control of a time-budgeted training run: the whole run's deadline and a stop that keeps the work.

A run under `timeout` gets killed with nothing written when its budget only covers the training loop (the pool,
the compiles, the final evaluation and the save came on top of it). Here the budget is the whole run's:

    deadline = start + budget;   steps = done + (time left - reserve) / step time,   capped by --steps

re-checked while training (the step time measured after the first steps can be optimistic), with `reserve` the
measured cost of the final evaluation plus the save. SIGINT / SIGTERM (`timeout -s INT`, Ctrl-C, a scheduler's
preemption) do not kill the process: the first asks the loop to stop at the next step boundary and still run
the final evaluation and the save; a second skips (the rest of) the evaluation; a third raises KeyboardInterrupt.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time


class Deadline:
    """The whole run's time budget from `start` (perf_counter seconds); budget None: no deadline."""

    def __init__(self, budget_s: float | None, start: float | None = None):
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"--time-budget {budget_s} must be > 0 seconds")
        self.budget_s = budget_s
        self.start = time.perf_counter() if start is None else start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()


def steps_in_budget(done: int, step_s: float, left_s: float, reserve_s: float, max_steps: int) -> int:
    """The total steps that fit: the `done` ones plus as many `step_s` steps as the time left after the reserve
    holds, at most max_steps, never fewer than done."""
    if step_s <= 0:
        raise ValueError(f"step time {step_s} s must be > 0")
    if math.isinf(left_s):
        return max(done, max_steps)
    return max(done, min(max_steps, done + int(max(0.0, left_s - reserve_s) // step_s)))


class GracefulStop:
    """Context manager counting SIGINT / SIGTERM instead of dying on them (the previous handlers come back on
    exit). `requested`: stop at the next step boundary; `urgent`: also skip the final evaluation."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.count = 0
        self._saved = {}

    @property
    def requested(self) -> bool:
        return self.count >= 1

    @property
    def urgent(self) -> bool:
        return self.count >= 2

    def _handle(self, signum, frame):
        self.count += 1
        name = signal.Signals(signum).name
        if self.count >= 3:
            raise KeyboardInterrupt(f"third {name}: giving up without saving")
        what = "stopping at the next step, then the final evaluation and the save" if self.count == 1 else \
            "skipping the final evaluation, saving"
        print(f"{name}: {what}", file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: nothing to count here
        for s in self.SIGNALS:
            self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}
        return False
