"""The online budget's own host work per decode step (``adapter/widths.py``) does not grow with
the cost table's rows or the candidate widths, and what it keeps between steps changes no
decision (CPU, torch).

Work is counted, not timed: the Python lines each function runs per call (``sys.settrace``) and
the torch operations a predicting step dispatches (each a kernel launch beside a GPU). A loop
over the rows or the widths in Python shows as lines that grow with them; numpy and torch work
over a row of widths is one operation whatever its length."""

import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sglang_ddtree
from sglang_ddtree.adapter.widths import StepWidths
from sglang_ddtree.budget import ProbedCostTable, RoundCostTable, TimedCostTable, candidate_widths
from sglang_ddtree.budget.decisions import KeptDecisions
from sglang_ddtree.tree.expected_accept import reach_at_widths, reach_by_depth, reach_totals_at_widths
from sglang_ddtree.tree.types import Trees

DEPTH, TOP_K = 7, 16
PACKAGE = str(Path(sglang_ddtree.__file__).parent)


class Clock:
    """A simulation's clock (seconds): the steps' periods and verify times are its own, so two
    runs of the same steps see the same costs."""

    def __init__(self):
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


def drafter_log_probs(bs: int, seed: int = 0) -> torch.Tensor:
    """A confident drafter's sorted top-k log-probs ``[bs * depth, k]`` (top token ~0.9)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * DEPTH, TOP_K, generator=gen)
    logits[:, 0] += 6.0
    return torch.log_softmax(logits, -1).sort(-1, descending=True).values


def served(rows: int, budget: int, clock=None) -> StepWidths:
    """A timed table of ``rows`` batch sizes at the candidate widths of ``budget``, as the
    start-up leaves it (a replay time for every cell)."""
    widths = candidate_widths(budget)
    sizes = tuple(range(1, rows + 1))
    startup = [[0.3 + 0.004 * bs + 0.002 * w for w in widths] for bs in sizes]
    return StepWidths(widths, TimedCostTable(sizes, widths, startup), DEPTH, lambda w: w, clock=clock)


def step(steps: StepWidths, bs: int, clock: Clock, rng: random.Random, accept: int = 5) -> int:
    """One decode step as the worker runs it, on the simulation's clock: a round of ~4 ms of
    which the verify takes ~0.3-0.5 ms, with some noise."""
    width = steps.start(bs)
    if not steps.skips_draft:
        steps.watch(lambda hidden, k: (drafter_log_probs(bs), None))(None, TOP_K)
    clock.s += rng.uniform(1.5, 2.0) / 1e3
    steps.verify_started()
    clock.s += (0.3 + 0.0002 * width + rng.uniform(0.0, 0.2)) / 1e3
    steps.verify_finished()
    clock.s += rng.uniform(1.5, 2.0) / 1e3
    steps.finish(torch.full((bs,), min(accept, width - 1), dtype=torch.int64))
    return width


# --- per-step work ------------------------------------------------------------------------------


def lines_per_call(steps: StepWidths, batch_sizes, clock: Clock, rng: random.Random, roots) -> Counter:
    """Per function in files under ``roots``: the most lines it ran in one call over these steps."""
    most: Counter = Counter()
    calls: list[Counter] = []

    def tracer(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(roots):
            return None
        calls.append(Counter())
        ran = calls[-1]

        def local(frame, event, arg):
            if event == "line":
                ran[frame.f_code.co_name] += 1
            elif event == "return":
                name = frame.f_code.co_name
                most[name] = max(most[name], ran[name])
            return local

        return local

    for bs in batch_sizes:
        sys.settrace(tracer)
        try:
            step(steps, bs, clock, rng)
        finally:
            sys.settrace(None)
    return most


def steady_lines(rows: int, budget: int, roots=(PACKAGE,)) -> Counter:
    clock, rng = Clock(), random.Random(0)
    steps = served(rows, budget, clock)
    for bs in (2, 3):  # past the probes of both rows: every cell the chooser could want is priced
        for _ in range(400):
            step(steps, bs, clock, rng)
    # the common steps: one batch size, then another row, then back (the kept choices, a row
    # computed again, the prediction every 8 drafted steps and its fold)
    return lines_per_call(steps, [2] * 40 + [3] * 12 + [2] * 12, clock, rng, tuple(roots))


def test_a_steps_host_work_does_not_grow_with_the_rows_or_the_widths():
    small = steady_lines(rows=3, budget=7)  # 3 rows, 4 widths
    large = steady_lines(rows=48, budget=256)  # 48 rows, 10 widths
    assert large["start"] and large["finish"] and large["observe"]  # the step's calls were traced
    grown = {name: (small[name], n) for name, n in large.items() if n > small[name]}
    assert grown == {}, f"lines per call (3 rows x 4 widths, 48 rows x 10 widths): {grown}"


def test_the_line_count_sees_a_loop_over_the_widths(monkeypatch):
    """The counting itself: a chooser that scored the widths one by one in Python would fail."""
    from sglang_ddtree.budget import online

    def choose_one_by_one(self, bs, accepted):
        rates = [(a + bs) / self.cost(bs, w) for w, a in zip(self.widths, accepted)]
        self.current = self.widths[rates.index(max(rates))]
        return self.current

    monkeypatch.setattr(online.WidthChooser, "choose", choose_one_by_one)
    roots = (PACKAGE, __file__)
    small, large = steady_lines(rows=3, budget=7, roots=roots), steady_lines(rows=48, budget=256, roots=roots)
    assert large["<listcomp>"] > small["<listcomp>"] > 0


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def predicting_step_ops(bs: int, budget: int) -> int:
    """Torch operations dispatched by one predicting ``finish`` (after its first: the shapes'
    constants are made once)."""
    widths = candidate_widths(budget)
    table = RoundCostTable((1,), widths, [[1.0] * len(widths)])
    steps = StepWidths(widths, table, DEPTH, lambda w: w, predict_every=1)
    propose = steps.watch(lambda hidden, k: (drafter_log_probs(bs), None))
    accept = torch.full((bs,), 3, dtype=torch.int64)
    for _ in range(2):
        steps.start(bs)
        propose(None, TOP_K)
        steps.finish(accept)
    steps.start(bs)
    propose(None, TOP_K)
    with _Ops() as ops:
        steps.finish(accept)
    assert steps._pending[-1].values is not None  # it predicted
    return ops.count


def test_the_prediction_is_a_fixed_number_of_device_operations():
    """One drafted step in 8 predicts on the device; beside a GPU each operation is a launch
    the host pays for. Their number depends on the depth alone (one ``topk`` per depth), not on
    the batch or the widths (at 84f54ae it stacked one row view per width)."""
    counts = {(bs, budget): predicting_step_ops(bs, budget) for bs in (1, 64) for budget in (7, 256)}
    assert len(set(counts.values())) == 1, counts
    assert next(iter(counts.values())) <= 8 * DEPTH, counts  # ~50 at depth 7 (84f54ae: 80-86)


# --- what is kept between steps changes no decision ----------------------------------------------


def run_widths(table_kind: str, keep: bool, seed: int = 1, churn: float = 0.0) -> list[tuple[int, int, bool]]:
    """Every step's (bs, width, skips the drafter) over a mixed run: batch sizes that change,
    prefills between steps, noisy rounds, probes; with ``churn``, the share of the other steps at
    which a request ends or a prefill brings the batch back (its size one less, then back).
    ``keep=False`` asks the chooser and the table at every step, as before anything was kept:
    a timed table computes every row's costs and where they read them anew too."""
    clock, rng = Clock(), random.Random(seed)
    widths = candidate_widths(15)
    sizes = (1, 2, 4, 8, 16)
    if table_kind == "timed":
        startup = [[0.3 + 0.01 * bs * w for w in widths] for bs in sizes]
        table = TimedCostTable(sizes, widths, startup, probe_after=4, reprobe_after=64)
    elif table_kind == "timed-rows":  # more rows, their probes, trust and floors each on its own round
        sizes = (1, 2, 3, 4, 6, 8, 12, 16)
        startup = [[0.3 + 0.01 * bs * w for w in widths] for bs in sizes]
        table = TimedCostTable(sizes, widths, startup, probe_after=6, trust_after=3, reprobe_after=48)
    elif table_kind == "probed":
        table = ProbedCostTable(sizes, widths)
    else:
        table = RoundCostTable.from_function(sizes, widths, lambda bs, w: 4.0 + 0.02 * bs * w)
    steps = StepWidths(widths, table, DEPTH, lambda w: w, clock=clock)
    if not keep:  # and each step asked at its own batch size, not its row's
        steps.decisions.holds = lambda kept, bs, accepted: False
        table.row_size = lambda bs: bs
    ran, bs, full, churner = [], 2, 2, random.Random(seed + 1)
    for _ in range(1500):
        if not keep:  # no step of the same size takes the last width without asking (``start``)
            steps._steady = None
            for memo in ("_cells_memo", "_slots_memo"):
                getattr(table, memo, {}).clear()
        if rng.random() < 0.05:
            bs = full = rng.choice([1, 2, 3, 5, 8, 12, 16])
            steps.interrupt(joined=1)
            clock.s += 0.008
        elif churn and churner.random() < churn:
            if bs < full:  # a prefill joined
                bs = full
                steps.interrupt(joined=1)
            else:  # a request ended
                bs = max(1, full - 1)
        width = step(steps, bs, clock, rng, accept=rng.randint(0, DEPTH))
        ran.append((bs, width, steps.skips_draft))
    return ran


