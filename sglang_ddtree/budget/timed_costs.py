"""The round cost table under CUDA graphs: timed graph replays at start-up, then what the
rounds served cost, per batch size and width.

A replay times the forwards only (the target's verify graph, the drafter's graph), on
inputs that capture left in the buffers with spread token ids (``adapter/width_graphs.py``).
A served round's period (its start to the next step's start) holds two shares:

* the **verify's device time**, timed with CUDA events around the verify forward: the one
  part of a round that differs by width, and on a MoE it follows the tokens served (they can
  route through fewer experts than the replays' spread ids do). It is learned per cell,
  ``(batch size row, width)``, as an excess over the cell's replay:

  * a cell's own excess, the median of its last ``window`` measured rounds, once it has
    ``trust_after`` of them;
  * before that, the excess of the nearest row whose cell of the same width is trusted;
  * with no such row, the pooled excess of the row's rounds of that kind (trees, or width 1),
    trusted likewise or borrowed from the nearest row;

* the **rest of the period** (the drafter, the tree step, accept and commit, the scheduler
  between steps), which every width of a kind pays alike: pooled per row and kind (the median
  of the row's last ``window`` rounds of trees, or of width 1), trusted or borrowed like the
  pooled excess. A width 1 measured nowhere carries the trees' shares (an upper bound: no
  drafter, no tree step).

A width costs its replay, plus its verify's excess, plus its row's shared rest.

Why the split. Until it each cell was priced by its own periods. On the trained pair (a
4-layer target, a round bound by the host) every tree width does the same host work, and a
width's periods followed the phase of the run it happened to be chosen in (ramp-up, arrivals,
drain) more than its own cost: at e835772, bs 1, width 64 was priced at 7.79 ms and width 65
at 5.67; the choice wandered among widths whose real costs differ by tenths of a millisecond,
and ``auto64`` made 0.715-0.924x the best fixed budget. Pooled over the row, the phase is shared by every width, and the widths differ
by what their own verify costs on the device, which the events measure without the host's
phase in it.

Why the verify per cell. With one excess a row the differences between widths came from the
replays alone, and on the K2.6 rank they were wrong in serving: at 099c64d, c=8, the table priced
width 8 at 14.82 ms and width 4 at 12.29 at bs 8 (their replays 13.9 and 11.4), the server ran
width 4 in 351 of 362 bs-8 steps, and yet its rounds took as long in wall time as the fixed
width-8 server's (24.95 against 24.61 ms a request-round) with 2.38 tokens a round against
2.69: 0.872x the fixed arm. That rank's greedy text is two tokens alternating, so its
served tokens route through few experts where the replays' spread ids route through many.
Only a width's own rounds say what it costs on the tokens served (its verify's device time,
since the split). Measured since, the rank's bs-8 widths cost what their replays said: width 4
12.39 and width 8 15.08 ms by their own periods (bad890e), 12.37 and 14.94 by the split
(40a3f9d); the c=8 cell's ratio to the fixed arm has moved with the requests' starts (0.872,
1.008, 1.126 in three calls, docs/gpu.md), not with the width.

Why medians and trust. A cell that followed its own last few rounds was priced out by a few
stalled periods and, no longer chosen, never measured again (06a9d4f, width 9 at bs 8: 33.8
ms after three rounds against a 14.0 ms replay). A median over ``window`` rounds outvotes
stalls that are rare; a cell with fewer than ``trust_after`` rounds borrows.

Which rounds price what. Every round's verify prices its cell and the row's pooled verify,
also a round whose period is not its own (it followed another width or another batch: under
overlap its period holds the round before it), since the events time its verify alone; only
a round whose period is its own adds to the rest. A row with no rest of the round's kind
measured anywhere (nor the trees', for width 1) prices nothing yet: its verify alone would
undercut every width whose rounds were costed.

Probes. Rounds measure only the widths the chooser runs, so once a row has served
``probe_after`` rounds, :meth:`unprobed` asks for every width whose cell is not trusted yet and
that could win at the least it can cost (:meth:`cost_floors`: the widths already priced, and
the row's rest), in width order, until it is: ``trust_after`` steps, the first included. On the
trained pair, whose rounds the host bounds, the rest floor keeps the narrow trees from being
probed at all (``bench/online_budget_sim.py``: the modelled pair's probe steps fell by
about a third). A probe not trusted after ``max_probe_steps`` steps is given up until the
cell's next re-probe. A trusted cell not measured for ``reprobe_after`` of its row's rounds is
cleared and probed again: costs move with the context length and the load, and a width
priced out by rounds that were slow then is measured anew (at 0fc9c47, four stalled tree
rounds priced every tree of bs 2 at 53-56 ms and the row ran width 1 for the rest of the call).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from .online import RoundCostTable, scaled_past_largest


class TimedCostTable(RoundCostTable):
    _TREE, _WIDTH1 = 0, 1

    def __init__(
        self,
        batch_sizes: Sequence[int],
        widths: Sequence[int],
        ms,
        probe_after: int = 8,
        window: int = 16,
        trust_after: int = 4,
        reprobe_after: int = 1024,
        max_probe_steps: int = 16,
    ):
        super().__init__(batch_sizes, widths, ms)
        if probe_after < 0 or not 1 <= trust_after <= window or reprobe_after < 1 or max_probe_steps < 1:
            raise ValueError(
                "probe_after >= 0, 1 <= trust_after <= window, reprobe_after >= 1, max_probe_steps >= 1"
            )
        self.startup = self.ms.copy()
        self.probe_after, self.trust_after = probe_after, trust_after
        self.reprobe_after, self.max_probe_steps = reprobe_after, max_probe_steps
        rows, columns = self.ms.shape
        self.cells = _Excesses((rows, columns), window)  # the verify's device time over the replay
        self.pooled = _Excesses((rows, 2), window)  # the same per row, of the trees' rounds and width 1's
        self.rest = _Excesses((rows, 2), window)  # the period less the verify, per row and kind
        self.cell_source = np.full((rows, columns), -1)  # the row a cell reads; -1: pooled
        self.pooled_source = np.repeat(np.arange(rows)[:, None], 2, axis=1)
        self.rest_source = self.pooled_source.copy()  # likewise for the rest (fewer rounds: costed ones)
        self.row_rounds = np.zeros(rows, dtype=np.int64)
        # The row's count of rounds at each cell's last round (or at its probe's giving up).
        self.last_round = np.zeros((rows, columns), dtype=np.int64)
        self.probe_steps = np.zeros((rows, columns), dtype=np.int64)  # steps given to probing a cell
        self.reprobes = np.zeros(rows, dtype=np.int64)  # cells cleared to be probed again, per row
        self.probed_steps = np.zeros(rows, dtype=np.int64)  # steps the row ran a probe's width, in all
        self._columns = np.arange(columns)
        self._kinds = np.array([self._kind(w) for w in self.widths])
        # A step reads a row's cells up to three times (the probe's floors and rates, the
        # choice); they change only when a round is observed.
        self._observed = 0  # rounds observed, a version of every row's cells
        self._cells_memo: dict[int, tuple[int, np.ndarray]] = {}
        # Per row, the round before which no cell can be stale (``_clear_stale``'s early return).
        self._stale_from = np.full(rows, reprobe_after, dtype=np.int64)

    def row_costs(self, bs: int) -> np.ndarray:
        return scaled_past_largest(self._cells(self._row(bs)), bs, self.batch_sizes[-1])

    def _cells(self, row: int) -> np.ndarray:
        """``[widths]`` the row's costs (read only: shared until the next observed round)."""
        memo = self._cells_memo.get(row)
        if memo is not None and memo[0] == self._observed:
            return memo[1]
        startup = self.startup[row]
        cells = np.maximum(startup + self._row_excess(row), 0.05 * startup)
        self._cells_memo[row] = (self._observed, cells)
        return cells

    def cost_floors(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``([widths] ms, [widths] bool)`` for a row: the least each width can cost, and which
        widths their own rounds price. The least: no less than any narrower width its own
        rounds price (a wider step does all a narrower one does; 0 below the first), nor than
        the row's own trusted rest of its kind (a width costs its verify plus that rest, and a
        verify takes no less than no time: on a round bound by the host, such as the trained
        pair's, a narrow tree saves nothing of the ~4 ms every tree pays). Not the replays: on
        a MoE the served tokens can route cheaper than the replays' spread ids."""
        priced = self.trusted()[row]
        narrower = np.maximum.accumulate(np.where(priced, self._cells(row), 0.0))
        rest = np.where(self.rest.rounds[row] >= self.trust_after, self.rest.median[row], 0.0)  # [kinds]
        return np.maximum(narrower, rest[self._kinds]), priced

    def _row_excess(self, row: int) -> np.ndarray:
        """``[widths]``: what each width of ``row`` costs over its replay: its verify's excess
        plus the row's shared rest (the module docstring's order)."""
        pooled = self._kind_shares(self.pooled, self.pooled_source, row)
        rest = self._kind_shares(self.rest, self.rest_source, row)
        sources = self.cell_source[row]
        own = self.cells.median[np.maximum(sources, 0), self._columns]
        return np.where(sources >= 0, own, pooled[self._kinds]) + rest[self._kinds]

    def _rest_known(self, row: int, kind: int) -> bool:
        """Whether ``row`` prices ``kind`` with a rest measured somewhere (width 1: or the trees')."""
        kinds = (kind, self._TREE) if kind == self._WIDTH1 else (kind,)
        return any(self.rest.rounds[self.rest_source[row, k], k] for k in kinds)

    def _kind_shares(self, shares: _Excesses, sources: np.ndarray, row: int) -> np.ndarray:
        """``[kinds]``: a row's pooled share per kind, read from the row ``sources`` names; a
        width 1 measured nowhere carries the trees' share."""
        tree = shares.median[sources[row, self._TREE], self._TREE]
        source = sources[row, self._WIDTH1]
        width1 = shares.median[source, self._WIDTH1] if shares.rounds[source, self._WIDTH1] else tree
        return np.array([tree, width1])

    def rows_served(self) -> np.ndarray:
        """Per row: whether any round has been measured in it."""
        return self.row_rounds > 0

    def trusted(self) -> np.ndarray:
        """``[rows, widths]``: the cells that cost their own rounds."""
        return self.cells.rounds >= self.trust_after

    def unprobed(self, bs: int, could_win: Callable | None = None) -> int | None:
        """The width a batch of ``bs`` should run to measure it (the smallest whose cell is
        not trusted, once the row has served ``probe_after`` rounds), or None: the chooser
        decides. Call once per step: it counts the steps given to each probe.

        ``could_win(floors, priced) -> [widths] bool`` (``WidthChooser.could_win`` on
        :meth:`cost_floors`), when given, leaves out the widths that cannot beat the best priced
        one even at their least possible cost: where every tree costs about what the widest
        does (a host-bound round), a probe of a narrow tree only gives up its tokens."""
        if bs > self.batch_sizes[-1]:
            return None  # an eager batch: its rounds are not the graphs' (observe)
        row = self._row(bs)
        if self.row_rounds[row] < self.probe_after:
            return None
        wanted = (self.cells.rounds[row] < self.trust_after) & (self.probe_steps[row] < self.max_probe_steps)
        if could_win is not None and wanted.any():
            wanted &= could_win(*self.cost_floors(row))
        if not wanted.any():
            return None
        column = int(np.flatnonzero(wanted)[0])
        self.probe_steps[row, column] += 1
        self.probed_steps[row] += 1
        if self.probe_steps[row, column] == self.max_probe_steps:  # given up: retried like a stale cell
            self.last_round[row, column] = self.row_rounds[row]
        return self.widths[column]

    def observe(self, bs: int, width: int, ms: float | None, verify_ms: float) -> None:
        """One served round: its verify forward's device time ``verify_ms`` and its period
        ``ms`` (None where the period is not the round's own: it followed another width or
        another batch; the verify's events time the verify alone either way, so every round
        prices its cell, and a probe is trusted after ``trust_after`` steps). A batch past the
        largest captured size runs eagerly, a cost of another kind than the graph its row
        times: at ede2f70 the K2.6 rank's bs-16 warm-up rounds (eager, 170-200 ms) entered the
        bs-8 row as 83-98 ms at widths 1, 2 and 4 (scaled by 8 / 16) and priced them out of
        the graphs they never ran in."""
        if bs > self.batch_sizes[-1] or not (0 <= verify_ms < math.inf):
            return
        if ms is not None and not (ms > 0 and math.isfinite(ms)):
            return
        row, column = self._row(bs), self._column(width)
        kind = self._kind(width)
        if ms is None and not self._rest_known(row, kind):
            return  # a verify priced against no rest at all would undercut every costed width
        self._observed += 1
        excess = verify_ms - self.startup[row, column]
        if self.cells.add(row, column, excess) == self.trust_after:
            self._choose_cell_sources(column)
        if ms is not None and self.rest.add(row, kind, ms - verify_ms) == self.trust_after:
            self._choose_shared_sources(self.rest, self.rest_source, kind)
        if self.pooled.add(row, kind, excess) == self.trust_after:
            self._choose_shared_sources(self.pooled, self.pooled_source, kind)
        self.row_rounds[row] += 1
        self.last_round[row, column] = self.row_rounds[row]
        self._clear_stale(row)

    def _clear_stale(self, row: int) -> None:
        """Trusted cells of ``row`` with no round for ``reprobe_after`` of its rounds, and
        probes given up as long ago: cleared, to be probed again (the module docstring says why).
        Runs after every observed round: it returns at once while no cell can be stale (a cell
        measured from now on has its last round now or later)."""
        now = self.row_rounds[row]
        if now < self._stale_from[row]:
            return
        given_up = self.probe_steps[row] >= self.max_probe_steps
        measured = self.trusted()[row] | given_up
        stale = measured & (now - self.last_round[row] >= self.reprobe_after)
        for column in np.flatnonzero(stale):
            self.cells.clear(row, column)
            self.probe_steps[row, column] = 0
            self.reprobes[row] += 1
            self._choose_cell_sources(int(column))
        kept = measured & ~stale
        oldest = self.last_round[row][kept].min() if kept.any() else now
        self._stale_from[row] = oldest + self.reprobe_after

    def _choose_cell_sources(self, column: int) -> None:
        """Where each row reads the excess of ``column``: itself once trusted, else the nearest
        trusted row (the smaller on a tie), else -1 (the pooled excess)."""
        self.cell_source[:, column] = _nearest(self.trusted()[:, column], fallback=-1)

    def _choose_shared_sources(self, shares: _Excesses, sources: np.ndarray, kind: int) -> None:
        """Where each row reads a pooled share of ``kind`` (the verify's excess, or the rest):
        like cells, itself once trusted, else the nearest trusted row, else itself (0 before
        any round). Recomputed when a row becomes trusted, not per lookup."""
        rows = np.arange(len(self.batch_sizes))
        sources[:, kind] = _nearest(shares.rounds[:, kind] >= self.trust_after, fallback=rows)

    def _kind(self, width: int) -> int:
        return self._WIDTH1 if width == 1 else self._TREE

    def summary(self) -> dict:
        """A timed table's cells that cost their own rounds, the cells cleared to be probed again,
        and the steps given to probes (each a step at a width the chooser did not pick), per row."""
        summary = {
            "own_cost_widths_by_bs": {
                bs: [w for w, own in zip(self.widths, cells) if own]
                for bs, cells, served in zip(self.batch_sizes, self.trusted(), self.rows_served())
                if served
            }
        }
        for name, counts in (("reprobes_by_bs", self.reprobes), ("probe_steps_by_bs", self.probed_steps)):
            if counts.any():
                summary[name] = {bs: int(n) for bs, n in zip(self.batch_sizes, counts) if n}
        return summary


class _Excesses:
    """Per slot (``shape``): the last ``window`` excesses, their median and how many there were."""

    def __init__(self, shape: tuple[int, int], window: int):
        self.windows = [[deque(maxlen=window) for _ in range(shape[1])] for _ in range(shape[0])]
        self.median = np.zeros(shape)
        self.rounds = np.zeros(shape, dtype=np.int64)

    def add(self, row: int, column: int, excess: float) -> int:
        """Record one excess; the slot's count of rounds after it."""
        window = self.windows[row][column]
        window.append(excess)
        self.median[row, column] = statistics.median(window)
        self.rounds[row, column] += 1
        return int(self.rounds[row, column])

    def clear(self, row: int, column: int) -> None:
        self.windows[row][column].clear()
        self.median[row, column] = 0.0
        self.rounds[row, column] = 0


def _nearest(trusted: np.ndarray, fallback) -> np.ndarray:
    """Per row, the nearest row where ``trusted`` holds (itself when it does; the smaller on a
    tie), else ``fallback`` (a scalar or a per-row array)."""
    rows = np.arange(trusted.shape[0])
    hits = np.flatnonzero(trusted)
    if hits.size == 0:
        return np.broadcast_to(np.asarray(fallback), rows.shape).copy()
    return hits[np.argmin(np.abs(hits[None, :] - rows[:, None]), axis=1)]
