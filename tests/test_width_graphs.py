"""``--speculative-ddtree-budget auto`` under CUDA graphs (``adapter/width_graphs.py``), the
parts that run on the CPU:

* the prefix property the drafter's graph relies on: it builds the largest tree, a narrower
  step takes its first ``width`` slots (``Trees.narrowed``), which must be exactly the tree a
  build at that width gives - for the reference builder, the C++ builder and the CUDA build
  kernel (emulated on the CPU), on random inputs with ties;
* the start-up cost table from timed graph replays (which graph serves a batch) and its
  refinement by measured rounds;
* the per-step swap of the target's attention backend and verify graph runner.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kernel_cases import TIES, compile_emulator, random_topk
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_ddtree.budget import TimedCostTable, WidthChooser, candidate_widths
from sglang_ddtree.kernels import cpp
from sglang_ddtree.kernels.backend import CppBackend, PythonBackend
from sglang_ddtree.kernels.gpu import build_kernel_name, build_smem_bytes
from sglang_ddtree.tree.types import Trees, TreeSlots


def served(table: TimedCostTable, bs: int, width: int, ms: float, rest: float = 0.0) -> None:
    """One served round of ``ms`` whose verify's device time is all of it but ``rest`` (by
    default a round bound by its verify, as on the K2.6 rank)."""
    table.observe(bs, width, ms, ms - rest)


FIELDS = ("tokens", "depths", "parents", "positions", "tree_sizes", "mask_words")

# (bs, depth, vocab, largest budget, k): k below the budget as --speculative-ddtree-max-topk
# makes it, equal to it, and trees that run out of prefixes before the budget (depth x k small).
CASES = [
    (3, 7, 111, 32, 32),
    (2, 7, 3000, 32, 4),
    (4, 3, 50, 16, 2),  # at most 2 + 4 + 8 = 14 nodes: padding at the largest widths
    (2, 15, 3000, 63, 63),  # width 64: two mask words, narrowed to one
    (1, 5, 3000, 100, 100),
]


def _inputs(seed, bs, depth, vocab, budget, k, ties):
    rng = np.random.default_rng(seed)
    lp, ids = random_topk(rng, bs, depth, vocab, k, ties)
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    prefix = rng.integers(0, 9000, size=bs).astype(np.int64)
    return lp, ids, roots, prefix


def _as_trees(arrays: dict) -> Trees:
    return Trees(**{f: torch.as_tensor(np.ascontiguousarray(arrays[f])) for f in FIELDS})


def _assert_same_trees(got: Trees, want: Trees, context: str) -> None:
    for field in FIELDS:
        have, expected = getattr(got, field), getattr(want, field)
        assert have.shape == expected.shape, (
            f"{context} {field}: {tuple(have.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(have, expected), f"{context} {field} differs"
        assert have.is_contiguous(), f"{context} {field} not contiguous (the CUDA kernels need it)"


def _check_prefix(build, seed, bs, depth, vocab, budget, k, ties):
    lp, ids, roots, prefix = _inputs(seed, bs, depth, vocab, budget, k, ties)
    widest = build(lp, ids, roots, prefix, budget, budget + 1)
    for width in candidate_widths(budget):
        direct = build(lp, ids, roots, prefix, width - 1, width)
        _assert_same_trees(widest.narrowed(width), direct, f"seed {seed} ties {ties} width {width}")


def _backend_build(backend):
    def build(lp, ids, roots, prefix, budget, width):
        t = torch.as_tensor
        return backend.build(t(lp), t(ids), t(roots), t(prefix), budget, width)

    return build


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("case", CASES)
def test_a_narrower_tree_is_the_first_slots_of_the_widest_reference(case, ties):
    for seed in range(4 if case[3] <= 32 else 2):
        _check_prefix(_backend_build(PythonBackend()), seed, *case, ties)


@pytest.mark.skipif(not cpp.available(), reason="no C++ compiler")
@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("case", CASES)
def test_a_narrower_tree_is_the_first_slots_of_the_widest_cpp(case, ties):
    for seed in range(10):
        _check_prefix(_backend_build(CppBackend()), 100 + seed, *case, ties)


@pytest.fixture(scope="module")
def emu():
    return compile_emulator()


def _emulated_build(emu):
    """The CUDA build kernel's logic (cuda/*.cu on the emulator), as the drafter's graph runs it."""

    def build(lp, ids, roots, prefix, budget, width):
        smem, lp_in = build_smem_bytes(width, lp.shape[1], lp.shape[2])
        name = build_kernel_name(width, lp_in)
        slots = int(name.rsplit("_r", 1)[1]) if "_r" in name else 0
        out = emu.build_tree(lp, ids, roots, prefix, budget, width, int(lp_in), 256, smem, slots)
        return _as_trees(
            dict(zip(("tokens", "depths", "parents", "tree_sizes", "positions", "mask_words"), out))
        )

    return build


@pytest.mark.skipif(not cpp.available(), reason="no C++ compiler")
@pytest.mark.parametrize("ties", TIES)
def test_a_narrower_tree_is_the_first_slots_of_the_widest_cuda_kernel(emu, ties):
    for case in CASES:
        for seed in range(3):
            _check_prefix(_emulated_build(emu), 200 + seed, *case, ties)


class _Copies(TorchDispatchMode):
    """Counts the dispatched operations whose result is new memory (a launch beside a GPU),
    not a view of an input."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        self.count += any(
            isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outputs
        )
        return out


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_the_graph_s_tree_slots_narrow_as_the_reference_in_at_most_three_copies(bs):
    budget, depth, k = 64, 6, 8
    lp, ids, roots, prefix = _inputs(7, 8, depth, 50, budget, k, "dup")
    slots = TreeSlots(8, budget + 1, "cpu")
    t = torch.as_tensor
    PythonBackend().build(t(lp), t(ids), t(roots), t(prefix), budget, budget + 1, out=slots.rows(8))
    widest = _backend_build(PythonBackend())(lp, ids, roots, prefix, budget, budget + 1)
    _assert_same_trees(slots.rows(8), widest, "the slots' rows")
    for width in candidate_widths(budget):
        with _Copies() as copies:
            got = slots.narrowed(bs, width)
        _assert_same_trees(got, widest.rows(bs).narrowed(width), f"bs {bs} width {width}")
        with _Copies() as reference:  # separate arrays: one copy each where a row is cut
            widest.rows(bs).narrowed(width)
        assert copies.count <= reference.count, (width, copies.count, reference.count)
        if bs > 1 and width < budget + 1:
            assert (copies.count, reference.count) == (3, 6), width
    with pytest.raises(ValueError):
        slots.narrowed(bs, budget + 2)