@pytest.mark.parametrize("table_kind", ["timed", "timed-rows", "probed", "fixed"])
@pytest.mark.parametrize("seed,churn", [(1, 0.0), (2, 0.0), (3, 0.5), (4, 0.5), (5, 0.2)])
def test_a_kept_choice_is_the_one_the_chooser_would_make(table_kind, seed, churn):
    kept = run_widths(table_kind, keep=True, seed=seed, churn=churn)
    asked = run_widths(table_kind, keep=False, seed=seed, churn=churn)
    assert len({w for _, w, _ in kept}) > 1  # the run chose among widths
    assert kept == asked


def test_a_step_that_asks_nothing_reads_the_settled_check_the_table_would_give(monkeypatch):
    """A step whose decisions repeated the last one's, or that was not asked them at all, reads
    the last step's settled check (a cell settles or unsettles only as the table's structure
    moves): at every step of a mixed run (probes, trust, stale cells cleared) it is what the
    table says. ``decided_anew`` says whether the step asked its decisions."""
    asked, start, decided = [], StepWidths.start, []
    decide = KeptDecisions.decide

    def checked(steps, bs):
        decided.clear()
        width = start(steps, bs)
        assert steps._settled == steps.cost.settled(bs, width), (len(asked), bs, width)
        assert steps.decided_anew == bool(decided), (len(asked), bs, width)
        asked.append(steps.decided_anew)
        return width

    monkeypatch.setattr(KeptDecisions, "decide", lambda *a: decided.append(1) or decide(*a))
    monkeypatch.setattr(StepWidths, "start", checked)
    run_widths("timed", keep=True, seed=3, churn=0.5)
    assert 0.0 < sum(asked) / len(asked) < 0.7, sum(asked)


