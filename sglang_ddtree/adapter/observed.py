"""A finished decode step of the online budget on its way to the host (``widths.py``): its
prediction and accepted depths copied without waiting for the device, its verify's device
time, its period; folded into the calibration and the cost table once all have landed.

The round cost ``T(bs, width)`` is measured as the step's period: the host time from its
``start`` to the next step's ``start``, when no other batch (a prefill, an idle pass) ran in
between, and when the step does not directly follow one: SGLang's overlap loop launches that
step, then waits for the other batch's results, so the step's period holds the other batch's
device time (on the K2.6 rank a 96-token request's TTFT is 15-20 decode rounds). That is
what a step costs the server whatever bounds it (the device, the host's launches, the
scheduler between steps, a wait on the previous step under overlap), where the round's own
device time leaves out the host's share between rounds (which a host-bound round, on a small
target, pays at every width, width 1 included). Under overlap the period of a step is the
device time of the step before it where the device bounds the server, so only a step that
ran as the one before it (the same width, drafted or not) is costed: a step after a change
would charge the old width's round to the new width (and, when the choice alternates, blur
the two widths' costs together).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .streams import current_stream
from .verify_clock import VerifyTime


@dataclass
class Observed:
    """One finished step, its device values on their way to the host."""

    bs: int
    width: int
    drafted: bool  # the drafter ran (a width-1 step may skip it)
    values: torch.Tensor | None  # [n_widths + 1, depth] float64: predicted reach per width, then
    # measured; None for a step that predicted nothing (no draft, or not its turn to predict)
    ready: torch.cuda.Event | None  # None: already on the host
    verify: VerifyTime | None = None  # its verify forward's device time (a timed table's)
    costed: bool = False  # its period is its own: ran as the step before it, no batch between
    period_ms: float | None = None  # start to the next start; None: another batch in between
    period_known: bool = False  # the next step has started (or a batch in between ended it)

    def landed(self) -> bool:
        return (
            self.period_known
            and (self.ready is None or self.ready.query())
            and (self.verify is None or self.verify.done())
        )

    @property
    def costs_its_width(self) -> bool:
        """Ran as its width is costed: width 1 without the drafter, a tree with it."""
        return self.drafted == (self.width > 1)

    def end_period(self, now: float | None, started: float) -> None:
        """The next step started at ``now`` (None: another batch ran in between)."""
        self.period_ms = None if now is None else (now - started) * 1e3
        self.period_known = True


class HostCopies:
    """Host copies of device values that do not wait for the device: into pinned buffers
    (non-blocking, with an event saying when the copy has landed), each buffer and its event
    reused once what it held has been read, so a predicting step allocates nothing."""

    def __init__(self):
        self._free: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def start(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``(host tensor, event)``; on the host already: ``values`` itself (the caller's own,
        a fresh tensor) and None."""
        if not values.is_cuda:
            return values, None
        host, event = self._take(values)
        host.copy_(values, non_blocking=True)
        event.record(current_stream())
        return host, event

    def give_back(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """``host`` has been read (its copy landed): its buffer may take the next copy."""
        if event is not None:
            self._free.append((host, event))

    def _take(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        if self._free and self._free[-1][0].shape == values.shape and self._free[-1][0].dtype == values.dtype:
            return self._free.pop()
        self._free.clear()  # of another shape: not reused
        return torch.empty(values.shape, dtype=values.dtype, pin_memory=True), torch.cuda.Event()
