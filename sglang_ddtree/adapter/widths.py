"""The online budget in the eager round: the verify width of every decode step
(``--speculative-ddtree-budget auto``, docs/online-budget.md).

The server keeps its largest verify width ``W`` (``speculative_num_draft_tokens``: the KV
reservation, the round's write window); each step builds a tree of ``width - 1 <= W - 1``
nodes and verifies exactly ``width`` slots per request, in the first ``width`` columns of
the window. Width 1 verifies the root alone; a step that also skips the drafter
(:attr:`StepWidths.skips_draft`) runs as a decoding step (``decode_step.py``: no tree step, no
accept walk, no KV move; root-only trees, :meth:`StepWidths.root_only`, only where a request
feature reads them). Every width is exact (the accept walk and the commit plan only ever see
the tree that ran).

Per step, two calls from the worker:

    width = widths.start(bs)          # before drafting: from what earlier steps showed
    ...draft (the proposals are watched), build, verify, accept, commit at `width`...
    widths.finish(accept_lens)        # after: what this step predicted, accepted and cost

``start`` must not wait for the device, so it chooses from the last landed prediction, scaled
to this step's batch size and calibrated (``expected_drafts.py``). ``finish`` starts copying
this step's prediction and its accepted depths to the host; a later ``start`` folds them in
once the copy has landed.

A width-1 step without the drafter predicts nothing: the last prediction is kept as it was
(the drafter's confidence on the running text, which a step that did not draft says nothing
new about; decaying it toward zero would make width 1 confirm itself), the calibration is not
touched (the step predicted no depth), and the next choice scales the kept prediction to the
batch size of that step, so a batch that shrinks brings the tree back through the cost table.
Some steps draft at width 1 anyway: the first (nothing predicted yet), and those that refresh
the prediction (``refresh.py``: once half the batch is new, and after runs without a draft
that start short and double while width 1 holds); none counts as a width-1 round cost.

The round cost ``T(bs, width)`` is measured as the step's period (``observed.py`` says which
periods count).
Under CUDA graphs the table is timed (``budget/timed_costs.py``): the step also times its
verify forward on the device (CUDA events around it, read once they have run), the share of
the period that differs by width; the rest of the period every width of the row pays alike.
A step whose cell and row are trusted already is timed one in ``TIME_EVERY``; every other step
(probes, trust still building) is timed.
Each batch-size row first runs every width a few times (:class:`ProbedCostTable`), then
follows the rounds it serves. ``$SGLANG_DDTREE_BUDGET_COST_TABLE`` replaces it with a fixed
table (tests, debugging), which the measured rounds do not change.

Host work. ``start`` and ``finish`` run at every decode step, on the host, so a host-bound round
pays them at every width, and none of it grows with the table's rows or the candidate widths
(``tests/test_budget_host_work.py`` counts it). Between a server's rounds the host's caches go
cold, so each call a step makes costs a microsecond or more (``lab/bench/online_budget_host.py
--cold``). So a step that follows a step of its row (the table's row that prices its batch size:
the decisions are the same for all its sizes, ``_decide``) with nothing landed that moved the
prediction, the table's structure, or its costs past what the last decisions allow asks none
(``start``); kept per batch size, the expected drafts until a prediction lands, and the
decisions while what they read moves less than could change them (``budget/decisions.py``); a
step neither timed nor predicting leaves nothing behind to fold; the prediction is a fixed
number of device operations, launched without a synchronisation into reused pinned buffers
(``observed.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from ..budget import (
    ProbedCostTable,
    RoundCostTable,
    TimedCostTable,
    WidthChooser,
    candidate_widths,
    reach_counts,
)
from ..budget.decisions import KeptDecisions
from ..config import DDTreeConfigError, budget_cost_table, online_budget_pinned, online_budget_refresh_every
from ..tree.expected_accept import reach_totals_at_widths
from ..tree.types import Trees
from . import width_summary
from .expected_drafts import ExpectedDrafts
from .observed import HostCopies, Observed
from .refresh import FIRST_REFRESH, REFRESH_EVERY, Refresh
from .step_history import StepHistory
from .verify_clock import VerifyTime

logger = logging.getLogger("sglang_ddtree")

# Rows of the measured cost table: a batch costs what its row (the next power of two) cost.
COST_BATCH_SIZES = tuple(1 << i for i in range(9))
# Drafted steps per prediction (about 40 small device operations: one graph replay under CUDA
# graphs, else a launch each); acceptance moves slowly, and each step's batch size scales the
# last prediction anyway. A landed prediction is folded in (the calibration, the expected drafts,
# the kept decisions checked): over half of ``start`` at a steady batch size. Settled rounds
# timed: one in ``TIME_EVERY`` (two events, their read, the medians' update, the choices it moves
# made again); rounds that probe or build trust are all timed. 32 and 8 against 16 and 8 moved
# the simulated policy by at most 0.02 of the best fixed choice (``online_budget_sim.py``). A
# settled cell's median moves slowly (the context grows by a few tokens a round), and timing it
# one round in 16 rather than 8 cuts a third of ``start``'s mean on the host (the medians'
# updates and the choices they make again: results/online-budget_cpu_host_time_p32_t*.md).
PREDICT_EVERY = 32
TIME_EVERY = 16
LOG_EVERY = 1000  # steps between the online budget's own log lines (when no stats interval is set)


class StepWidths:
    def __init__(
        self,
        widths,
        cost: RoundCostTable,
        depth: int,
        make_head: Callable[[int], object],
        refresh_every: int = REFRESH_EVERY,
        first_refresh: int = FIRST_REFRESH,
        predict_every: int = PREDICT_EVERY,
        time_every: int = TIME_EVERY,
        log_every: int = 0,
        clock: Callable[[], float] | None = None,
        pinned: bool = False,
    ):
        self.widths = tuple(widths)
        self._clock = clock  # the host's clock in seconds (None: ``time.perf_counter``; a simulation's own)
        self.chooser = WidthChooser(self.widths, cost)
        self._history = StepHistory()
        # The row's batch size (``RoundCostTable.row_size``) whose next step repeats the last
        # one's decisions (``start``), and its width, and each batch size's row size once
        # looked up: set with the table (``cost``).
        self.cost = cost
        self.depth = depth
        self.expected = ExpectedDrafts(self.widths, depth)
        self.heads = {width: make_head(width) for width in self.widths}
        self.steps = 0
        self._pending: deque[Observed] = deque()
        self._copies = HostCopies()  # the predictions' pinned host buffers, reused
        self._step: tuple[int, int, float] | None = None  # (bs, width, start time)
        self._log_probs: torch.Tensor | None = None
        self.predict_every = predict_every
        self.time_every = time_every
        self._settled_untimed = 0  # settled steps since the last timed one
        self.log_every = log_every  # 0: the stats line carries the summary, or nobody asked
        self._drafted_unpredicted = 0  # drafted steps since the last prediction
        self.skips_draft = False  # this step: width 1, no drafter forward, no tree step
        self.steps_without_draft = 0
        self._predicting = False  # a drafted step's prediction is kept or on its way to the host
        self.refresh = Refresh(refresh_every, first_refresh)  # when a width-1 step drafts anyway
        self.pinned = pinned  # debugging: every step runs the widest tree, whatever was chosen
        # Under CUDA graphs (``width_graphs.py``): the target's pair per width, swapped per step,
        # the drafter graph's kept log-probs and the prediction's graph (``kept_prediction.py``).
        self.runners = None
        self.kept = None
        self.prediction = None
        self._last: tuple[Observed, float] | None = None  # the last finished step, its start
        # The last finished step's (width, drafted); None after another batch (or none yet): the
        # next step is costed only when it ran as this says.
        self._last_kind: tuple[int, bool] | None = None
        # A timed table prices a width by its verify's device time: CUDA events (reused) on a GPU.
        # (A simulation's clock times its verify on that clock.)
        self._spare_events: list | None = [] if torch.cuda.is_available() and clock is None else None
        self._verify: VerifyTime | None = None
        self._times = False  # this step's verify is timed
        self._settled = False  # this step's cell is settled (timed tables)
        self.decided_anew = False  # this step asked its decisions (they did not repeat the last step's)

    @classmethod
    def like(cls, head, max_budget: int, depth: int) -> StepWidths:
        """One tree head per candidate width, each keeping ``head``'s top-k (a best-first
        tree of fewer nodes is the same from more candidates)."""

        def make_head(width: int):
            return type(head)(
                trees_backend=head.backend,
                budget=width - 1,
                width=width,
                block=head.block,
                k=head.k,
                last_position=head.last_position,
            )

        widths, refresh_every = candidate_widths(max_budget), online_budget_refresh_every(REFRESH_EVERY)
        return cls(widths, cost_table(widths), depth, make_head, refresh_every, pinned=online_budget_pinned())

    @property
    def cost(self) -> RoundCostTable:
        return self._cost

    @cost.setter
    def cost(self, table: RoundCostTable) -> None:
        if tuple(table.widths) != self.widths:  # a kept decision's slack reads both as one
            raise ValueError(f"a cost table of widths {table.widths} for the widths {self.widths}")
        # what each step asks of the table, looked up once here rather than at every step
        self._cost = table
        self.measured = isinstance(table, (ProbedCostTable, TimedCostTable))  # not injected
        self._timed = isinstance(table, TimedCostTable)
        self.decisions = KeptDecisions(self.chooser, table)  # the probe and the width, kept
        self._leave_steady()
        # the table's row_size per batch size: a dict lookup a step, not a call
        self._row_sizes: dict[int, int] = {}

    def use_cost_table(self, table: RoundCostTable) -> None:
        self.cost = self.chooser.cost = table

    # --- the step ----------------------------------------------------------------------

    def start(self, bs: int) -> int:
        """The verify width of this step for a batch of ``bs`` requests."""
        now = (self._clock or time.perf_counter)()
        if self._last is not None:  # (``_end_period`` checks it too; most steps leave no record: no call)
            self._end_period(now)
        if self._pending and self._pending[0].landed():
            self._absorb_landed()
        size = self._row_sizes.get(bs) or self._row_sizes.setdefault(bs, self._cost.row_size(bs))
        steady = size == self._steady
        if steady:  # nothing the last step's decisions read has moved: they would repeat
            width, probed = self._steady_width, False
        else:
            width, probed = self._decide(size)
        self.decided_anew = not steady
        history = self._history
        if bs == history.bs and width == history.width:
            history.run += 1
        else:
            history.book(bs, width)
        self.steps += 1  # (``history.total()`` sums every cell: a cost per step)
        if self.log_every and self.steps % self.log_every == 0:
            logger.info("DDTREE online budget: %s", self.summary())
        self._verify = None
        if self._timed:
            self._times = self._times_settled()
        if width == 1 or not steady:  # a steady tree step's refresh is as the last step left it
            self.skips_draft = width == 1 and self._predicting and not self.refresh.due(bs, probed)
            self.refresh.step(width, self.skips_draft, probed)
            self.steps_without_draft += self.skips_draft
        self._step = (bs, width, now)
        if self.runners is not None:
            self.runners.use(width)  # the verify of this step runs in this width's graphs
        return width

    def _decide(self, size: int) -> tuple[int, bool]:
        """This step's width and whether a measured table asked for it as a probe, from the kept
        decisions (``budget/decisions.py``), asked for the row's batch size ``size``; the next
        step of the row takes it again without asking (``start``) while nothing they read moves.
        A served row's steady steps are nearly all of those (the host's caches are cold between
        rounds: every call and object a step reads costs).

        Why the row's size. A width's rate is its expected tokens over its row's cost, and the
        expected drafts scale with the batch size (``expected_drafts.py``: the calibrated reach
        per request times ``bs``, plus ``bs`` bonus tokens): every width's rate at ``bs`` is the
        rate at ``size`` times ``bs / size``. So the choice, its hysteresis and the probe check
        are the same for every size the row prices (``tests/test_budget_host_work.py`` compares
        them with the decisions asked at each step's own size), and under load, where a request
        ends or joins at most steps, a batch that stays in its row asks nothing."""
        width, probed = self.decisions.decide(size, self.expected.of_batch(size))
        if self.pinned:  # debugging: the choice made and booked, the widest tree run
            width = self.widths[-1]
        self._leave_steady(None if probed else size, width, self.decisions.drift_bound)
        # a cell settles or unsettles only as the table's structure moves: a steady step reads the last
        if self._timed:
            self._settled = self._cost.settled(size, width)
        return width, probed

    def _leave_steady(self, size: int | None = None, width: int = 0, drift_bound: float = -math.inf) -> None:
        """The row's batch size and width ``start`` takes again from now (None: none), while the
        table's drift stays within ``drift_bound`` and its structure does not move."""
        self._steady, self._steady_width, self._steady_drift = size, width, drift_bound

    @property
    def history(self) -> Counter[tuple[int, int]]:
        """(batch size, width) -> steps run."""
        return self._history.counts

    def interrupt(self, joined: int = 0) -> None:
        """Another batch (a prefill of ``joined`` requests, an idle pass) runs between two
        steps: the last step's period would count it, and so would the next step's under
        overlap (the scheduler waits for the other batch's results while the next step is in
        flight), so neither adds anything to the cost table."""
        self._end_period(None)
        self._last_kind = None
        self.refresh.joined += joined

    def _end_period(self, now: float | None) -> None:
        if self._last is not None:
            observed, started = self._last
            observed.end_period(now if observed.costed else None, started)
            self._last = None

    def verify_started(self) -> None:
        """Just before the step's verify forward: a timed table prices each width by its
        verify's device time (``budget/timed_costs.py``), so it is timed."""
        if self._times:
            self._verify = VerifyTime(self._spare_events, self._clock)

    def _times_settled(self) -> bool:
        """Whether this step's verify is timed: every unsettled one, one settled in ``time_every``
        (decided in ``start``, whose host time a server pays anyway, rather than beside the
        verify)."""
        if not self._settled:
            return True
        self._settled_untimed = (self._settled_untimed + 1) % self.time_every
        return self._settled_untimed == 0

    def verify_finished(self) -> None:
        if self._verify is not None:
            self._verify.end()

    def watch(self, propose):
        """``propose`` that also keeps the step's draft log-probs ``[bs * depth, k]``."""

        def watched(hidden, k):
            log_probs, token_ids = propose(hidden, k)
            self._log_probs = log_probs
            return log_probs, token_ids

        return watched

    def head_for(self, width: int):
        """The tree head that builds trees of ``width`` (eager steps)."""
        return self.heads[width]

    def graph_proposal(self, proposal, max_bs: int, device):
        """``proposal`` (one batch's ``propose(hidden, k)`` maker) for the drafter's graph, which
        builds the widest tree: it also keeps the log-probs the choice reads in a buffer."""
        from .kept_prediction import KeptLogProbs

        self.kept = KeptLogProbs(max_bs, self.depth, self.heads[self.widths[-1]].k, device)
        return lambda *batch_rows: self.kept.keeping(proposal(*batch_rows))

    def install_graphs(self, target_runner, draft_runner, roots_append: bool = False) -> list:
        """After the server's graph capture: one graph set per width (CUDA graphs only; width
        1's decode graphs, appending the roots' drafter KV with ``roots_append``); returns the
        attention backends of the verify graph sets (whose decode scratch is released: width
        1's decode graphs read theirs)."""
        from .width_graphs import install, verify_backends

        install(self, target_runner, draft_runner, roots_append)
        return verify_backends(self.runners)

    def from_graph(self, replayed):
        """The drafter graph's trees (and top-1 ids), cut to this step's width by the head; the
        step's log-probs are the ones the graph kept."""
        trees, _ = replayed
        self._log_probs = self.kept.rows(trees.tokens.shape[0])
        return replayed

    def root_only(self, roots: torch.Tensor, prefix_lens: torch.Tensor, last_position: int):
        """A step that skips the drafter: (the root-only :class:`Trees`, a top-1 per depth that
        no accepted node reads), as ``_draft`` returns them."""
        trees = Trees.root_only(roots, prefix_lens)
        trees.positions.clamp_(max=last_position)
        return trees, trees.tokens.expand(-1, self.depth)

    def finish(self, accept_lens: torch.Tensor) -> None:
        """After the step's accept: start bringing its prediction and outcome to the host."""
        if self._step is None or (self._log_probs is None and not self.skips_draft):
            raise RuntimeError("DDTREE online budget: finish() without start() and a draft")
        bs, width, started = self._step
        log_probs, self._step, self._log_probs = self._log_probs, None, None
        if self.runners is not None:
            self.runners.restore()  # prefill and the rest run with the start-up pair
        if not self._predicts(width):  # only the step's cost to record (its period)
            # a timed table reads a period only beside its verify's time: an untimed step leaves no record
            if self._timed and self._verify is None:
                self._last_kind = (width, not self.skips_draft)
                return
            self._observe(Observed(bs, width, not self.skips_draft, None, None), started)
            return
        self._drafted_unpredicted = 0
        self._predicting, self.refresh.joined = True, 0
        predicted = self._predict(log_probs, bs)  # [n_widths, depth]
        measured = reach_counts(accept_lens, self.depth)  # [depth] (cat makes it float64)
        host, ready = self._copies.start(torch.cat([predicted, measured[None]]))
        self._observe(Observed(bs, width, True, host, ready), started)

    def _predict(self, log_probs: torch.Tensor, bs: int) -> torch.Tensor:
        """The step's reach per width and depth: a replay of the prediction's graph where the
        drafter's graph kept the log-probs, else its operations one by one."""
        if self.prediction is not None and self.kept.holds(log_probs):
            return self.prediction.predict(bs)
        return reach_totals_at_widths(log_probs.view(bs, self.depth, -1), self.widths)

    def _observe(self, observed: Observed, started: float) -> None:
        observed.verify, self._verify = self._verify, None
        kind = (observed.width, observed.drafted)
        observed.costed, self._last_kind = kind == self._last_kind, kind
        self._pending.append(observed)
        self._last = (observed, started)

    def _predicts(self, width: int) -> bool:
        """Whether this step's draft makes a prediction: the first, a width-1 step that drafts
        (it drafts to refresh the prediction), and one drafted step in ``predict_every``."""
        if self.skips_draft:
            return False
        self._drafted_unpredicted += 1
        return not self._predicting or width == 1 or self._drafted_unpredicted >= self.predict_every

    def _absorb_landed(self) -> None:
        table = self._cost
        structure = table.structure  # what the steady decisions read of the table, with its drift
        while self._pending and self._pending[0].landed():
            step = self._pending.popleft()
            if step.values is not None:  # a step that predicted nothing keeps the last prediction
                self.expected.fold(step.values.numpy(), step.width, step.bs)
                self._copies.give_back(step.values, step.ready)
                self._leave_steady()  # new expected drafts: the decisions are asked
            verify_ms = None if step.verify is None else step.verify.ms()
            own_period = step.period_ms if step.costs_its_width else None  # None: not this kind's
            if self._timed:
                if verify_ms is not None:  # a verify that did not end (it raised) prices nothing
                    self._cost.observe(step.bs, step.width, own_period, verify_ms)  # every verify
            elif self.measured and own_period is not None:
                self._cost.observe(step.bs, step.width, own_period)
        if table.structure != structure or table.drift > self._steady_drift:
            self._leave_steady()

    # --- what the server shows ---------------------------------------------------------

    def summary(self) -> dict:
        """For the stats log line (``width_summary.py``)."""
        return width_summary.summary(self)

    def cost_rows(self) -> dict[int, dict[int, float]]:
        """Every row of the cost table: batch size -> width -> ms."""
        return width_summary.cost_rows(self.cost)


def cost_table(widths) -> RoundCostTable:
    """The injected fixed table when one is set (its widths must be the candidates), else
    one measured while serving."""
    table = budget_cost_table()
    if table is None:
        return ProbedCostTable(COST_BATCH_SIZES, widths)
    if tuple(table["widths"]) != tuple(widths):
        raise DDTreeConfigError(
            f"DDTREE: the injected cost table's widths {table['widths']} are not the server's "
            f"candidate widths {list(widths)}."
        )
    return RoundCostTable(table["batch_sizes"], widths, table["ms"])