@pytest.mark.parametrize("table_kind", ["timed", "fixed"])
def test_most_steps_of_a_steady_batch_ask_no_decision(table_kind, monkeypatch):
    """At one batch size, a step that follows a step of its size with nothing folded and no cost
    moved takes the last width without asking the decisions (``start``): most steps of a steady
    batch do, and the comparison with the asked widths above covers them."""
    clock, rng = Clock(), random.Random(0)
    if table_kind == "timed":
        steps = served(rows=8, budget=15, clock=clock)
    else:
        widths = candidate_widths(15)
        table = RoundCostTable.from_function((1, 8), widths, lambda bs, w: 4.0 + 0.02 * bs * w)
        steps = StepWidths(widths, table, DEPTH, lambda w: w, clock=clock)
    for _ in range(300):
        step(steps, 4, clock, rng)
    asked, decide = [], steps.decisions.decide
    monkeypatch.setattr(steps.decisions, "decide", lambda *a: asked.append(1) or decide(*a))
    before, ran = Counter(steps.history), Counter()
    for n in range(320):
        ran[4, step(steps, 4, clock, rng)] += 1
        if n % 100 == 0:  # the history as the summary reads it, mid-run: every step booked
            assert steps.history - before == ran
    assert len(asked) < 0.2 * 320, len(asked)
    assert steps.history - before == ran


