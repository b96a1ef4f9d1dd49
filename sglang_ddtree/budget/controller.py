"""The online budget as the worker drives it: two calls per decode step.

    width = budget.choose(reach)          # before the verify: reach [bs, B + 1, depth]
    ...verify and accept at `width`...
    budget.record(accept_lens, round_ms)  # after: what the target accepted, how long it took

``reach`` is ``tree/expected_accept.reach_by_depth`` of the step's draft top-k at the largest
captured width ``B + 1``. ``choose`` reads a ``[n_widths, depth]`` slice of it on the host (one
small copy per step); ``record`` folds the accepted lengths into the per-depth calibration and
the measured time into the cost table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..tree.expected_accept import reach_at_widths
from .calibration import DepthCalibration, reach_counts
from .online import RoundCostTable, WidthChooser


class OnlineBudget:
    def __init__(
        self,
        widths: Sequence[int],
        cost: RoundCostTable,
        depth: int,
        calibration: DepthCalibration | None = None,
        switch_margin: float = 0.03,
    ):
        self.chooser = WidthChooser(widths, cost, switch_margin)
        self.cost = cost
        self.calibration = calibration or DepthCalibration(depth)
        self._chosen: tuple[int, np.ndarray] | None = None  # (bs, reach of the chosen tree)
        self.history: dict[int, int] = {}  # width -> steps it served

    @property
    def widths(self) -> tuple[int, ...]:
        return self.chooser.widths

    def choose(self, reach: torch.Tensor) -> int:
        """The verify width for this step, from the batch's ``reach`` ``[bs, B + 1, depth]``."""
        bs, rows, _ = reach.shape
        if self.widths[-1] > rows:
            raise ValueError(f"reach covers widths up to {rows}, the largest candidate is {self.widths[-1]}")
        totals = reach_at_widths(reach, self.widths).to("cpu", torch.float64).numpy()  # [n_widths, depth]
        width = self.chooser.choose(bs, self.calibration.calibrated(totals))
        self._chosen = (bs, totals[self.widths.index(width)])
        self.history[width] = self.history.get(width, 0) + 1
        return width

    def record(self, accept_lens: torch.Tensor, round_ms: float | None = None) -> None:
        """What the step chosen last accepted (``[bs]`` accepted drafts) and took."""
        if self._chosen is None:
            raise RuntimeError("record() without a choose() before it")
        bs, predicted = self._chosen
        self._chosen = None
        self.calibration.update(reach_counts(accept_lens, self.calibration.depth), predicted)
        if round_ms is not None:
            self.cost.observe(bs, self.chooser.current, round_ms)
