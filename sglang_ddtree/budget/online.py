"""The verify width per decode step: the one that commits the most tokens per millisecond.

A step of ``bs`` requests at verify width ``w`` (``w - 1`` tree nodes per request; ``w = 1``
is plain decoding) costs ``T(bs, w)`` ms and commits, per request, its accepted drafts plus
the bonus token, so the batch's rate is

    rate(w) = (E_accepted(w) + bs) / T(bs, w)

with ``E_accepted(w)`` the batch's calibrated expected accepted drafts at width ``w``
(``tree/expected_accept.py``, ``calibration.py``). One width serves the whole batch: the
target's verify CUDA graph is captured per width, not per request.

``T`` comes from a :class:`RoundCostTable`: timed rounds per captured batch size and width
(at start-up), refined by the rounds the server runs. A batch runs in the graph of the
smallest captured batch size that holds it, so it costs what that size costs. A table counts
its changes three ways: ``version`` moves at every change of a cost or of what a probe would
ask for; ``drift`` adds up how far the costs moved (no cost moved further since); ``structure``
moves at the changes a drift does not bound (which cells are priced or probed, where a row
reads its values). ``budget/slack.py`` turns them into how long a decision holds, and
``adapter/widths.py`` keeps its last choice, and that no probe was due, for as long.

Host work per step. The choice runs before every decode step, so what it costs is paid at every
round: a batch size's row is found through a dict (not a search over the rows), a width's
column likewise, and a row's costs are read as one array; nothing per step loops over the rows
or the widths in Python (``tests/test_budget_host_work.py`` counts it).

:class:`WidthChooser` adds hysteresis: it leaves the current width only for one at least
``switch_margin`` faster, so estimates that wobble around a tie do not flap between graphs.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .slack import choice_slack


class RoundCostTable:
    """``T(bs, width)`` in ms per captured batch size (rows) and width (columns): fixed (an
    injected table); the measured tables below refine themselves from the rounds served."""

    def __init__(self, batch_sizes: Sequence[int], widths: Sequence[int], ms):
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.widths = tuple(int(w) for w in widths)
        self.ms = np.array(ms, dtype=np.float64).reshape(len(self.batch_sizes), len(self.widths))
        _check_increasing("batch sizes", self.batch_sizes)
        _check_increasing("widths", self.widths)
        if not np.all(np.isfinite(self.ms) & (self.ms > 0)):
            raise ValueError("round costs must be positive and finite")
        self.version = 0  # moved by every change of a cost or a probe (a fixed table: none)
        self.structure = 0  # moved by the changes ``drift`` does not bound (budget/slack.py)
        self.drift = 0.0  # the sum of the costs' changes: no cost moved further since
        self._rows: dict[int, int] = {}  # batch size -> row, filled as sizes are seen
        self._columns_of = {width: column for column, width in enumerate(self.widths)}

    @classmethod
    def from_function(cls, batch_sizes: Sequence[int], widths: Sequence[int], cost, **kw) -> RoundCostTable:
        """A table of ``cost(bs, width)`` at every captured batch size and width."""
        return cls(batch_sizes, widths, [[cost(b, w) for w in widths] for b in batch_sizes], **kw)

    def __call__(self, bs: int, width: int) -> float:
        return float(self.row_costs(bs)[self._column(width)])

    def row_costs(self, bs: int) -> np.ndarray:
        """``[widths]``: every width's cost for a batch of ``bs`` (one lookup per step)."""
        return scaled_past_largest(self.ms[self._row(bs)], bs, self.batch_sizes[-1])

    def _cell(self, bs: int, width: int, ms: float) -> tuple[int, int, float] | None:
        """Where a measured round belongs, and its cost as that cell counts it (``None``
        for a measurement that is not a positive finite time)."""
        if not (ms > 0 and math.isfinite(ms)):
            return None
        largest = self.batch_sizes[-1]
        return self._row(bs), self._column(width), ms * largest / bs if bs > largest else ms

    def row_size(self, bs: int) -> int:
        """The batch size whose row prices a batch of ``bs`` (``bs`` itself past the largest).
        Every decision on the table is the same for the sizes a row prices (``adapter/widths.py``)."""
        largest = self.batch_sizes[-1]
        return self.batch_sizes[self._row(bs)] if bs <= largest else bs

    def _row(self, bs: int) -> int:
        row = self._rows.get(bs)
        if row is None:  # a batch size not seen yet: searched once (then one dict lookup a step)
            if bs < 1:
                raise ValueError("batch size must be >= 1")
            row = self._rows[bs] = min(bisect.bisect_left(self.batch_sizes, bs), len(self.batch_sizes) - 1)
        return row

    def _column(self, width: int) -> int:
        column = self._columns_of.get(width)
        if column is None:
            raise ValueError(f"width {width} has no measured cost (widths {self.widths})")
        return column

    def _drifted(self, change: float) -> None:
        """Costs moved by at most ``change`` ms (0: none moved)."""
        if change:
            self.version += 1
            self.drift += change

    def _restructured(self) -> None:
        self.version += 1
        self.structure += 1