def test_most_steps_of_a_served_row_keep_their_choice_through_drifting_costs():
    """On a timed table nearly every round moves a median (the costs drift), yet most steps
    keep the last choice: the drift stays within the choice's slack."""
    clock, rng = Clock(), random.Random(0)
    steps = served(rows=8, budget=15, clock=clock)
    for _ in range(300):
        step(steps, 4, clock, rng)
    asked, drift, structure = [], steps.cost.drift, steps.cost.structure
    choose = steps.chooser.choose
    steps.chooser.choose = lambda bs, accepted: asked.append(bs) or choose(bs, accepted)
    for _ in range(200):
        step(steps, 4, clock, rng)
    assert steps.cost.drift > drift and steps.cost.structure == structure  # costs moved, nothing else
    assert len(asked) < 100, len(asked)


def test_a_batch_size_that_comes_back_finds_its_decisions_kept():
    """Under load the batch's size changes at most steps (a request ends, a prefill brings it
    back): each size keeps its own choice, probe check and expected drafts, so neither the
    chooser nor the calibration is asked again at every change."""
    clock, rng = Clock(), random.Random(0)
    steps = served(rows=8, budget=15, clock=clock)
    for bs in [4, 3] * 300:
        step(steps, bs, clock, rng)
    asked, calibrated = [], []
    choose, calibrate = steps.chooser.choose, steps.expected.calibration.calibrated
    steps.chooser.choose = lambda bs, accepted: asked.append(bs) or choose(bs, accepted)
    steps.expected.calibration.calibrated = lambda reach: calibrated.append(1) or calibrate(reach)
    for bs in [4, 3] * 100:
        step(steps, bs, clock, rng)
    folds = 200 // steps.predict_every + 1
    assert len(calibrated) <= 2 * folds, len(calibrated)  # once per size and prediction
    assert len(asked) < 60, len(asked)  # against 200 sizes asked


def test_a_fixed_table_is_asked_again_only_when_the_prediction_or_the_row_changes(monkeypatch):
    widths = candidate_widths(15)
    table = RoundCostTable.from_function((1, 8), widths, lambda bs, w: 4.0 + 0.02 * bs * w)
    clock, rng = Clock(), random.Random(0)
    steps = StepWidths(widths, table, DEPTH, lambda w: w, clock=clock)
    asked = []
    choose = steps.chooser.choose
    monkeypatch.setattr(
        steps.chooser, "choose", lambda bs, accepted: asked.append(bs) or choose(bs, accepted)
    )
    for n in range(64):  # every size of the row of 8: one decision for them all
        step(steps, 4 + n % 5, clock, rng)
    folds = 64 // steps.predict_every + 1  # the first step's, then one drafted step in 8
    assert len(asked) <= folds + 1, len(asked)
    assert set(asked) == {8}, asked
    step(steps, 1, clock, rng)
    assert asked[-1] == 1  # another row: asked again


# --- the timed table keeps what it says it keeps --------------------------------------------------


