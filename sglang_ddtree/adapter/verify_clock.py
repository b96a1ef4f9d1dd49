"""The device time of a decode step's verify forward, for the online budget's timed cost table
(``budget/timed_costs.py``): the one share of a round that differs by verify width."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .streams import current_stream


class VerifyTime:
    """The device time of one step's verify forward: a pair of timing CUDA events around it
    (recorded on the stream, read once both have run: nothing waits for the device), or the
    host's clock where the forward runs on the host."""

    def __init__(self, spare: list | None, clock: Callable[[], float] | None = None):
        self._spare = spare  # None: the host's clock; else the events to reuse
        self._clock = clock  # the host's clock (None: ``time.perf_counter``; a simulation's own)
        self.began, self.ended = self._mark(), None

    def _mark(self):
        if self._spare is None:
            return (self._clock or time.perf_counter)()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(current_stream())
        return event

    def end(self) -> None:
        self.ended = self._mark()

    def done(self) -> bool:
        return self.ended is not None and (self._spare is None or self.ended.query())

    def ms(self) -> float | None:
        """The verify's device time (None: it did not end); the events go back to be reused."""
        if self.ended is None:
            return None
        if self._spare is None:
            return (self.ended - self.began) * 1e3
        ms = self.began.elapsed_time(self.ended)
        self._spare += [self.began, self.ended]
        return ms