def test_narrowing_refuses_a_wider_tree():
    trees = Trees.allocate(2, 5, "cpu")
    assert trees.narrowed(5) is trees
    with pytest.raises(ValueError):
        trees.narrowed(6)
    with pytest.raises(ValueError):
        trees.narrowed(0)


# --- the start-up cost table ----------------------------------------------------------------


def test_timed_table_costs_a_batch_as_the_graph_that_serves_it():
    """Rows: every captured batch size; a width's cell is its own graph that holds the batch
    (its smallest captured size >= the row) plus, for a tree, the drafter's graph at that row
    (width 1 runs no drafter)."""
    from sglang_ddtree.adapter.width_graphs import startup_cost_table

    verify_ms = {1: {1: 1.0, 4: 2.0, 8: 3.0}, 3: {1: 1.5, 8: 5.0}}  # width 3 captured no bs 4
    draft_ms = {1: 0.5, 8: 1.0}
    table = startup_cost_table((1, 3), verify_ms, draft_ms)
    assert table.batch_sizes == (1, 4, 8)
    assert table(1, 1) == pytest.approx(1.0) and table(1, 3) == pytest.approx(2.0)
    assert table(3, 1) == pytest.approx(2.0)  # bs 3 runs in the bs-4 graph
    assert table(3, 3) == pytest.approx(
        5.0 + 1.0
    )  # width 3's smallest graph holding 3 is bs 8; drafter's too
    assert table(16, 3) == pytest.approx(6.0 * 2)  # past every graph: eager, linear in bs
    with pytest.raises(ValueError, match="no timed graph"):
        startup_cost_table((1, 3), {1: {1: 1.0}}, draft_ms)


def test_a_width_costs_its_replay_plus_the_rows_excess_until_its_own_rounds_say_otherwise():
    """Replays time the forwards only; a measured round adds the round's own work. Before a
    width's own cell is trusted it costs its replay plus the median excess of the row's rounds
    (whichever tree width served them); once it has ``trust_after`` rounds of its own, it costs
    what they say, whatever its replay said."""
    table = TimedCostTable((1, 8), (1, 3, 5), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], trust_after=2)
    assert table(1, 5) == 3.0
    served(table, 1, 3, 4.0)  # 2 ms above its replay
    assert table(1, 3) == pytest.approx(4.0) and table(1, 5) == pytest.approx(5.0)
    assert table(1, 1) == pytest.approx(1.0 + 2.0)  # unmeasured width 1: the trees' excess, a bound
    assert table(8, 5) == 6.0  # another row is not touched
    served(table, 1, 3, 4.0)
    assert table.trusted()[0].tolist() == [False, True, False]
    served(table, 1, 5, 3.5)  # width 5 served at its replay's level and below: routing, say
    assert table(1, 5) == pytest.approx(3.0 + 2.0)  # one round of its own: the row's median
    served(table, 1, 5, 3.3)
    assert table(1, 5) == pytest.approx(3.4) and table(1, 3) == pytest.approx(4.0)  # each its own
    served(table, 1, 1, float("inf"))
    assert table(1, 1) == pytest.approx(1.0 + 1.25)  # ignored; the bound follows the row's trees
    served(table, 1, 1, 1.5)  # width 1 (no drafter, no tree step): its own kind's excess
    assert table(1, 1) == pytest.approx(1.5)
    assert list(table.rows_served()) == [True, False]


def test_the_widths_own_rounds_undo_replays_that_overprice_a_wide_tree():
    """The K2.6 rank at 099c64d, c=8: the replays put width 8 2.5 ms over width 4 at bs 8, the
    row's one excess kept that gap, and the server ran width 4 while width 8's rounds in serving
    cost what width 4's did. Once the row has served ``probe_after`` rounds the table asks for
    every width it has not measured; with width 8's own rounds the choice moves to it."""
    widths = (1, 2, 4, 8)
    table = TimedCostTable((8,), widths, [[7.54, 10.08, 11.38, 13.91]], probe_after=8, trust_after=4)
    chooser = WidthChooser(widths, table)
    accepted = [0.0, 8 * 0.6, 8 * 1.38, 8 * 1.69]  # pycode-4l-ranks: 2.38 and 2.69 tokens a round
    for _ in range(8):
        assert table.unprobed(8) is None
        served(table, 8, 4, 12.29)
    assert chooser.choose(8, accepted) == 4 and table(8, 8) == pytest.approx(13.91 + 0.91)
    probed = []  # as served: only widths that could win (width 8's floor is width 4's rounds, not its replay)
    while (width := table.unprobed(8, lambda *floors: chooser.could_win(8, accepted, *floors))) is not None:
        probed.append(width)
        served(table, 8, width, {1: 8.0, 2: 11.0, 8: 12.2}[width])
    assert probed == [1] * 4 + [2] * 4 + [8] * 4
    assert table(8, 8) == pytest.approx(12.2) and table(8, 4) == pytest.approx(12.29)
    assert chooser.choose(8, accepted) == 8


def test_only_widths_that_could_win_at_their_least_cost_are_probed():
    """The trained pair at bs 1 (host-bound: width 1 at 4.15 ms, the widest tree at 5.09): at
    bc39066 the row probed every width, and 11% of its steps ran trees of 1-31 nodes that accept
    half of what the widest does. A width costs no less than a narrower width already priced,
    so one that cannot beat the best priced rate even at that floor is not probed: not widths
    2, 4, 8; width 16, which could, is; once it costs 5.0, width 32 cannot win and width 64 can."""
    widths = (1, 2, 4, 8, 16, 32, 64, 65)
    startup = [[0.13, 0.3, 0.3, 0.3, 0.3, 0.31, 0.31, 0.33]]
    accepted = [0.0, 0.6, 1.2, 1.7, 2.2, 2.5, 2.74, 2.75]  # per request, at bs 1
    # (period, the verify's device time): the host's work fills the rest of every round
    rounds = {1: (4.15, 0.9), 2: (4.3, 0.95), 4: (4.5, 0.96), 8: (4.7, 0.97), 16: (5.0, 0.98)}
    rounds |= {32: (5.0, 1.0), 64: (5.09, 1.05), 65: (5.09, 1.06)}

    def probes(could_win) -> list[int]:
        table = TimedCostTable((1,), widths, startup, probe_after=8, trust_after=4)
        chooser = WidthChooser(widths, table)
        for _ in range(8):
            table.observe(1, 65, *rounds[65])
        probed = []
        filtered = (lambda *floors: chooser.could_win(1, accepted, *floors)) if could_win else None
        while (width := table.unprobed(1, filtered)) is not None:
            probed.append(width)
            table.observe(1, width, *rounds[width])
        assert chooser.choose(1, accepted) == 65
        return sorted(set(probed))

    assert probes(could_win=True) == [1, 16, 64]
    assert probes(could_win=False) == [1, 2, 4, 8, 16, 32, 64]  # the table alone: every width