class ProbedCostTable(RoundCostTable):
    """A table measured while serving, for servers with no graphs to time at start-up (the
    eager path): every cell starts unknown; :meth:`unprobed` names the width a batch of
    ``bs`` should run next until each of its row's cells has been measured ``probes``
    times. A probed cell keeps the fastest of its probes (a width's first round can carry
    one-time work), then follows the rounds it serves (exponentially weighted by
    ``refine_decay``)."""

    def __init__(
        self, batch_sizes: Sequence[int], widths: Sequence[int], probes: int = 2, refine_decay: float = 0.1
    ):
        super().__init__(batch_sizes, widths, np.ones((len(batch_sizes), len(widths))))
        if probes < 1:
            raise ValueError("probes must be >= 1")
        if not 0.0 < refine_decay <= 1.0:
            raise ValueError("refine_decay must lie in (0, 1]")
        self.probes, self.refine_decay = probes, refine_decay
        self.counts = np.zeros(self.ms.shape, dtype=np.int64)
        # Per row, the first column probed fewer than ``probes`` times (None: none), once looked
        # up; a row's entry goes when one of its counts moves (probes only).
        self._unprobed: dict[int, int | None] = {}

    def unprobed(self, bs: int) -> int | None:
        """The smallest width whose cost at ``bs`` is not measured yet (None: all are)."""
        row = self._row(bs)
        if row not in self._unprobed:
            short = np.flatnonzero(self.counts[row] < self.probes)
            self._unprobed[row] = int(short[0]) if short.size else None
        column = self._unprobed[row]
        return None if column is None else self.widths[column]

    def observe(self, bs: int, width: int, ms: float) -> None:
        cell = self._cell(bs, width, ms)
        if cell is None:
            return
        row, column, ms = cell
        seen, was = self.counts[row, column], float(self.ms[row, column])
        if seen >= self.probes:
            self.ms[row, column] += self.refine_decay * (ms - self.ms[row, column])
            self._drifted(abs(float(self.ms[row, column]) - was))
            return
        self.ms[row, column] = ms if seen == 0 else min(self.ms[row, column], ms)
        self.counts[row, column] = seen + 1
        self._unprobed.pop(row, None)
        self._restructured()  # a probe: its cell leaves its placeholder, the row's probes move on


def candidate_widths(max_budget: int) -> tuple[int, ...]:
    """The verify widths an online budget chooses from, for a server whose largest tree has
    ``max_budget`` nodes: with the largest width ``W = max_budget + 1``, every power of two
    below ``W`` (1 is no speculation, ``2**k`` a tree of ``2**k - 1`` nodes) and ``W``.

    Why powers of two: a verify width ``w`` puts ``bs * w`` tokens through the target's
    GEMMs and ``H * w`` query rows (``H``: the rank's attention heads, 8 on a TP-8 Kimi K2.6
    rank) through the MLA verify attention, whose kernel tiles 32 rows, each tile reading the
    whole prefix. On the K2.6 rank width 9 (72 rows) takes three tiles, width 8 (64 rows)
    two: at bs 32 and a 4096-token prefix the prefix pass took 0.109 ms a layer at width 8
    and 0.230 ms at width 9 (results/k26-rank_h200_verify_attention.md). A power
    of two fills whole attention tiles (and whole GEMM tiles), so a tree of ``2**k - 1``
    nodes costs what the chain of the same width costs; a width one past it pays a tile
    more for one node."""
    if max_budget < 1:
        raise ValueError("max_budget must be >= 1")
    largest = max_budget + 1
    powers_below = [1 << i for i in range(largest.bit_length()) if (1 << i) < largest]
    return (*powers_below, largest)


@dataclass(frozen=True)
class WidthScore:
    width: int
    expected_accepted: float  # the batch's, calibrated
    round_ms: float
    tokens_per_ms: float  # (expected_accepted + bs) / round_ms


def score_widths(
    bs: int, widths: Sequence[int], expected_accepted: Sequence[float], cost
) -> list[WidthScore]:
    """Every candidate width's expected committed tokens per ms for a batch of ``bs``."""
    if len(widths) != len(expected_accepted):
        raise ValueError("one expected accept count per width")
    scores = []
    for width, accepted in zip(widths, expected_accepted):
        round_ms = float(cost(bs, int(width)))
        scores.append(WidthScore(int(width), float(accepted), round_ms, (float(accepted) + bs) / round_ms))
    return scores


def best_score(scores: Sequence[WidthScore]) -> WidthScore:
    """The fastest width; on a tie the smaller one (cheaper, and ties are noise)."""
    return max(scores, key=lambda s: (s.tokens_per_ms, -s.width))