def test_the_timed_tables_version_moves_whenever_a_cost_or_a_probe_could():
    """Random rounds into a timed table (stalls, other rows, untimed periods, stale cells):
    whenever its ``version`` stays, every row's costs and what a probe would ask for stay too;
    the cells open to a probe are the untrusted ones not given up; each median is the
    window's."""
    rng = np.random.default_rng(3)
    sizes, widths = (1, 2, 4, 8), (1, 2, 4, 8, 9)
    table = TimedCostTable(
        sizes,
        widths,
        rng.uniform(1.0, 3.0, (4, 5)),
        probe_after=3,
        trust_after=3,
        window=5,
        reprobe_after=40,
        max_probe_steps=4,
    )

    def state():
        costs = [table.row_costs(bs).tolist() for bs in sizes]
        due = [table._row_rounds[r] >= table.probe_after for r in range(len(sizes))]
        return costs, table._open.tolist(), due

    moved = 0
    for _ in range(1500):
        before, version = state(), table.version
        bs = int(rng.choice([1, 2, 3, 4, 6, 8]))
        if rng.random() < 0.3:
            table.unprobed(bs, lambda floors, priced: rng.random(len(widths)) < 0.5)
            before, version = state(), table.version
        period = None if rng.random() < 0.2 else float(rng.choice([4.0, 4.0, 4.1, 30.0]))
        width = int(rng.choice(widths, p=[0.05, 0.05, 0.3, 0.3, 0.3]))  # widths 1, 2 seldom: stale
        table.observe(bs, width, period, float(rng.choice([0.5, 0.5, 0.6, 0.7])))
        if table.version == version:
            assert state() == before
        else:
            moved += 1
        trusted = table.cells.rounds >= table.trust_after
        np.testing.assert_array_equal(table._open, ~trusted & (table.probe_steps < table.max_probe_steps))
        assert table._open_count == table._open.sum(1).tolist()
        for shares in (table.cells, table.pooled, table.rest):
            for r, row in enumerate(shares.windows):
                for c, window in enumerate(row):
                    assert shares.median[r, c] == (statistics.median(window) if window else 0.0)
    assert 0 < moved < 1500  # some rounds moved nothing the table gives (a median of repeats)
    assert table.reprobes.any()  # stale cells were cleared and probed again


def test_reach_totals_are_the_summed_reach_at_each_width():
    """The prediction's one pass equals the reference's ``reach_at_widths(reach_by_depth(...))``:
    few and many top-k candidates against the budget, ties (a drafter whose tail is one value),
    and tokens of no probability."""
    from sglang_ddtree.tree.expected_accept import reach_totals_at_widths

    gen = torch.Generator().manual_seed(11)
    for bs, depth, k, budget in [(1, 1, 4, 3), (3, 4, 2, 15), (5, 7, 16, 64), (2, 6, 64, 16), (4, 3, 8, 256)]:
        log_probs = torch.log_softmax(torch.randn(bs, depth, k, generator=gen, dtype=torch.float64), -1)
        log_probs = log_probs.sort(-1, descending=True).values
        tied = log_probs.clone()
        tied[..., 1:] = math.log(1e-3)  # ties within and across depths
        tied[0, :, -1] = -math.inf
        widths = candidate_widths(budget)
        for lp in (log_probs, tied):
            expected = reach_at_widths(reach_by_depth(lp, budget), widths)
            torch.testing.assert_close(reach_totals_at_widths(lp, widths), expected, rtol=1e-12, atol=1e-12)


def test_reach_totals_of_the_first_rows_leave_the_rest_of_the_buffer_out():
    """A buffer sized for the largest batch, its rows past the step's batch holding an earlier
    batch's values, infinities or nan: the totals of its first ``rows`` are those of the batch
    alone (what lets one CUDA graph serve every batch size)."""
    from sglang_ddtree.tree.expected_accept import reach_totals_at_widths

    widths = candidate_widths(31)
    buffer = drafter_log_probs(8, seed=3).view(8, DEPTH, TOP_K).double()
    buffer[5], buffer[6, :, 2:] = math.nan, math.inf
    for bs in (1, 3, 5):
        alone = reach_totals_at_widths(buffer[:bs].clone(), widths)
        masked = reach_totals_at_widths(buffer, widths, rows=torch.tensor(bs))
        torch.testing.assert_close(masked, alone, rtol=1e-12, atol=1e-12)
    full = reach_totals_at_widths(buffer[:5], widths, rows=torch.tensor(5))
    assert (full > reach_totals_at_widths(buffer[:4], widths)).any()  # each row counts


class RecordedPrediction:
    """The prediction's graph as the host calls it (no capture on the CPU): the masked totals of
    the whole kept buffer, the batch sizes it was asked for recorded."""

    def __init__(self, kept, widths):
        self.kept, self.widths, self.asked = kept, widths, []

    def predict(self, bs: int) -> torch.Tensor:
        self.asked.append(bs)
        log_probs = self.kept.buffer.view(-1, DEPTH, TOP_K)
        return reach_totals_at_widths(log_probs, self.widths, rows=torch.tensor(bs))