def test_a_narrow_tree_costs_no_less_than_the_rows_rest():
    """The trained pair at bs 8 (6125f69's priced row: width 1 at 3.14 ms without the drafter,
    the trees at 5.25, of which ~4.75 ms is the host's work besides the verify). Width 1's cost
    was the trees' only floor, so width 8 could win at 3.14 ms and was probed; every tree pays
    the row's rest (its own verify takes no less than no time), and at that floor width 8
    cannot beat the widest."""
    widths = (1, 2, 4, 8, 16, 32, 64, 65)
    startup = [[0.15, 0.32, 0.31, 0.32, 0.32, 0.33, 0.34, 0.36]]
    accepted = [8 * a for a in (0.0, 0.6, 1.2, 1.7, 2.2, 2.5, 2.74, 2.75)]  # the batch's, at bs 8
    table = TimedCostTable((8,), widths, startup, probe_after=8, trust_after=4)
    chooser = WidthChooser(widths, table)
    for _ in range(8):
        table.observe(8, 65, 5.25, 0.5)
    for _ in range(4):
        table.observe(8, 1, 3.14, 0.16)
    floors, priced = table.cost_floors(0)
    assert priced.tolist() == [True] + [False] * 6 + [True]
    assert floors[1:7] == pytest.approx([4.75] * 6)  # the row's rest, above width 1's 3.14
    could = chooser.could_win(8, accepted, floors, priced)
    assert could.tolist() == [False] * 5 + [True] * 3  # not width 8 (nor width 1, priced below the best)
    assert table.unprobed(8, lambda *f: chooser.could_win(8, accepted, *f)) == 32


def test_a_smaller_rows_width_1_rounds_keep_a_larger_row_from_probing_width_1():
    """The trained pair (host-bound): width 1 costs ~3.3 ms of rest, a tree ~4.3. A width-1
    probe of 4 steps leaves 3 rounds of its own (the first follows a tree), never trusted, so
    width 1's floor was 0 in every row and every batch size probed it. Measured in two rounds
    or more of a smaller row, that rest bounds a larger row's (the least of such rows), and
    width 1, which then cannot beat the widest tree, is not probed there."""
    widths = (1, 64, 65)
    startup = [[0.13, 0.31, 0.33]] * 3
    accepted = [0.0, 2.74, 2.75]  # per request
    table = TimedCostTable((1, 2, 4), widths, startup, probe_after=8, trust_after=4)
    chooser = WidthChooser(widths, table)
    for bs in (1, 2):
        for _ in range(8):
            table.observe(bs, 65, 4.6, 0.3)  # the trees' rest: 4.3 ms
    assert table.rest_floors(1).tolist() == [pytest.approx(4.3), 0.0]  # no width-1 round yet
    assert table.unprobed(2, lambda *f: chooser.could_win(2, [2 * a for a in accepted], *f)) == 1
    table.observe(1, 1, None, 0.15)  # the probe's first round: its period followed a tree
    for period in (3.45, 3.4, 9.0):  # its own three (one stalled)
        table.observe(1, 1, period, 0.15)
    assert table.rest.rounds[0].tolist() == [8, 3]  # not trusted (4)
    floors = table.rest_floors(1)
    # the trees' rest, and the median of width 1's 3.3, 3.25 and 8.85
    assert floors[0] == pytest.approx(4.3) and floors[1] == pytest.approx(3.3)
    # bs 2 had no width-1 round: it borrows bs 1's, and width 1 cannot win there (width 64,
    # which could, is the probe asked for)
    assert table.rest_floors(1)[1] == table.cost_floors(1)[0][0]
    assert table.unprobed(2, lambda *f: chooser.could_win(2, [2 * a for a in accepted], *f)) == 64
    # a smaller rest measured in the row itself lowers its floor (the least of the rows)
    table.observe(2, 1, 2.65, 0.15)
    table.observe(2, 1, 2.65, 0.15)
    assert table.rest_floors(1)[1] == pytest.approx(2.5)
    assert table.rest_floors(0)[1] == pytest.approx(3.3)  # a smaller row does not borrow from a larger


def test_a_smaller_rows_rest_that_starts_to_bound_a_floor_moves_the_structure():
    """A row's rest enters the floors of the larger rows at its ``FLOOR_ROUNDS``-th round, and
    its median can stand far below the floor they had while the round moves it by nothing (two
    rounds alike): the floor falls with no drift, so the structure moves, and a probe check kept
    from before (``budget/decisions.py``) is made again: without the move it kept finding no probe
    where one made anew asked for width 2."""
    from sglang_ddtree.budget.decisions import KeptDecisions

    widths, accepted = (2, 4, 8), np.array([1.0, 3.0, 6.0])  # the batch's, at bs 4
    table = TimedCostTable((1, 2, 4), widths, [[0.5] * 3] * 3, probe_after=0, trust_after=4)
    kept = KeptDecisions(WidthChooser(widths, table), table)
    for _ in range(2):
        table.observe(1, 8, 4.5, 0.5)  # bs 1's tree rest, 4 ms: the floor of every row
    table.observe(4, 8, 4.5, 0.5)
    for _ in range(3):
        table.observe(4, 8, None, 0.5)  # bs 4's width 8 trusted, its rest not
    table.observe(2, 8, 1.0, 0.5)  # bs 2's first rest, 0.5 ms: not a floor yet
    assert table.rest_floors(2)[0] == 4.0
    assert kept.probe(4, accepted) is None  # widths 2 and 4 cannot beat width 8 at 4 ms
    structure, drift = table.structure, table.drift
    table.observe(2, 8, 1.0, 0.5)  # the second: a floor now, no median moved
    assert table.drift == drift and table.rest_floors(2)[0] == 0.5
    assert table.structure != structure
    assert kept.probe(4, accepted) == 2  # width 2 could win at 0.5 ms
    assert KeptDecisions(WidthChooser(widths, table), table).probe(4, accepted) == 2


