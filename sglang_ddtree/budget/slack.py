"""How far a row's round costs may drift before a decision made on them could change.

A measured cost table changes at almost every step (a timed table's medians move with each
served round), but by little, and the width a step chooses rarely hangs on that little: the
online budget keeps a decision until the costs have drifted past what could change it
(``adapter/widths.py``). Each table counts its ``drift``, the sum of the changes of every value
its costs read (``online.py``), so no cost has moved by more than the drift since. A decision
made at costs ``c`` holds for every ``c'`` with ``|c' - c| <= d`` at every width when:

* the choice (``WidthChooser.choose``, hysteresis ``m``): it keeps the current width ``k``
  while no width ``w`` reaches ``(1 + m)`` times its rate; at worst ``w``'s cost fell by ``d``
  and ``k``'s rose by ``d``, so it holds while ``T_w / (c_w - d) <= (1 + m) T_k / (c_k + d)``
  (``T``: the tokens a width commits, its expected accepted drafts plus the batch);
* a probe check that found no width worth probing (``WidthChooser.could_win``): every unpriced
  width ``u`` has a rate at its cost floor below the best priced width ``b``'s rate; a floor is
  a maximum of costs and of the row's rest, so it moves by at most ``d`` too, and the check
  holds while ``T_u / (f_u - d) < T_b / (c_b + d)``.

Solving each for ``d`` gives the slack (in ms); a decision is kept while the table's drift
since it stays within its slack, which is shrunk by a relative ``1e-6`` so that floating-point
rounding cannot make a kept decision differ from a fresh one.

The expected drafts move too (each landed prediction): a width's tokens ``T_w' = T_w (1 + e_w)``
with ``|e_w| <= eps`` give it the rate ``T_w / (c_w' / (1 + e_w))``, the old tokens over a cost
within ``(d + C eps) / (1 - eps)`` of ``c_w`` (``C``: the largest cost or floor the decision
read). So a decision also holds across new expected drafts while ``d <= slack (1 - eps) - C eps``.

Anything else a decision reads (the batch size, which cells are priced, which are open to a
probe, where a row reads its medians) is not bounded this way: its change moves the table's
``structure`` and drops every kept decision.
"""

from __future__ import annotations

import math

import numpy as np

SAFETY = 1e-6  # relative shrink of a slack (floating-point rounding is ~1e-16)


def choice_slack(tokens: np.ndarray, round_ms: np.ndarray, current: int, margin: float) -> float:
    """The drift (ms) below which the choice of width index ``current`` stands, its rate
    within ``(1 + margin)`` of every width's; ``tokens`` and ``round_ms`` per width."""
    keep = (1.0 + margin) * tokens[current]
    # width w switches in once tokens[w] / (round_ms[w] - d) > keep / (round_ms[current] + d)
    slack = (keep * round_ms - tokens * round_ms[current]) / (tokens + keep)
    slack[current] = math.inf  # no switch to itself
    return _shrunk(np.minimum.reduce(np.minimum(slack, round_ms)))  # and every cost stays > 0


def unwinnable_slack(
    tokens: np.ndarray, round_ms: np.ndarray, floors: np.ndarray, priced: np.ndarray, could: np.ndarray
) -> float:
    """The drift (ms) below which the widths that cannot win (``~could``: their rate at their
    floor below the best priced rate) still cannot; ``inf`` when every unpriced width could."""
    unwinnable = ~(priced | could)
    if not unwinnable[unwinnable.argmax()]:  # none (argmax: the first True, where there is one)
        return math.inf
    rates = np.where(priced, tokens / round_ms, -np.inf)
    best = int(rates.argmax())
    # an unpriced width u stays out while tokens[u] / (floors[u] - d) < tokens[b] / (round_ms[b] + d)
    slack = (tokens[best] * floors - tokens * round_ms[best]) / (tokens + tokens[best])
    return _shrunk(np.minimum.reduce(slack[unwinnable]))


def _shrunk(slack: float) -> float:
    return max(0.0, float(slack) * (1.0 - SAFETY))


class Kept:
    """A decision of the online budget (``value``) and what it was made from: it holds for a
    step of the same batch size on the same table while that table's structure stays and its
    costs, with the tokens the step expects (the expected drafts plus the batch), move no
    further than the decision's slack allows (the module docstring). ``costs``: the arrays of
    costs and floors the decision read (ms, as its row's costs are scaled)."""

    def __init__(self, bs: int, table, accepted: np.ndarray, slack: float, value=None, costs=()):
        self.bs, self.table, self.accepted, self.value = bs, table, accepted, value
        self.structure = table.structure
        self.slack, self.drift, self.costs = slack, table.drift, costs
        # a batch past the table's largest size scales its row's costs, and their drift, by bs / largest
        self.per_drift = max(1.0, bs / table.batch_sizes[-1])
        # the last expected drafts asked about, and how far the table's drift may go with them
        self._moved = (accepted, table.drift + slack / self.per_drift)

    def holds(self, bs: int, table, accepted: np.ndarray) -> bool:
        if not (bs == self.bs and table is self.table and table.structure == self.structure):
            return False
        if accepted is not self._moved[0]:  # new expected drafts (new ones are new arrays): once each
            self._moved = (accepted, self.drift + self._slack_left(accepted) / self.per_drift)
        return table.drift <= self._moved[1]

    @property
    def drift_bound(self) -> float:
        """The table's drift up to which this decision holds with the last expected drafts asked about."""
        return self._moved[1]

    def _slack_left(self, accepted: np.ndarray) -> float:
        """The slack left for the costs once the tokens moved from the decision's to ``accepted + bs``'s."""
        if self.slack == math.inf:  # nothing the decision weighed can change it
            return math.inf
        eps = float(np.maximum.reduce(np.abs((accepted + self.bs) / (self.accepted + self.bs) - 1.0)))
        largest = max((float(np.maximum.reduce(c)) for c in self.costs), default=0.0)
        if not (eps < 1.0 and math.isfinite(largest)):
            return -math.inf
        return self.slack * (1.0 - eps) - largest * eps * (1.0 + SAFETY)
