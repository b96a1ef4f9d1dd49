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
smallest captured batch size that holds it, so it costs what that size costs.

:class:`WidthChooser` adds hysteresis: it leaves the current width only for one at least
``switch_margin`` faster, so estimates that wobble around a tie do not flap between graphs.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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

    @classmethod
    def from_function(cls, batch_sizes: Sequence[int], widths: Sequence[int], cost, **kw) -> RoundCostTable:
        """A table of ``cost(bs, width)`` at every captured batch size and width."""
        return cls(batch_sizes, widths, [[cost(b, w) for w in widths] for b in batch_sizes], **kw)

    def __call__(self, bs: int, width: int) -> float:
        row = self._row(bs)
        cost = float(self.ms[row, self._column(width)])
        largest = self.batch_sizes[-1]
        # Past the largest captured size the step runs eagerly; assume it grows with bs.
        return cost * bs / largest if bs > largest else cost

    def _cell(self, bs: int, width: int, ms: float) -> tuple[int, int, float] | None:
        """Where a measured round belongs, and its cost as that cell counts it (``None``
        for a measurement that is not a positive finite time)."""
        if not (ms > 0 and math.isfinite(ms)):
            return None
        largest = self.batch_sizes[-1]
        return self._row(bs), self._column(width), ms * largest / bs if bs > largest else ms

    def _row(self, bs: int) -> int:
        if bs < 1:
            raise ValueError("batch size must be >= 1")
        return min(bisect.bisect_left(self.batch_sizes, bs), len(self.batch_sizes) - 1)

    def _column(self, width: int) -> int:
        try:
            return self.widths.index(int(width))
        except ValueError:
            raise ValueError(f"width {width} has no measured cost (widths {self.widths})") from None


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

    def unprobed(self, bs: int) -> int | None:
        """The smallest width whose cost at ``bs`` is not measured yet (None: all are)."""
        row = self._row(bs)
        for column, width in enumerate(self.widths):
            if self.counts[row, column] < self.probes:
                return width
        return None

    def observe(self, bs: int, width: int, ms: float) -> None:
        cell = self._cell(bs, width, ms)
        if cell is None:
            return
        row, column, ms = cell
        seen = self.counts[row, column]
        if seen >= self.probes:
            self.ms[row, column] += self.refine_decay * (ms - self.ms[row, column])
            return
        self.ms[row, column] = ms if seen == 0 else min(self.ms[row, column], ms)
        self.counts[row, column] = seen + 1