def test_a_verify_prices_its_cell_when_its_period_is_not_its_own():
    """A round that followed another width (or another batch) has a period holding the round
    before it, but its verify's events time its verify alone: it prices its cell and the
    row's pooled verify, not the rest. Before the row has any rest of that kind (or of the
    trees, for width 1) it prices nothing: a verify against no rest would undercut every width
    whose rounds were costed."""
    table = TimedCostTable((8,), (1, 3, 5), [[0.2, 0.3, 0.4]], trust_after=2)
    table.observe(8, 5, None, 3.0)
    assert table.cells.rounds[0].tolist() == [0, 0, 0] and table(8, 5) == pytest.approx(0.4)
    table.observe(8, 5, 10.0, 3.0)  # a round of its own: the trees' rest is 7 ms
    table.observe(8, 1, None, 0.5)  # width 1's first round, after a tree: the trees' rest bounds it
    table.observe(8, 3, None, 2.0)
    assert table.cells.rounds[0].tolist() == [1, 1, 1] and table.rest.rounds[0].tolist() == [1, 0]
    table.observe(8, 3, None, 2.0)  # trusted on its verifies alone
    assert table.trusted()[0].tolist() == [False, True, False]
    assert table(8, 3) == pytest.approx(2.0 + 7.0) and table(8, 1) == pytest.approx(0.5 + 7.0)


def test_widths_that_do_the_same_host_work_differ_by_their_verify_alone():
    """The trained pair at e835772, bs 1 (a round bound by the host): width 64's rounds ran in a
    slower phase of the run than width 65's (arrivals: more of the scheduler's work between
    steps), and with each cell priced by its own periods width 64 cost 7.79 ms and width 65
    5.67, two widths whose rounds do the same work. Split at the verify, the phase lands in the
    row's rest, which every tree width shares, and the two differ by their verify's device time."""
    widths = (1, 64, 65)
    table = TimedCostTable((1,), widths, [[0.134, 0.307, 0.332]], trust_after=4)
    for _ in range(8):
        table.observe(1, 64, 7.79, 1.02)  # (period, the verify's device time) in a slow phase
    for _ in range(8):
        table.observe(1, 65, 5.67, 1.05)
    assert table.trusted()[0].tolist() == [False, True, True]
    assert table(1, 65) - table(1, 64) == pytest.approx(0.03)
    assert table(1, 64) == pytest.approx(1.02 + (6.77 + 4.62) / 2)  # the median of the row's rests
    table.observe(1, 64, 7.79, float("nan"))  # a verify not timed prices nothing
    assert table.cells.rounds[0, 1] == 8


def test_a_width_no_narrower_width_prices_could_always_win():
    """Nothing priced below a width: its floor is 0 and it is probed (width 1 first of all);
    before any width is priced every width could win."""
    widths = (1, 2, 4)
    table = TimedCostTable((8,), widths, [[7.0, 9.0, 11.0]])
    chooser = WidthChooser(widths, table)
    floors, priced = table.cost_floors(0)
    assert floors.tolist() == [0.0, 0.0, 0.0] and not priced.any()
    assert chooser.could_win(8, [0.0, 0.1, 0.2], floors, priced).all()


def test_a_few_stalled_rounds_do_not_price_a_width_out_of_the_choice():
    """The K2.6 rank at 06a9d4f, bs 8: three rounds of width 9 whose periods held stalls
    (about 85 ms against a 14 ms replay) priced width 9 at 33.8 ms when each cell followed its
    own rounds, and the server ran widths 1 and 3 from then on. Under the row's median excess
    the stalls are outvoted by the row's ordinary rounds, and width 9 stays the choice."""
    widths = (1, 3, 9)
    table = TimedCostTable((8,), widths, [[7.5, 10.9, 14.0]])
    for _ in range(6):
        served(table, 8, 3, 10.9 + 1.3)  # ordinary rounds: 1.3 ms of round work
    for _ in range(3):
        served(table, 8, 9, 85.0)  # stalled periods
    assert table(8, 9) == pytest.approx(14.0 + 1.3)
    chooser = WidthChooser(widths, table)
    # pycode-4l-ranks at bs 8: about 2.68 and 1.9 tokens a request at widths 9 and 3
    assert chooser.choose(8, [0.0, 8 * 0.9, 8 * 1.68]) == 9


def test_a_row_with_few_rounds_borrows_the_excess_of_the_nearest_row_with_enough():
    """A batch size passed through in two steps (a pass draining) must not be priced by
    those two periods alone (bs 4 at 92783de: 35 ms over its replays after two rounds)."""
    table = TimedCostTable(
        (1, 4, 8, 16), (1, 9), [[7.0, 9.5], [7.2, 11.7], [7.5, 14.0], [8.6, 19.3]], trust_after=4
    )
    served(table, 4, 9, 11.7 + 35.0)
    assert table(4, 9) == pytest.approx(11.7 + 35.0)  # nothing trusted anywhere yet: its own
    for _ in range(4):
        served(table, 8, 9, 14.0 + 1.0)
        served(table, 16, 9, 19.3 + 2.0)
    assert table(4, 9) == pytest.approx(11.7 + 1.0)  # the nearest trusted row: bs 8
    assert table(1, 9) == pytest.approx(9.5 + 1.0) and table(16, 9) == pytest.approx(19.3 + 2.0)
    for _ in range(3):
        served(table, 4, 9, 11.7 + 2.5)
    assert table(4, 9) == pytest.approx(11.7 + 2.5)  # four rounds of its own: the median
    assert table(1, 1) == pytest.approx(7.0 + 2.5)  # width 1 measured nowhere: the trees' excess
    for _ in range(4):
        served(table, 16, 1, 8.6 + 0.5)
    assert table(1, 1) == pytest.approx(7.0 + 0.5)  # width 1's own excess, from the nearest trusted row


def test_a_width_priced_out_by_slow_rounds_is_measured_again_after_a_while():
    """The K2.6 rank at 0fc9c47, bs 2: four tree rounds put the row's trees at 44 ms over their
    replays and the row ran width 1 for the rest of the call, never measuring a tree again. A
    trusted cell with no round for ``reprobe_after`` of its row's rounds is cleared: it borrows
    the nearest trusted row's excess again, and the table asks for it to be measured anew."""
    widths = (1, 9)
    table = TimedCostTable((1, 2, 8), widths, [[6.8, 9.5], [6.8, 10.4], [7.5, 14.0]], reprobe_after=8)
    for _ in range(4):
        served(table, 8, 9, 14.0 + 1.3)
        served(table, 2, 1, 6.8 + 1.2)
    for _ in range(4):
        served(table, 2, 9, 10.4 + 44.0)  # stalled periods, or a cost that changed since
    chooser = WidthChooser(widths, table)
    expected = [0.0, 2 * 1.68]  # pycode-4l-ranks at width 9, a batch of 2
    assert table(2, 9) == pytest.approx(10.4 + 44.0) and chooser.choose(2, expected) == 1
    for _ in range(7):
        served(table, 2, 1, 6.8 + 1.2)
    assert table(2, 9) == pytest.approx(10.4 + 44.0) and table.reprobes[1] == 0
    served(table, 2, 1, 6.8 + 1.2)  # the eighth of the row's rounds since width 9's last
    assert table.reprobes[1] == 1
    assert table(2, 9) == pytest.approx(10.4 + 1.3)  # bs 8's own excess, the nearest trusted row
    assert table(2, 1) == pytest.approx(6.8 + 1.2)  # width 1 keeps its own
    assert table.unprobed(2) == 9 and chooser.choose(2, expected) == 9
    from sglang_ddtree.adapter.widths import StepWidths

    summary = StepWidths(widths, table, depth=4, make_head=lambda width: width).summary()
    assert summary["reprobes_by_bs"] == {2: 1}  # the stats line says so
    assert summary["probe_steps_by_bs"] == {2: 1}  # the one step asked for above (unprobed)
    assert summary["own_cost_widths_by_bs"] == {2: [1], 8: [9]}


