"""The online budget's two decisions of a step, kept per batch size (``adapter/widths.py`` asks
for them at the batch size of the table's row, at every step that does not repeat the last
one's): which width a measured table asks to probe first, and the chooser's width.

Each is kept while what it read moves less than could change it: the costs and the expected
drafts within the decision's slack (``slack.py``), the table's structure, the chooser's current
width and margin. A kept decision is the one made anew would be (``tests/test_budget_host_work.py``
runs both). Under load a batch's size changes at most steps (a request ends, a prefill brings it
back), so every batch size keeps its own: a size that comes back finds them as it left them.
"""

from __future__ import annotations

import math

import numpy as np

from .online import RoundCostTable, WidthChooser
from .slack import Kept, unwinnable_slack
from .timed_costs import TimedCostTable


class KeptDecisions:
    """A step's probe and width on one cost table (made anew for another table)."""

    def __init__(self, chooser: WidthChooser, table: RoundCostTable):
        self.chooser, self.table = chooser, table
        self._unprobed = getattr(table, "unprobed", None)  # a measured table's probes
        self._timed = isinstance(table, TimedCostTable)
        self._choices: dict[int, Kept] = {}  # per batch size: its last choice, and what it read
        self._no_probes: dict[int, Kept | None] = {}  # per batch size: its last check that found none
        # The table's drift up to which the last step's decisions hold as they stand (-inf after
        # a probe: a probe is asked for at every step): ``StepWidths`` keeps them as long.
        self.drift_bound = -math.inf

    def decide(self, bs: int, accepted: np.ndarray) -> tuple[int, bool]:
        """This step's width, and whether a measured table asked for it as a probe."""
        probed = self.probe(bs, accepted)
        if probed is not None:
            self.drift_bound = -math.inf
            return probed, True
        width = self.choose(bs, accepted)
        bound = self._choices[bs].drift_bound
        if self._unprobed is not None:
            bound = min(bound, self._no_probes[bs].drift_bound)
        self.drift_bound = bound
        return width, False

    def probe(self, bs: int, accepted: np.ndarray) -> int | None:
        """The width a measured table asks for first (None: the chooser decides); a timed
        table only for widths that could win at their least possible cost. A check that found
        none is kept while the costs drift less than could make one worth it."""
        if self._unprobed is None or self.holds(self._no_probes.get(bs), bs, accepted):
            return None
        checked = []  # what the check weighed, if it came to the costs
        if not self._timed:
            width, slack = self._unprobed(bs), math.inf  # probes until every cell is: structure
        else:
            width = self._unprobed(bs, lambda *floors: self._could_win(bs, accepted, floors, checked))
            slack = unwinnable_slack(*checked[0]) if checked else math.inf
        weighed = checked[0][1:3] if checked else ()  # the costs and floors the check read
        self._no_probes[bs] = Kept(bs, self.table, accepted, slack, costs=weighed) if width is None else None
        return width

    def _could_win(self, bs: int, accepted: np.ndarray, floors: tuple, checked: list) -> np.ndarray:
        """The chooser's check of a probe's widths; what it weighed goes to ``checked`` (the
        slack of a check that found none)."""
        could = self.chooser.could_win(bs, accepted, *floors)
        checked.append((accepted + bs, self.table.row_costs(bs), *floors, could))
        return could

    def choose(self, bs: int, accepted: np.ndarray) -> int:
        """The chooser's width, kept while the costs and expected drafts move less than could
        change it and nothing else it reads moves (the table's structure, its current width
        and margin)."""
        kept, chooser = self._choices.get(bs), self.chooser
        if self.holds(kept, bs, accepted) and kept.value == (chooser.current, chooser.switch_margin):
            return chooser.current
        width = chooser.choose(bs, accepted)
        self._choices[bs] = Kept(
            bs, self.table, accepted, chooser.slack(), (width, chooser.switch_margin), chooser.last_costs()
        )
        return width

    def holds(self, kept: Kept | None, bs: int, accepted: np.ndarray) -> bool:
        return kept is not None and kept.holds(bs, self.table, accepted)
