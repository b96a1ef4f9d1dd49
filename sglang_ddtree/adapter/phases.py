"""Host time per step of a round, for finding where a round's time goes (debugging:
``SGLANG_DDTREE_PHASE_TIMES=N`` logs the means every ``N`` rounds).

On a small model a decode round is bound by the host: Python and kernel launches, not
GPU work. The CUDA work of a step is asynchronous, so the host time of a step is what it
costs the round unless the step synchronises (then its time includes the GPU's wait,
which shows up as one outsized step). ``between rounds`` is the host time from the end of
one round to the start of the next: the scheduler's share. While a torch profiler records,
each step is also a ``torch.profiler.record_function`` range, so its trace groups the kernels
by step (otherwise the range is skipped: it costs a few microseconds a phase).

Off (the default), a phase is a shared no-op context: nothing is timed or recorded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict

import torch

logger = logging.getLogger("sglang_ddtree")

_OFF = contextlib.nullcontext()
BETWEEN = "between rounds"
IDLE_GAP_S = 0.05  # a longer gap between rounds is the server idling, not the scheduler's cost


def timed(name: str):
    """A worker method timed as phase ``name`` of its round (the worker's ``phase``)."""

    def wrap(step):
        @functools.wraps(step)
        def timed_step(worker, *args, **kwargs):
            with worker.phase(name):
                return step(worker, *args, **kwargs)

        return timed_step

    return wrap


class _Phase:
    __slots__ = ("_timer", "_name", "_range", "_began")

    def __init__(self, timer: RoundPhases, name: str):
        self._timer, self._name = timer, name

    def __enter__(self):
        self._range = None
        if torch.autograd._profiler_enabled():
            self._range = torch.profiler.record_function(f"ddtree.{self._name}")
            self._range.__enter__()
        self._began = time.perf_counter()

    def __exit__(self, *exc):
        self._timer.totals[self._name] += time.perf_counter() - self._began
        if self._range is not None:
            self._range.__exit__(*exc)
        return False


class RoundPhases:
    def __init__(self, interval: int, is_logging_rank: bool):
        self.interval = interval if is_logging_rank else 0
        self.totals: dict[str, float] = defaultdict(float)
        self.rounds = 0
        self._round_began = 0.0
        self._last_round_end: float | None = None

    def __call__(self, name: str):
        return _Phase(self, name) if self.interval else _OFF

    def start_round(self) -> None:
        if not self.interval:
            return
        self._round_began = time.perf_counter()
        if self._last_round_end is not None and self._round_began - self._last_round_end < IDLE_GAP_S:
            self.totals[BETWEEN] += self._round_began - self._last_round_end

    def end_round(self) -> None:
        if not self.interval:
            return
        end = time.perf_counter()
        self.totals["round"] += end - self._round_began
        self._last_round_end = end
        self.rounds += 1
        if self.rounds % self.interval == 0:
            # asked for explicitly (a debugging variable): shown whatever the server's --log-level
            logger.warning("DDTREE phase host us/round: %s", self.means_us())
            self.totals.clear()

    def means_us(self) -> dict[str, float]:
        n = self.interval if self.rounds % self.interval == 0 else self.rounds % self.interval
        return {name: round(1e6 * total / n, 1) for name, total in self.totals.items()}