def test_a_probe_whose_periods_never_count_is_given_up_and_tried_again_later():
    """Every period broken by another batch (a prefill each step) leaves a probe unmeasured: it
    runs ``max_probe_steps`` steps, then the chooser decides again until ``reprobe_after`` more
    rounds have passed."""
    table = TimedCostTable((8,), (1, 9), [[7.5, 14.0]], probe_after=4, reprobe_after=6, max_probe_steps=3)
    for _ in range(4):
        served(table, 8, 9, 15.0)  # width 9's own cell: trusted
    assert [table.unprobed(8) for _ in range(4)] == [1, 1, 1, None]
    for _ in range(5):
        served(table, 8, 9, 15.0)
    assert table.unprobed(8) is None
    served(table, 8, 9, 15.0)  # six rounds since it gave up
    assert table.unprobed(8) == 1


def test_eager_batches_past_the_largest_graph_neither_price_nor_probe_its_row():
    """At ede2f70 the K2.6 rank's bs-16 warm-up (graphs to bs 8: eager rounds of 170-200 ms)
    was probed at widths 1, 2 and 4 and entered the bs-8 row at 83-98 ms (scaled by 8 / 16),
    pricing those widths out of the graphs they never ran in."""
    table = TimedCostTable((1, 8), (1, 4, 8), [[6.8, 8.4, 8.9], [7.5, 11.3, 13.9]], probe_after=2)
    for _ in range(8):
        assert table.unprobed(16) is None
        served(table, 16, 8, 190.0)
    assert not table.rows_served().any() and table(8, 4) == pytest.approx(11.3)
    assert table(16, 8) == pytest.approx(13.9 * 2)  # past the largest: linear in bs


def test_timed_table_probes_each_width_once_the_row_knows_its_rounds():
    """Width 1's start-up bound carries the trees' excess and a tree width the chooser does not
    run has only its replay: once a row has served ``probe_after`` rounds, the table asks for
    each width without a trusted cell, smallest first, until it has ``trust_after`` rounds."""
    table = TimedCostTable(
        (1, 8), (1, 3, 5), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], probe_after=3, trust_after=3
    )
    assert table.unprobed(1) is None  # no round yet: nothing is known
    for _ in range(3):
        served(table, 1, 5, 11.0)  # 8 ms of round work over the replay
    assert table.unprobed(1) == 1 and table.unprobed(8) is None  # per row
    assert table(1, 1) == pytest.approx(9.0)  # the bound: replay + the trees' excess
    served(table, 1, 1, 2.5)
    assert table.unprobed(1) == 1 and table(1, 1) == 2.5  # measured, replacing the bound
    served(table, 1, 1, 9.0)  # a width's first rounds can carry one-time work
    served(table, 1, 1, 2.0)
    assert table(1, 1) == 2.5  # the median of its rounds
    assert table.unprobed(1) == 3 and table(1, 3) == pytest.approx(10.0)
    for _ in range(3):
        served(table, 1, 3, 2.4)
    assert table.unprobed(1) is None and table(1, 3) == pytest.approx(2.4)