def test_a_step_the_drafter_graph_ran_predicts_from_its_kept_log_probs_as_an_eager_step_does():
    """Steps whose log-probs the drafter's graph kept ask the prediction's graph, at their batch
    size, for what the eager steps compute from their own (batches that shrink leave stale
    rows behind); the predictions reach the host the same."""
    widths = candidate_widths(15)
    table = RoundCostTable((1, 8), widths, [[1.0] * len(widths)] * 2)
    graphed, eager = (
        StepWidths(widths, table, DEPTH, lambda w: SimpleNamespace(k=TOP_K), predict_every=1)
        for _ in range(2)
    )
    draft = {}  # the step's draft log-probs
    propose = lambda hidden, k: (draft["log_probs"], None)  # noqa: E731
    kept_proposal = graphed.graph_proposal(lambda: propose, 8, "cpu")()
    graphed.prediction = RecordedPrediction(graphed.kept, widths)
    sizes = [8, 2, 5, 1, 3]
    for seed, bs in enumerate(sizes):
        draft["log_probs"] = drafter_log_probs(bs, seed)
        accept = torch.arange(bs, dtype=torch.int64) % DEPTH
        for steps in (graphed, eager):
            steps.start(bs)
        kept_proposal(None, TOP_K)
        roots = Trees.root_only(torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64))
        graphed.from_graph((roots, None))
        eager.watch(propose)(None, TOP_K)
        for steps in (graphed, eager):
            steps.finish(accept)
        torch.testing.assert_close(
            graphed._pending[-1].values, eager._pending[-1].values, rtol=1e-12, atol=1e-12
        )
    assert graphed.prediction.asked == sizes


# --- the slack of a kept decision ---------------------------------------------------------------


def chosen_at(costs: np.ndarray, bs: int, accepted: np.ndarray, margin: float, current: int | None):
    """The chooser's width for one row of ``costs`` (widths 1..n) from ``current``, and the
    chooser (``kept_slack``: the slack of that choice)."""
    from sglang_ddtree.budget import WidthChooser

    widths = tuple(range(1, len(costs) + 1))
    chooser = WidthChooser(widths, RoundCostTable((64,), widths, [costs]), switch_margin=margin)
    chooser.current = current
    width = chooser.choose(bs, accepted)
    chooser.kept_slack = chooser.slack()
    return width, chooser


def random_row(rng) -> tuple[np.ndarray, np.ndarray, int]:
    """A random row of 2-10 widths' costs, their expected drafts and a batch size."""
    n = int(rng.integers(2, 11))
    return rng.uniform(1.0, 5.0, n), rng.uniform(0.0, 12.0, n), int(rng.integers(1, 9))


def random_choice(rng):
    """A random row, a switch margin, and the chooser's width on it from a random current one."""
    costs, accepted, bs = random_row(rng)
    margin = float(rng.choice([0.0, 0.03, 0.1]))
    current = None if rng.random() < 0.5 else int(rng.integers(1, len(costs) + 1))
    return costs, accepted, bs, margin, *chosen_at(costs, bs, accepted, margin, current)


def random_probe_check(rng):
    """A random row with some widths priced, floors for the rest, and which could win."""
    from sglang_ddtree.budget.online import _could_win

    costs, accepted, bs = random_row(rng)
    n = len(costs)
    priced = rng.random(n) < 0.5
    priced[rng.integers(n)] = True
    floors = np.where(priced, costs, rng.uniform(0.0, 5.0, n) * (rng.random(n) < 0.9))
    return costs, accepted, bs, priced, floors, _could_win(bs, accepted, costs, floors, priced)


