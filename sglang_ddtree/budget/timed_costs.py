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
cell's next re-probe. A trusted cell not measured for ``reprobe_after`` of its row's rounds (its
timed ones: ``StepWidths`` times one :meth:`settled` round in a few) is cleared and probed
again: costs move with the context length and the load, and a width
priced out by rounds that were slow then is measured anew (at 0fc9c47, four stalled tree
rounds priced every tree of bs 2 at 53-56 ms and the row ran width 1 for the rest of the call).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from .online import RoundCostTable, scaled_past_largest

FLOOR_ROUNDS = 2  # a rest measured in this many rounds of a row bounds the larger rows' (rest_floors)


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
        self._startup = self.startup.tolist()  # read per round as Python floats (no numpy scalars)
        self.probe_after, self.trust_after = probe_after, trust_after
        self.reprobe_after, self.max_probe_steps = reprobe_after, max_probe_steps
        rows, columns = self.ms.shape
        # Every median the costs read, in one array (``_cells`` gathers a row's in one step):
        # the cells' (rows x widths), then the pooled excesses' and the rests' (rows x kinds).
        self._medians = np.zeros(rows * columns + 4 * rows)
        self._pooled_at, self._rest_at = rows * columns, rows * columns + 2 * rows  # their offsets
        # the verify's device time over the replay
        self.cells = _Excesses((rows, columns), window, self._medians[: self._pooled_at])
        # the same per row, of the trees' rounds and width 1's
        self.pooled = _Excesses((rows, 2), window, self._medians[self._pooled_at : self._rest_at])
        # the period less the verify, per row and kind
        self.rest = _Excesses((rows, 2), window, self._medians[self._rest_at :])
        self._floor = 0.05 * self.startup  # the least a cell costs
        self.cell_source = np.full((rows, columns), -1)  # the row a cell reads; -1: pooled
        self.pooled_source = np.repeat(np.arange(rows)[:, None], 2, axis=1)
        self.rest_source = self.pooled_source.copy()  # likewise for the rest (fewer rounds: costed ones)
        self.row_rounds = np.zeros(rows, dtype=np.int64)
        self._row_rounds = [0] * rows  # the same, read and counted per round as Python ints
        # The row's count of rounds at each cell's last round (or at its probe's giving up).
        self.last_round = np.zeros((rows, columns), dtype=np.int64)
        self.probe_steps = np.zeros((rows, columns), dtype=np.int64)  # steps given to probing a cell
        self.reprobes = np.zeros(rows, dtype=np.int64)  # cells cleared to be probed again, per row
        self.probed_steps = np.zeros(rows, dtype=np.int64)  # steps the row ran a probe's width, in all
        self._columns = np.arange(columns)
        self._kind_of = [self._kind(w) for w in self.widths]  # per column
        self._kinds = np.array(self._kind_of)
        # The cells a probe may still ask for (not trusted, not given up), and their number
        # per row, kept as rounds, probes and clearings move them: a step whose row has none is
        # not probed at the cost of one lookup (a row whose open cells cannot win is checked).
        self._open = np.ones((rows, columns), dtype=bool)
        self._open_count = [columns] * rows
        # A step reads a row's cells up to three times (the probe's floors and rates, the
        # choice); they change only when an observed round moves a median or a source (the
        # table's ``version``), and only the rows a step asks for are computed again.
        self._cells_memo: dict[int, tuple[int, np.ndarray]] = {}
        # Where each row's costs read their medians (``_slots``): moved only with the structure.
        self._slots_memo: dict[int, tuple[int, np.ndarray]] = {}
        # Per row, the first round at which a cell can be stale (``observe`` looks no sooner).
        self._stale_from = [reprobe_after] * rows

    def row_costs(self, bs: int) -> np.ndarray:
        """``[widths]`` read only: the row's own array until its costs change (no copy a step)."""
        cells, largest = self._cells(self._row(bs)), self.batch_sizes[-1]
        return cells if bs <= largest else scaled_past_largest(cells, bs, largest)

    def _cells(self, row: int) -> np.ndarray:
        """``[widths]`` the row's costs (read only: shared until the table's next version)."""
        memo = self._cells_memo.get(row)
        if memo is not None and memo[0] == self.version:
            return memo[1]
        excess, rest = self._medians[self._slots(row)]  # the module docstring's order
        cells = np.maximum(self.startup[row] + (excess + rest), self._floor[row])
        cells.flags.writeable = False
        self._cells_memo[row] = (self.version, cells)
        return cells

    def cost_floors(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``([widths] ms, [widths] bool)`` for a row: the least each width can cost, and which
        widths their own rounds price. The least: no less than any narrower width its own
        rounds price (a wider step does all a narrower one does; 0 below the first), nor than
        the rest of its kind (a width costs its verify plus that rest, and a verify takes no
        less than no time: on a round bound by the host, such as the trained pair's, a narrow
        tree saves nothing of the ~4 ms every tree pays). The rest: the row's own once trusted;
        before, the least measured in this row or a smaller one (:meth:`rest_floors`). Not the
        replays: on a MoE the served tokens can route cheaper than the replays' spread ids."""
        priced = self.cells.rounds[row] >= self.trust_after
        narrower = np.maximum.accumulate(np.where(priced, self._cells(row), 0.0))
        return np.maximum(narrower, self.rest_floors(row)[self._kinds]), priced

    def rest_floors(self, row: int) -> np.ndarray:
        """``[kinds]`` the least the rest of a round of each kind (trees, width 1) can cost in
        ``row``: the row's own median once trusted; else the least median of this row and the
        smaller ones with ``FLOOR_ROUNDS`` rounds of that kind (a round's work besides its
        verify does not shrink as the batch grows); else 0. Why not only the row's own: a
        width-1 probe runs ``trust_after`` steps, the first after a tree (its period not its
        own), so no row ever trusted a width-1 rest, every row's width 1 could win at 0 ms, and
        every batch size the server reached probed it: on the pair's real draws
        (``lab/bench/online_budget_sim.py --trace``) 1-2% of its tokens a second at c = 4-32.
        The least of the medians of two or more rounds keeps one stalled round from raising it."""
        rounds, medians = self.rest.rounds[: row + 1], self.rest.median[: row + 1]
        measured = np.where(rounds >= FLOOR_ROUNDS, medians, np.inf).min(axis=0)
        borrowed = np.where(np.isfinite(measured), measured, 0.0)
        return np.where(rounds[row] >= self.trust_after, medians[row], borrowed)

    def _slots(self, row: int) -> np.ndarray:
        """``[2, widths]``: where in the medians each width of ``row`` reads what it costs over
        its replay: its verify's excess (its cell's, or the nearest trusted row's, else the row's
        pooled excess of its kind) and the row's shared rest of its kind."""
        memo = self._slots_memo.get(row)
        if memo is not None and memo[0] == self.structure:
            return memo[1]
        pooled = self._kind_slots(self.pooled, self.pooled_source, row, self._pooled_at)
        rest = self._kind_slots(self.rest, self.rest_source, row, self._rest_at)
        sources = self.cell_source[row]
        own = sources * len(self.widths) + self._columns
        slots = np.stack([np.where(sources >= 0, own, pooled[self._kinds]), rest[self._kinds]])
        self._slots_memo[row] = (self.structure, slots)
        return slots

    def _rest_known(self, row: int, kind: int) -> bool:
        """Whether ``row`` prices ``kind`` with a rest measured somewhere (width 1: or the trees')."""
        kinds = (kind, self._TREE) if kind == self._WIDTH1 else (kind,)
        return any(self.rest.rounds[self.rest_source[row, k], k] for k in kinds)

    def _kind_slots(self, shares: _Excesses, sources: np.ndarray, row: int, at: int) -> np.ndarray:
        """``[kinds]``: where a row's pooled share of each kind is (``shares`` at ``at`` in the
        medians), in the row ``sources`` names; a width 1 measured nowhere carries the trees'."""
        tree = at + 2 * sources[row, self._TREE] + self._TREE
        source = sources[row, self._WIDTH1]
        width1 = at + 2 * source + self._WIDTH1 if shares.rounds[source, self._WIDTH1] else tree
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
        if self._row_rounds[row] < self.probe_after or not self._open_count[row]:
            return None
        wanted = self._open[row]  # not trusted, not given up
        if could_win is not None:
            wanted = wanted & could_win(*self.cost_floors(row))
        column = int(wanted.argmax())  # the first wanted, if any
        if not wanted[column]:
            return None
        self.probe_steps[row, column] += 1
        self.probed_steps[row] += 1
        if self.probe_steps[row, column] == self.max_probe_steps:  # given up: retried like a stale cell
            self.last_round[row, column] = self._row_rounds[row]
            self._set_open(row, column, False)
        return self.widths[column]

    def _set_open(self, row: int, column: int, open_: bool) -> None:
        if self._open[row, column] != open_:
            self._open[row, column] = open_
            self._open_count[row] += 1 if open_ else -1
            self._restructured()  # what a probe asks for changed

    def settled(self, bs: int, width: int) -> bool:
        """Whether a round of ``width`` at ``bs`` would only refine medians already trusted: the
        row past the start of its probes, the round's cell and its row's own rest of its kind
        trusted (the row's pooled excess of the kind holds every round the cell does), or an
        eager batch, which prices nothing. Such rounds need not all be timed
        (``StepWidths.time_every``); any other round is, so probes, trust and the borrowing
        between rows come as when every round is."""
        if bs > self.batch_sizes[-1]:
            return True
        row, column = self._row(bs), self._column(width)
        return (
            self._row_rounds[row] >= self.probe_after
            and self.cells.rounds[row, column] >= self.trust_after
            and self.rest.rounds[row, self._kind_of[column]] >= self.trust_after
        )

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
        if ms is not None and not (0 < ms < math.inf):
            return
        row, column = self._row(bs), self._column(width)
        kind = self._kind_of[column]
        if ms is None and not self._rest_known(row, kind):
            return  # a verify priced against no rest at all would undercut every costed width
        excess = verify_ms - self._startup[row][column]
        # a cost reads one cell (or pooled excess) and one rest: it moved by no more than these
        moved = self._add_cell(row, column, excess)
        if ms is not None:
            moved += self._add_shared(self.rest, self.rest_source, row, kind, ms - verify_ms)
        moved += self._add_shared(self.pooled, self.pooled_source, row, kind, excess)
        self._drifted(moved)  # 0: every cost the table gives is as it was
        rounds = self._row_rounds[row] = self._row_rounds[row] + 1
        self.row_rounds[row] = rounds
        if rounds == self.probe_after:  # the row's probes start
            self._restructured()
        self.last_round[row, column] = rounds
        if rounds >= self._stale_from[row]:
            self._clear_stale(row)

    def _add_cell(self, row: int, column: int, excess: float) -> float:
        """One round's verify excess into its cell; how far its median moved."""
        rounds, moved = self.cells.add(row, column, excess)
        if rounds == self.trust_after:  # trusted now: rows read it, no probe asks for it
            self._choose_cell_sources(column)
            self._set_open(row, column, False)
        return moved

    def _add_shared(
        self, shares: _Excesses, sources: np.ndarray, row: int, kind: int, excess: float
    ) -> float:
        """One round into a row's pooled share of ``kind``; how far its median moved."""
        rounds, moved = shares.add(row, kind, excess)
        if rounds == 1 and kind == self._WIDTH1:  # width 1 reads its own share from now on
            self._restructured()
        if rounds == FLOOR_ROUNDS and shares is self.rest:
            # the rest floors of this row and the larger ones read it from now on (rest_floors):
            # its median can stand below the floor they had by more than this round moved it
            self._restructured()
        if rounds == self.trust_after:
            self._choose_shared_sources(shares, sources, kind)
        return moved

    def _clear_stale(self, row: int) -> None:
        """Trusted cells of ``row`` with no round for ``reprobe_after`` of its rounds, and
        probes given up as long ago: cleared, to be probed again (the module docstring says why).
        Runs once the row's rounds reach the first round at which a cell can be stale (a cell
        measured from now on has its last round now or later)."""
        now = self._row_rounds[row]
        given_up = self.probe_steps[row] >= self.max_probe_steps
        measured = (self.cells.rounds[row] >= self.trust_after) | given_up
        stale = measured & (now - self.last_round[row] >= self.reprobe_after)
        for column in np.flatnonzero(stale):
            self.cells.clear(row, column)
            self.probe_steps[row, column] = 0
            self.reprobes[row] += 1
            self._choose_cell_sources(int(column))
            self._set_open(row, int(column), True)
        kept = measured & ~stale
        oldest = int(self.last_round[row][kept].min()) if kept.any() else now
        self._stale_from[row] = oldest + self.reprobe_after

    def _choose_cell_sources(self, column: int) -> None:
        """Where each row reads the excess of ``column``: itself once trusted, else the nearest
        trusted row (the smaller on a tie), else -1 (the pooled excess)."""
        self.cell_source[:, column] = _nearest(self.cells.rounds[:, column] >= self.trust_after, fallback=-1)
        self._restructured()

    def _choose_shared_sources(self, shares: _Excesses, sources: np.ndarray, kind: int) -> None:
        """Where each row reads a pooled share of ``kind`` (the verify's excess, or the rest):
        like cells, itself once trusted, else the nearest trusted row, else itself (0 before
        any round). Recomputed when a row becomes trusted, not per lookup."""
        rows = np.arange(len(self.batch_sizes))
        sources[:, kind] = _nearest(shares.rounds[:, kind] >= self.trust_after, fallback=rows)
        self._restructured()

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
    """Per slot (``shape``): the last ``window`` excesses, their median and how many there were.
    Each slot keeps its window twice, in arrival order (which one leaves next) and sorted (the
    median is read off the middle; one insertion and one removal a round, not a sort)."""

    def __init__(self, shape: tuple[int, int], window: int, medians: np.ndarray):
        self.windows = [[deque(maxlen=window) for _ in range(shape[1])] for _ in range(shape[0])]
        self._sorted: list[list[list[float]]] = [[[] for _ in range(shape[1])] for _ in range(shape[0])]
        self.median = medians.reshape(shape)  # a view: written through to the table's medians
        self.rounds = np.zeros(shape, dtype=np.int64)
        self._rounds = self.rounds.tolist()  # the same, counted per round as Python ints

    def add(self, row: int, column: int, excess: float) -> tuple[int, float]:
        """Record one excess: the slot's count of rounds after it, and how far its median moved."""
        window, ordered = self.windows[row][column], self._sorted[row][column]
        if len(window) == window.maxlen:
            del ordered[bisect.bisect_left(ordered, window[0])]
        window.append(excess)
        bisect.insort(ordered, excess)
        median = _median(ordered)
        moved = abs(median - float(self.median[row, column]))
        self.median[row, column] = median
        rounds = self._rounds[row][column] = self._rounds[row][column] + 1
        self.rounds[row, column] = rounds
        return rounds, moved

    def clear(self, row: int, column: int) -> None:
        self.windows[row][column].clear()
        self._sorted[row][column].clear()
        self.median[row, column] = 0.0
        self.rounds[row, column] = self._rounds[row][column] = 0


def _median(ordered: list[float]) -> float:
    """The median of a sorted list, as ``statistics.median`` gives it (the mean of the middle two
    of an even count)."""
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _nearest(trusted: np.ndarray, fallback) -> np.ndarray:
    """Per row, the nearest row where ``trusted`` holds (itself when it does; the smaller on a
    tie), else ``fallback`` (a scalar or a per-row array)."""
    rows = np.arange(trusted.shape[0])
    hits = np.flatnonzero(trusted)
    if hits.size == 0:
        return np.broadcast_to(np.asarray(fallback), rows.shape).copy()
    return hits[np.argmin(np.abs(hits[None, :] - rows[:, None]), axis=1)]