class TimedCostTable(RoundCostTable):
    """A table timed at start-up (graph replays of the forwards, ``adapter/width_graphs.py``),
    refined by the rounds the server runs. A replay times the forwards only; a round adds its
    own work (the tree step, mask, accept, commit, the scheduler between steps), about the
    same at every tree width of a batch size. So a row learns one excess over the replays for
    all its tree widths, the median of its last ``window`` measured excesses (from whichever
    tree width served them), and a tree width costs its replay plus that excess: the
    differences between widths come from the replays, the level from the rounds served.

    Why one excess a row and not a cost a cell: a cell that followed its own rounds was priced
    out by a few stalled periods and, no longer chosen, never measured again (at 06a9d4f on
    the K2.6 rank, width 9 at bs 8 cost 33.8 ms after three rounds against its 14.0 ms replay,
    and the server ran widths 1 and 3 there). A median over a row's rounds ignores stalls
    that are rare; stalls that are common are part of every round, whatever its width.

    A row trusts its own excess from ``trust_after`` rounds on; before, it borrows the excess
    of the nearest row that has that many (the round's own work changes slowly with the
    batch size), or none. A batch size the server passes through in a couple of steps (a pass
    draining) would otherwise be priced by one or two periods, stalled or not: at 92783de the
    row of bs 4 carried 35 ms over its replays after two rounds.

    A row whose own excess priced the trees out runs width 1 from then on and would never
    measure a tree again, whatever the trees' rounds would cost now: after ``forget_after``
    width-1 rounds in a row with no tree round between, the row forgets its trees' excess and
    borrows again (the trees are measured anew where they win under the borrowed excess; a
    row whose trees really cost that much loses ``trust_after`` rounds in that many). At 0fc9c47
    on the K2.6 rank four tree rounds of bs 2 put its excess at 44 ms (widths 2-17 at 53-56 ms
    against replays of 8-12 ms and 1-4 ms of excess in every other row), and the row ran width 1
    for the rest of the call.

    Width 1 runs no drafter and no tree step (``adapter/widths.py``): its rounds keep an excess
    of their own, and before any is measured width 1 carries the trees' excess, an upper bound
    that can be several times its real cost where a round's host work dominates (a small
    target). Left there, width 1 would never be chosen and never measured: once a row has
    served ``probe_after`` tree rounds, :meth:`unprobed` asks for ``probes`` width-1 rounds."""

    _TREE, _WIDTH1 = 0, 1

    def __init__(
        self,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        ms,
        probes: int = 3,
        probe_after: int = 8,
        window: int = 16,
        trust_after: int = 4,
        forget_after: int = 64,
    ):
        super().__init__(batch_sizes, widths, ms)
        if probes < 1 or probe_after < 0 or not 1 <= trust_after <= window or forget_after < 1:
            raise ValueError("probes >= 1, probe_after >= 0, 1 <= trust_after <= window, forget_after >= 1")
        self.startup = self.ms.copy()
        self.probes, self.probe_after, self.trust_after = probes, probe_after, trust_after
        self.forget_after = forget_after
        rows = len(self.batch_sizes)
        self.excesses = [(deque(maxlen=window), deque(maxlen=window)) for _ in range(rows)]
        self.excess = np.zeros((rows, 2))  # the medians of ``excesses``: tree, width 1
        self.rounds = np.zeros((rows, 2), dtype=np.int64)
        self.source = np.repeat(np.arange(rows)[:, None], 2, axis=1)  # the row each reads its excess from
        self.width1_run = np.zeros(rows, dtype=np.int64)  # width-1 rounds since the row's last tree round
        self.forgotten = np.zeros(rows, dtype=np.int64)  # times each row forgot its trees' excess

    def __call__(self, bs: int, width: int) -> float:
        row, column = self._row(bs), self._column(width)
        kind = self._kind(width)
        if not self.rounds[self.source[row, kind], kind]:
            kind = self._TREE  # width 1 measured nowhere near: the trees' excess, an upper bound
        cost = self.startup[row, column] + self._excess(row, kind)
        largest = self.batch_sizes[-1]
        return float(cost) * bs / largest if bs > largest else float(cost)

    def _excess(self, row: int, kind: int) -> float:
        return float(self.excess[self.source[row, kind], kind])

    def _choose_sources(self, kind: int) -> None:
        """Where each row reads its excess of ``kind``: itself once it has ``trust_after``
        rounds, else the nearest row that has (the smaller on a tie), else itself (0 before
        any round). Recomputed when a row becomes trusted, not per lookup (the choice looks up
        every width each step)."""
        rows = np.arange(len(self.batch_sizes))
        trusted = np.flatnonzero(self.rounds[:, kind] >= self.trust_after)
        if trusted.size == 0:
            self.source[:, kind] = rows
            return
        nearest = trusted[np.argmin(np.abs(trusted[None, :] - rows[:, None]), axis=1)]
        self.source[:, kind] = np.where(self.rounds[:, kind] >= self.trust_after, rows, nearest)

    def rows_served(self) -> np.ndarray:
        """Per row: whether any round has been measured in it."""
        return self.rounds.sum(axis=1) > 0

    def unprobed(self, bs: int) -> int | None:
        """1 while the row of ``bs`` has served enough tree rounds and too few width-1 rounds
        to know width 1's own cost; None otherwise (the chooser decides)."""
        if self.widths[0] != 1:
            return None
        row = self._row(bs)
        if self.rounds[row, self._TREE] >= self.probe_after and self.rounds[row, self._WIDTH1] < self.probes:
            return 1
        return None

    def observe(self, bs: int, width: int, ms: float) -> None:
        cell = self._cell(bs, width, ms)
        if cell is None:
            return
        row, column, ms = cell
        kind = self._kind(width)
        window = self.excesses[row][kind]
        window.append(ms - self.startup[row, column])
        self.excess[row, kind] = statistics.median(window)
        self.rounds[row, kind] += 1
        if self.rounds[row, kind] == self.trust_after:  # the trusted rows changed
            self._choose_sources(kind)
        self.width1_run[row] = self.width1_run[row] + 1 if kind == self._WIDTH1 else 0
        if self.width1_run[row] >= self.forget_after and self.rounds[row, self._TREE] >= self.trust_after:
            self._forget_trees(row)

    def _forget_trees(self, row: int) -> None:
        """The row's trees borrow their excess again (the class docstring says why)."""
        self.excesses[row][self._TREE].clear()
        self.excess[row, self._TREE] = 0.0
        self.rounds[row, self._TREE] = 0
        self.width1_run[row] = 0
        self.forgotten[row] += 1
        self._choose_sources(self._TREE)

    def _kind(self, width: int) -> int:
        return self._WIDTH1 if width == 1 else self._TREE


def candidate_widths(max_budget: int) -> tuple[int, ...]:
    """The verify widths an online budget chooses from, for a server whose largest tree has
    ``max_budget`` nodes: with the largest width ``W = max_budget + 1``, every power of two
    below ``W`` (1 is no speculation, ``2**k`` a tree of ``2**k - 1`` nodes) and ``W``.

    Why powers of two: a verify width ``w`` puts ``bs * w`` tokens through the target's
    GEMMs and ``H * w`` query rows (``H``: the rank's attention heads, 8 on a TP-8 Kimi K2.6
    rank) through the MLA verify attention, whose kernel tiles 32 rows, each tile reading the
    whole prefix. On the K2.6 rank width 9 (72 rows) takes three tiles, width 8 (64 rows)
    two: at bs 32 and a 4096-token prefix the prefix pass took 0.109 ms a layer at width 8
    and 0.230 ms at width 9 (bench_results/verify_attention_sglang_h200_54f535d.md). A power
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
        self.last_scores: list[WidthScore] = []

    def choose(self, bs: int, expected_accepted: Sequence[float]) -> int:
        """The width for the next step of ``bs`` requests, given the batch's calibrated
        expected accepted drafts at each of ``widths``."""
        scores = score_widths(bs, self.widths, expected_accepted, self.cost)
        self.last_scores = scores
        best = best_score(scores)
        if self.current is None or self.current not in self.widths:
            self.current = best.width
            return self.current
        current = scores[self.widths.index(self.current)]
        if best.tokens_per_ms > current.tokens_per_ms * (1.0 + self.switch_margin):
            self.current = best.width
        return self.current


def _check_increasing(what: str, values: Sequence[int]) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{what} must be a non-empty increasing sequence")