def test_a_choice_stands_while_no_cost_moves_past_its_slack():
    """Random rows of costs and expected drafts: with every cost moved by up to the choice's
    slack (the worst case: every other width cheaper by it, the chosen one dearer; and random
    moves), the chooser keeps the width it chose; a little past the slack the worst case can
    move it (the bound is not loose)."""
    rng = np.random.default_rng(5)
    flipped = binding = 0
    for _ in range(1500):
        costs, accepted, bs, margin, width, chooser = random_choice(rng)
        n = len(costs)
        slack = chooser.kept_slack
        assert slack >= 0.0
        worst = np.where(np.arange(1, n + 1) == width, 1.0, -1.0)
        for moved in (slack * worst, rng.uniform(-slack, slack, n)):
            assert chosen_at(costs + moved, bs, accepted, margin, width)[0] == width
        if slack < 0.99 * costs.min():  # a width, not the costs' positivity, bounds it
            binding += 1
            past = 1.001 * slack / (1 - 1e-6) * worst
            flipped += chosen_at(costs + past, bs, accepted, margin, width)[0] != width
    assert flipped == binding > 100


def test_a_choice_stands_across_new_expected_drafts_within_what_its_slack_leaves():
    """New expected drafts (a landed prediction): every width's tokens moved by up to a relative
    eps in the worst direction (the chosen width's down, the others' up), and every cost by the
    drift the kept choice still allows (the chosen one dearer, the others cheaper): the chooser
    keeps its width. Where the kept choice allows no drift it does not hold."""
    from sglang_ddtree.budget.slack import Kept

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(3000):
        costs, accepted, bs, margin, width, chooser = random_choice(rng)
        n = len(costs)
        kept = Kept(bs, chooser.cost, accepted, chooser.kept_slack, width, chooser.last_costs())
        eps = float(rng.uniform(0.0, 0.04))
        worst = np.where(np.arange(1, n + 1) == width, 1.0, -1.0)
        moved = (accepted + bs) * (1.0 - eps * worst) - bs  # the chosen width's tokens down, the rest up
        allowed = kept._slack_left(moved)
        if allowed < 0:
            assert not kept.holds(bs, chooser.cost, moved)
            continue
        assert kept.holds(bs, chooser.cost, moved)
        checked += 1
        assert chosen_at(costs + allowed * worst, bs, moved, margin, width)[0] == width
    assert checked > 300


def test_widths_that_cannot_win_stay_out_while_no_cost_moves_past_their_slack():
    from sglang_ddtree.budget.online import _could_win
    from sglang_ddtree.budget.slack import unwinnable_slack

    rng = np.random.default_rng(6)
    kept = 0
    for _ in range(1500):
        costs, accepted, bs, priced, floors, could = random_probe_check(rng)
        slack = unwinnable_slack(accepted + bs, costs, floors, priced, could)
        if (priced | could).all():
            assert slack == math.inf
            continue
        kept += 1
        out = ~(priced | could)
        for moved in (slack, rng.uniform(0.0, slack)):  # floors down by it, every cost up by it
            again = _could_win(bs, accepted, costs + moved, np.where(priced, floors, floors - moved), priced)
            assert not again[out].any()
    assert kept > 300


def test_widths_that_cannot_win_stay_out_across_new_expected_drafts_within_what_the_slack_leaves():
    from sglang_ddtree.budget.online import _could_win
    from sglang_ddtree.budget.slack import Kept, unwinnable_slack

    rng = np.random.default_rng(8)
    checked = 0
    for _ in range(3000):
        costs, accepted, bs, priced, floors, could = random_probe_check(rng)
        n = len(costs)
        if (priced | could).all():
            continue
        table = RoundCostTable((64,), tuple(range(1, n + 1)), [costs])
        slack = unwinnable_slack(accepted + bs, costs, floors, priced, could)
        kept = Kept(bs, table, accepted, slack, costs=(costs, floors))
        out = ~(priced | could)
        moved = (accepted + bs) * (1.0 + float(rng.uniform(0.0, 0.04)) * np.where(out, 1.0, -1.0)) - bs
        allowed = kept._slack_left(moved)
        if allowed < 0:
            continue
        checked += 1
        assert kept.holds(bs, table, moved)
        again = _could_win(bs, moved, costs + allowed, np.where(priced, floors, floors - allowed), priced)
        assert not again[out].any()
    assert checked > 300