def test_the_step_loop_runs_the_width_one_probes_without_the_drafter(monkeypatch):
    """Through ``StepWidths``: the start-up replays make a tree look cheap and width 1's bound
    hides that it is cheaper still (a small target: round work dominates). After
    ``probe_after`` rounds the step loop runs the width-1 probes without the drafter; once
    measured, width 1 wins where it gives more tokens per ms (a batch of 8, nothing accepted),
    and the unmeasured tree width, which pays the trees' rest, cannot beat it."""
    import math

    from sglang_ddtree.adapter import verify_clock
    from sglang_ddtree.adapter import widths as widths_module
    from sglang_ddtree.adapter.widths import StepWidths

    # A clock the test moves: each round and its verify cost exactly what the test says (on a
    # loaded machine the real time between two lines can exceed the 5% the assertion allows).
    clock = [1000.0]
    monkeypatch.setattr(widths_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(verify_clock, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    table = TimedCostTable((8,), (1, 3, 5), [[0.2, 0.3, 0.4]], probe_after=2, trust_after=2)
    # every round timed, so the rounds each share counts are the loop's own (settled rounds are
    # timed one in a few by default: the next test)
    widths = StepWidths((1, 3, 5), table, depth=4, make_head=lambda width: width, time_every=1)

    def propose(hidden, k):  # a confident drafter: 0.9 per depth on its top-1
        log_probs = torch.full((hidden.shape[0], k), math.log(1e-6))
        log_probs[:, 0] = math.log(0.9)
        return log_probs, torch.arange(k).repeat(hidden.shape[0], 1)

    chosen, drafted = [], []
    for _ in range(12):
        width = widths.start(8)
        drafted.append(not widths.skips_draft)
        if drafted[-1]:
            widths.watch(propose)(torch.zeros(8 * 4, 4), 4)
        verify_ms, round_ms = (0.5, 2.0) if width == 1 else (3.0, 10.0)  # the real rounds: width 1 is cheap
        widths.verify_started()
        clock[0] += verify_ms / 1e3
        widths.verify_finished()
        clock[0] += (round_ms - verify_ms) / 1e3
        widths.finish(torch.zeros(8, dtype=torch.int64))
        chosen.append(width)
    widths.start(8)  # ends the last step's period
    assert chosen[0] == 1 and drafted[0]  # nothing predicted yet: a drafted width 1, not its cost
    # the replays make the widest tree the best rate; its first round, after a width-1 round,
    # is not costed (under overlap its period is the round before it)
    assert chosen[1:4] == [5, 5, 5]
    # the probes: the first step of each follows another width, so its period is not its own,
    # but its verify is (the events time it alone): a probe takes trust_after (2) steps
    assert chosen[4:6] == [1, 1] and drafted[4:6] == [False] * 2
    # then width 1 at 2 ms: width 3 pays the trees' 7 ms of rest besides its verify, and at that
    # floor it cannot win; it is never probed, and width 1 serves the rest. Chosen on the
    # prediction, width 1 drafts to refresh it after a run of 2 (the probes'), then of 4 (refresh.py)
    assert chosen[6:] == [1] * 6 and table(8, 1) == pytest.approx(2.0, rel=0.05)
    assert drafted[6:] == [True, False, False, False, False, True]
    assert widths.summary()["probe_steps_by_bs"] == {8: 2}  # the stats line counts the probes' steps
    # each period split at its verify: the rest is the row's, per kind (trees, width 1)
    assert table.rest.median[0] == pytest.approx([7.0, 1.5], rel=0.05)
    assert table.cells.median[0] == pytest.approx([0.5 - 0.2, 0.0, 3.0 - 0.4], rel=0.05)
    # the rounds before any rest was measured (the drafted width 1, the first width-5 step)
    # priced nothing: a verify against no rest would have made width 5 cost 3 ms, not 10; width 1's
    # rest: the probe's second step and the undrafted steps after the first refresh but one (the
    # refreshes and the step after each are another kind of round than the one before)
    assert table.cells.rounds[0].tolist() == [8, 0, 2] and table.rest.rounds[0].tolist() == [2, 4]


def test_a_round_is_settled_once_its_row_its_cell_and_its_shares_are_trusted():
    """A settled round only refines trusted medians (``StepWidths`` times one in a few): not
    before the row's probes start, nor while its cell, its row's pooled excess or its rest of
    its kind has fewer than ``trust_after`` rounds; an eager batch prices nothing anyway."""
    table = TimedCostTable(
        (1, 8), (1, 3, 5), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], probe_after=3, trust_after=2
    )
    states = []
    for _ in range(3):
        states.append(table.settled(1, 5))
        served(table, 1, 5, 11.0, rest=8.0)
    assert states == [False, False, False]  # no rounds, one, then trusted but before the probes
    assert table.settled(1, 5)
    assert not table.settled(1, 3)  # its own cell has no rounds (the row's trees' shares do)
    assert not table.settled(1, 1)  # width 1: its cell and its kind's shares unmeasured
    assert not table.settled(8, 5)  # another row
    assert table.settled(16, 5)  # past the largest graph: eager, priced by nothing
    table.observe(1, 3, None, 3.0)  # width 3's verify, its period not its own
    table.observe(1, 3, None, 3.0)
    assert table.settled(1, 3)  # its cell trusted; the trees' shares were already
    for _ in range(3):  # row 8: verifies whose periods are not their own, its rest borrowed
        table.observe(8, 5, None, 9.0)
    assert table.cells.rounds[1, 2] == 3 and not table.settled(8, 5)  # its own rest unmeasured


def test_settled_steps_are_timed_one_in_time_every_and_every_other_step_always(monkeypatch):
    """Through ``StepWidths``: every step whose round is not settled is timed (its verify reaches
    the table), and one settled step in ``time_every``; the rest time nothing, so the table and
    the choices it keeps do not move."""
    import math

    from sglang_ddtree.adapter import verify_clock
    from sglang_ddtree.adapter import widths as widths_module
    from sglang_ddtree.adapter.widths import StepWidths

    clock = [1000.0]
    monkeypatch.setattr(widths_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(verify_clock, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    table = TimedCostTable((8,), (1, 3, 5), [[0.2, 0.3, 0.4]], probe_after=2, trust_after=2)
    widths = StepWidths((1, 3, 5), table, depth=4, make_head=lambda width: width, time_every=4)
    observed = []
    observe = table.observe
    monkeypatch.setattr(table, "observe", lambda *args: (observed.append(args[1]), observe(*args)))

    def propose(hidden, k):
        log_probs = torch.full((hidden.shape[0], k), math.log(1e-6))
        log_probs[:, 0] = math.log(0.9)
        return log_probs, torch.arange(k).repeat(hidden.shape[0], 1)

    settled = []
    for _ in range(60):
        width = widths.start(8)
        settled.append(table.settled(8, width))
        if not widths.skips_draft:
            widths.watch(propose)(torch.zeros(8 * 4, 4), 4)
        widths.verify_started()
        clock[0] += 0.5e-3 if width == 1 else 3e-3
        widths.verify_finished()
        clock[0] += 1.5e-3 if width == 1 else 7e-3
        widths.finish(torch.zeros(8, dtype=torch.int64))
    widths.start(8)  # absorbs the last step
    n_settled = sum(settled)
    assert n_settled > 30  # most of the run: the test times settled steps
    assert len(observed) == (len(settled) - n_settled) + n_settled // 4


# --- the swap per step ------------------------------------------------------------------------


def test_each_step_verifies_with_its_widths_backend_and_graphs_and_then_the_largest_again():
    from sglang_ddtree.adapter.width_graphs import WidthRunners

    widest = (SimpleNamespace(name="backend 9"), SimpleNamespace(name="graphs 9"))
    model_runner = SimpleNamespace(attn_backend=widest[0], decode_cuda_graph_runner=widest[1])
    pairs = {w: (SimpleNamespace(name=f"backend {w}"), SimpleNamespace(name=f"graphs {w}")) for w in (1, 3)}
    runners = WidthRunners(model_runner, pairs, largest=9)
    assert runners.widths == (1, 3, 9)
    for width in (3, 1, 9, 3):
        runners.use(width)
        assert model_runner.attn_backend.name == f"backend {width}"
        assert model_runner.decode_cuda_graph_runner.name == f"graphs {width}"
        runners.restore()
        assert (model_runner.attn_backend, model_runner.decode_cuda_graph_runner) == widest
    with pytest.raises(KeyError):
        runners.use(5)


def test_width_1_captures_decode_graphs_and_keeps_its_decode_scratch():
    """Width 1's runner is SGLang's runner class captured as plain decoding (DECODE mode, no
    speculative input, hidden states kept); its backend is not among those whose decode
    scratch is released after capture (its split-KV decode kernel reads it)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    from sglang_ddtree.adapter.width_graphs import WidthRunners, decode_mode_runner, verify_backends

    class Runner:  # what SGLang's runner does: pick the verify mode, then capture in __init__
        def __init__(self):
            self.capture_forward_mode = ForwardMode.TARGET_VERIFY
            self.capture_hidden_mode = CaptureHiddenMode.NULL
            self.capture()

        def capture(self):
            self.captured = (self.capture_forward_mode, self.capture_hidden_mode, self.get_spec_info(4))

        def get_spec_info(self, num_tokens):
            return "a verify input"

    decode = decode_mode_runner(Runner)()
    assert decode.captured == (ForwardMode.DECODE, CaptureHiddenMode.FULL, None)
    assert Runner().captured[0] == ForwardMode.TARGET_VERIFY  # the class itself is untouched
    widest = (SimpleNamespace(name="backend 9"), Runner())
    model_runner = SimpleNamespace(attn_backend=widest[0], decode_cuda_graph_runner=widest[1])
    pairs = {1: (SimpleNamespace(name="backend 1"), decode), 3: (SimpleNamespace(name="backend 3"), Runner())}
    backends = verify_backends(WidthRunners(model_runner, pairs, largest=9))
    assert sorted(b.name for b in backends) == ["backend 3", "backend 9"]


def test_a_decode_backend_shares_the_kv_indices_but_not_the_split_scratch():
    from sglang_ddtree.adapter.width_graphs import share_graph_scratch

    startup = _TritonLikeBackend()
    startup.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * 9)
    decode = _TritonLikeBackend()
    share_graph_scratch(decode, startup, split_scratch=False)
    decode.init_cuda_graph_state(4, 4)
    assert decode.kv_indices_buf_given is startup.cuda_graph_kv_indices
    for name in ("cuda_graph_attn_logits", "cuda_graph_attn_lse"):
        mine, theirs = getattr(decode, name), getattr(startup, name)
        assert mine.shape[0] == 4 and mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()


def test_the_step_loop_swaps_in_its_width_and_cuts_the_graphs_tree_to_it():
    """Per step: ``start`` points the target at the chosen width's pair before the verify,
    the drafter graph's trees come cut to that width (as the head's replay cuts its slots) with
    the log-probs the graph kept, and ``finish`` points the target back at the start-up pair."""
    import math

    from sglang_ddtree.adapter.width_graphs import WidthRunners
    from sglang_ddtree.adapter.widths import StepWidths
    from sglang_ddtree.budget import RoundCostTable

    depth, k, widths = 3, 4, (1, 2, 3, 5)
    cost = RoundCostTable((1, 8), widths, [[1.0, 1.0, 1.0, 1.0], [1.0, 9.0, 9.0, 9.0]])
    steps = StepWidths(widths, cost, depth, make_head=lambda w: SimpleNamespace(k=k))
    startup = (SimpleNamespace(width=5), SimpleNamespace(width=5))
    model_runner = SimpleNamespace(attn_backend=startup[0], decode_cuda_graph_runner=startup[1])
    pairs = {w: (SimpleNamespace(width=w), SimpleNamespace(width=w)) for w in widths[:-1]}
    steps.runners = WidthRunners(model_runner, pairs, largest=5)

    def propose(hidden, k):  # a confident drafter: top-1 at 0.9 on every depth
        log_probs = torch.full((hidden.shape[0], k), math.log(1e-9))
        log_probs[:, 0] = math.log(0.9)
        return log_probs, torch.arange(k).repeat(hidden.shape[0], 1)

    kept = steps.graph_proposal(lambda: propose, max_bs=8, device="cpu")()  # what the drafter's graph runs
    lp, ids, roots, prefix = _inputs(0, 8, depth, 50, 4, k, "none")
    slots = TreeSlots(8, 5, "cpu")  # the drafter graph's output, the widest trees
    t = torch.as_tensor
    PythonBackend().build(t(lp), t(ids), t(roots), t(prefix), 4, 5, out=slots.rows(8))
    seen = []
    for bs in (1, 1, 8, 8, 1):
        width = steps.start(bs)
        assert model_runner.attn_backend.width == width == model_runner.decode_cuda_graph_runner.width
        if steps.skips_draft:  # width 1: no drafter graph replay, the root-only trees
            trees, _ = steps.root_only(torch.as_tensor(roots[:bs]), torch.as_tensor(prefix[:bs]), 10**6)
        else:
            kept(torch.zeros(bs * depth, 16), k)  # the graph's replay writes the kept log-probs
            trees, _ = steps.from_graph((slots.narrowed(bs, width), None))
        assert trees.width == width and trees.tokens.shape[0] == bs
        steps.finish(torch.zeros(bs, dtype=torch.int64))
        assert (model_runner.attn_backend, model_runner.decode_cuda_graph_runner) == startup
        seen.append((width, steps.skips_draft))
    # nothing predicted yet: the root alone, drafted; then the largest tree at bs 1 (flat costs),
    # the root alone at bs 8 (trees cost 9x) in width 1's graphs with no drafter replay, and
    # the tree again at bs 1 from the kept prediction: the choice reads the log-probs the graph kept
    assert seen == [(1, False), (5, False), (1, True), (1, True), (5, False)]


class _TritonLikeBackend:
    """The CUDA-graph state of SGLang's triton backend, as ``init_cuda_graph_state`` sizes it."""

    def __init__(self, heads=2, splits=4, v_dim=8, context=16):
        self.num_head, self.max_kv_splits, self.v_head_dim, self.max_context_len = (
            heads,
            splits,
            v_dim,
            context,
        )
        self.kv_indices_buf_given = None

    def init_cuda_graph_state(
        self, max_bs, max_num_tokens, kv_indices_buf=None, cuda_graph_num_kv_splits_buf=None
    ):
        self.kv_indices_buf_given = kv_indices_buf
        self.cuda_graph_attn_logits = torch.zeros(
            max_num_tokens, self.num_head, self.max_kv_splits, self.v_head_dim
        )
        self.cuda_graph_attn_lse = torch.zeros(max_num_tokens, self.num_head, self.max_kv_splits)
        self.cuda_graph_kv_indices = (
            torch.zeros(max_num_tokens * self.max_context_len, dtype=torch.int64)
            if kv_indices_buf is None
            else kv_indices_buf
        )
        self.cuda_graph_num_kv_splits = torch.full((max_num_tokens,), self.max_kv_splits, dtype=torch.int32)
        width = max_num_tokens // max_bs
        cells = max_bs * width * (self.max_context_len + width)
        self._verify_mask = SimpleNamespace(
            buffer=torch.zeros(cells, dtype=torch.uint8), mode="full", max_bs=max_bs
        )


def test_a_width_backend_uses_the_largest_widths_graph_scratch():
    from sglang_ddtree.adapter.width_graphs import share_graph_scratch

    startup = _TritonLikeBackend()
    startup.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * 9)
    narrow = _TritonLikeBackend()
    share_graph_scratch(narrow, startup)
    narrow.init_cuda_graph_state(4, 4 * 3)  # as SGLang's graph runner calls it
    assert narrow.kv_indices_buf_given is startup.cuda_graph_kv_indices
    for name, rows in (("cuda_graph_attn_logits", 12), ("cuda_graph_attn_lse", 12)):
        mine, theirs = getattr(narrow, name), getattr(startup, name)
        assert mine.shape == (rows, *theirs.shape[1:])
        assert mine.data_ptr() == theirs.data_ptr()
    assert narrow._verify_mask is startup._verify_mask  # each replay copies its mask in first
    # per-width state that is not shared keeps its own size
    assert narrow.cuda_graph_num_kv_splits.shape == (12,)


def test_graph_scratch_of_another_shape_is_not_shared():
    from sglang_ddtree.adapter.width_graphs import share_graph_scratch

    startup = _TritonLikeBackend(splits=4)
    startup.init_cuda_graph_state(4, 36)
    other = _TritonLikeBackend(splits=8)  # another split count: its own scratch
    share_graph_scratch(other, startup)
    other.init_cuda_graph_state(4, 12)
    assert other.cuda_graph_attn_logits.data_ptr() != startup.cuda_graph_attn_logits.data_ptr()
    assert other.cuda_graph_attn_logits.shape == (12, 2, 8, 8)
    assert other.kv_indices_buf_given is startup.cuda_graph_kv_indices  # indices are only indices


def test_a_backend_without_graph_state_is_left_alone():
    from sglang_ddtree.adapter.width_graphs import share_graph_scratch

    class Plain:
        pass

    backend = Plain()
    share_graph_scratch(backend, _TritonLikeBackend())  # the start-up backend captured nothing
    assert not hasattr(backend, "init_cuda_graph_state")


def test_timed_replays_see_spread_token_ids():
    """Capture leaves one id in every input slot (a MoE target would route every token to the
    same experts); the start-up timing replays on distinct ids in the vocabulary."""
    from types import SimpleNamespace

    from sglang_ddtree.adapter.width_graphs import spread_token_ids

    runner = SimpleNamespace(buffers=SimpleNamespace(input_ids=torch.zeros(4 * 65, dtype=torch.int64)))
    spread_token_ids(runner, vocab_size=1000)
    ids = runner.buffers.input_ids
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 1000
    assert len(set(ids.tolist())) > 200  # spread, not one id
    again = SimpleNamespace(buffers=SimpleNamespace(input_ids=torch.zeros(4 * 65, dtype=torch.int64)))
    spread_token_ids(again, vocab_size=1000)
    assert torch.equal(again.buffers.input_ids, ids)  # the same timing inputs at every start
    spread_token_ids(SimpleNamespace(), vocab_size=1000)  # no buffers (another graph backend): nothing


def test_install_times_every_width_on_spread_ids(monkeypatch):
    from types import SimpleNamespace

    from sglang_ddtree.adapter import width_graphs

    def graphs():
        return SimpleNamespace(buffers=SimpleNamespace(input_ids=torch.zeros(64, dtype=torch.int64)))

    target = SimpleNamespace(model_config=SimpleNamespace(vocab_size=500), decode_cuda_graph_runner=graphs())
    pairs = {1: (None, graphs()), 9: (None, graphs())}
    runners = SimpleNamespace(pairs={**pairs, 17: (None, target.decode_cuda_graph_runner)})
    monkeypatch.setattr(width_graphs, "captured_verify_graphs", lambda runner: True)
    monkeypatch.setattr(width_graphs, "build_width_runners", lambda runner, widths, roots_append: runners)
    seen = []

    def timed(graph_runner):
        seen.append(len(set(graph_runner.buffers.input_ids.tolist())))
        return {1: 1.0}

    monkeypatch.setattr(width_graphs, "time_graph_replays", timed)
    widths = SimpleNamespace(
        widths=(1, 9, 17), measured=True, use_cost_table=lambda table: None, cost_rows=dict, kept=None
    )
    width_graphs.install(widths, target, SimpleNamespace())
    assert len(seen) == 3 and all(distinct > 20 for distinct in seen)  # every width, spread


def _excess_by_the_rules(table: TimedCostTable, row: int, column: int) -> float:
    """The excess a cell costs, re-derived one cell at a time from the rules in
    ``budget/timed_costs.py``'s docstring (the table computes a whole row at once)."""
    trusted = [r for r in range(len(table.batch_sizes)) if table.cells.rounds[r, column] >= table.trust_after]
    kind = 1 if table.widths[column] == 1 else 0
    if trusted:
        nearest = min(trusted, key=lambda r: (abs(r - row), r))
        return float(np.median(table.cells.windows[nearest][column]))
    pooled = [r for r in range(len(table.batch_sizes)) if table.pooled.rounds[r, kind] >= table.trust_after]
    source = min(pooled, key=lambda r: (abs(r - row), r)) if pooled else row
    if kind == 1 and not table.pooled.rounds[source, 1]:
        return _pooled_trees(table, row)  # width 1 measured nowhere near: the trees' bound
    window = table.pooled.windows[source][kind]
    return float(np.median(window)) if window else 0.0


def _pooled_trees(table: TimedCostTable, row: int) -> float:
    pooled = [r for r in range(len(table.batch_sizes)) if table.pooled.rounds[r, 0] >= table.trust_after]
    source = min(pooled, key=lambda r: (abs(r - row), r)) if pooled else row
    window = table.pooled.windows[source][0]
    return float(np.median(window)) if window else 0.0


def test_a_rows_costs_at_once_are_each_cells_by_the_rules_and_choose_the_reference_width():
    """The chooser reads a whole row of costs per step (vectorised); on random rounds every
    cell equals the rules applied one cell at a time, and the choice equals the readable
    ``best_score(score_widths(...))``."""
    from sglang_ddtree.budget.online import best_score, score_widths

    rng = np.random.default_rng(7)
    rows, widths = (1, 2, 4, 8, 16), (1, 2, 4, 8, 9)
    startup = rng.uniform(5.0, 15.0, (len(rows), len(widths)))
    table = TimedCostTable(rows, widths, startup, probe_after=3, trust_after=3, window=5)
    chooser = WidthChooser(widths, table, switch_margin=0.0)
    for step in range(400):
        bs = int(rng.integers(1, 24))  # past the largest (16) too: eager, kept out
        served(table, bs, int(rng.choice(widths)), float(rng.uniform(4.0, 30.0)))
        if step % 20:
            continue
        for r, b in enumerate(rows):
            expected = [
                max(startup[r, c] + _excess_by_the_rules(table, r, c), 0.05 * startup[r, c])
                for c in range(len(widths))
            ]
            assert table.row_costs(b) == pytest.approx(expected)
        accepted = rng.uniform(0.0, 3.0 * bs, len(widths))
        reference = best_score(score_widths(bs, widths, accepted, table)).width
        chooser.current = None
        assert chooser.choose(bs, accepted) == reference
        assert [s.tokens_per_ms for s in chooser.last_scores] == pytest.approx(
            [s.tokens_per_ms for s in score_widths(bs, widths, accepted, table)]
        )