class WidthChooser:
    """Picks one verify width per step from the captured ``widths``, with hysteresis."""

    def __init__(self, widths: Sequence[int], cost, switch_margin: float = 0.03):
        self.widths = tuple(int(w) for w in widths)
        _check_increasing("widths", self.widths)
        if self.widths[0] < 1:
            raise ValueError("widths must be >= 1 (1 is plain decoding)")
        if switch_margin < 0:
            raise ValueError("switch_margin must be >= 0")
        self.cost = cost
        self.switch_margin = switch_margin
        self.current: int | None = None
        self._index = {width: index for index, width in enumerate(self.widths)}
        self._last: tuple[int, np.ndarray, np.ndarray] | None = None  # bs, accepted, round ms

    @property
    def cost(self):
        return self._cost

    @cost.setter
    def cost(self, table) -> None:
        self._cost = table
        self._columns = np.array([table.widths.index(w) for w in self.widths])  # ValueError: a width it lacks
        # the table's columns are the chooser's widths (as the online budget builds them): a
        # row of costs is read as it is, without picking its columns each step
        self._all_columns = tuple(table.widths) == self.widths

    def choose(self, bs: int, expected_accepted: Sequence[float]) -> int:
        """The width for the next step of ``bs`` requests, given the batch's calibrated
        expected accepted drafts at each of ``widths``: :func:`score_widths` and
        :func:`best_score` over the row's costs at once (the choice runs before every step)."""
        accepted = np.asarray(expected_accepted, dtype=np.float64)
        if accepted.shape != (len(self.widths),):
            raise ValueError("one expected accept count per width")
        round_ms = self._cost.row_costs(bs)
        if not self._all_columns:
            round_ms = round_ms[self._columns]
        rates = _rates(bs, accepted, round_ms)
        self._last = (bs, accepted, round_ms)
        best = int(rates.argmax())  # the first maximum: on a tie the smaller width
        current = self._index.get(self.current)
        if current is None or rates[best] > rates[current] * (1.0 + self.switch_margin):
            self.current = self.widths[best]
        return self.current

    def slack(self) -> float:
        """How far every cost of the last choice's row may move (ms) before :meth:`choose`, asked
        again with the same expected drafts, could leave the width it chose (``slack.py``)."""
        current = self._index.get(self.current)
        if self._last is None or current is None:
            return 0.0  # nothing to bound: kept only while nothing moves
        bs, accepted, round_ms = self._last
        return choice_slack(accepted + bs, round_ms, current, self.switch_margin)

    def last_costs(self) -> tuple[np.ndarray, ...]:
        """The costs the last choice read (its row's, ms), for how far it holds (``slack.py``)."""
        return () if self._last is None else (self._last[2],)

    def could_win(
        self, bs: int, expected_accepted: Sequence[float], floors: np.ndarray, priced: np.ndarray
    ) -> np.ndarray:
        """``[table widths]`` bool: the widths whose rate at their cost floor reaches the best
        rate among the priced widths (all, before any is priced). ``floors`` and ``priced`` are
        per width of the cost table (``TimedCostTable.cost_floors``)."""
        accepted = np.asarray(expected_accepted, dtype=np.float64)
        round_ms = self._cost.row_costs(bs)
        if self._all_columns:
            return _could_win(bs, accepted, round_ms, floors, priced)
        could, columns = np.ones(len(priced), dtype=bool), self._columns  # the table's other widths can
        could[columns] = _could_win(bs, accepted, round_ms[columns], floors[columns], priced[columns])
        return could

    @property
    def last_scores(self) -> list[WidthScore]:
        """The last choice's scores, as :func:`score_widths` gives them."""
        if self._last is None:
            return []
        bs, accepted, round_ms = self._last
        return [
            WidthScore(w, float(a), float(ms), (float(a) + bs) / float(ms))
            for w, a, ms in zip(self.widths, accepted, round_ms)
        ]


def _could_win(bs: int, accepted: np.ndarray, round_ms: np.ndarray, floors: np.ndarray, priced: np.ndarray):
    """Per width: whether its rate at its cost floor reaches the best priced rate (every width
    while none is priced)."""
    if not priced[priced.argmax()]:  # none priced (argmax: the first True, where there is one)
        return np.ones(len(priced), dtype=bool)
    best = np.maximum.reduce(_rates(bs, accepted, round_ms)[priced])  # .max(), without its wrapper
    with np.errstate(divide="ignore"):  # a floor of 0: no width priced below it
        return _rates(bs, accepted, floors) >= best


def _rates(bs: int, accepted: np.ndarray, round_ms: np.ndarray) -> np.ndarray:
    """Committed tokens per ms of each width: its accepted drafts plus the batch's bonus tokens."""
    return (accepted + bs) / round_ms


def scaled_past_largest(costs: np.ndarray, bs: int, largest: int) -> np.ndarray:
    """A row's costs for ``bs``: past the largest captured size the step runs eagerly, and its
    cost is assumed to grow with ``bs``."""
    return costs * (bs / largest) if bs > largest else costs.copy()


def _check_increasing(what: str, values: Sequence[int]) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{what} must be a non-empty increasing sequence")
