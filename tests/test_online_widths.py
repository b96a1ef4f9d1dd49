"""The online budget's per-step width as the eager round drives it (``adapter/widths.py``),
without a server: the candidate widths, the probed cost table, the step loop's use of
the previous step's prediction, its calibration and its costs, and width-1 steps that skip
the drafter (the root-only trees, the kept prediction, the tree coming back) (CPU, torch)."""

import math
import statistics

import numpy as np
import pytest
import torch

from sglang_ddtree.adapter.refresh import FIRST_REFRESH, REFRESH_EVERY
from sglang_ddtree.adapter.widths import StepWidths
from sglang_ddtree.budget import ProbedCostTable, RoundCostTable, TimedCostTable, candidate_widths
from sglang_ddtree.kernels.backend import CppBackend, PythonBackend
from sglang_ddtree.tree.layout import build_tree_batch_ref, pack_mask_words
from sglang_ddtree.tree.types import Trees

DEPTH = 4


def test_candidate_widths_are_the_powers_of_two_below_the_largest_and_the_largest():
    assert candidate_widths(1) == (1, 2)
    assert candidate_widths(3) == (1, 2, 4)
    assert candidate_widths(7) == (1, 2, 4, 8)
    assert candidate_widths(15) == (1, 2, 4, 8, 16)
    assert candidate_widths(16) == (1, 2, 4, 8, 16, 17)
    assert candidate_widths(32) == (1, 2, 4, 8, 16, 32, 33)
    with pytest.raises(ValueError):
        candidate_widths(0)


def test_probed_table_measures_every_width_then_follows_the_rounds():
    table = ProbedCostTable((1, 4), (1, 3), probes=2, refine_decay=0.5)
    assert table.unprobed(1) == 1 and table.unprobed(3) == 1
    table.observe(1, 1, 9.0)  # a first round with one-time work
    table.observe(1, 1, 4.0)
    assert table.unprobed(1) == 3 and table(1, 1) == 4.0  # the fastest probe
    table.observe(1, 3, 6.0)
    table.observe(1, 3, 8.0)
    assert table.unprobed(1) is None and table(1, 3) == 6.0
    assert table.unprobed(2) == 1  # another row (2 -> 4) is probed on its own
    table.observe(1, 3, 10.0)  # past the probes: exponentially weighted
    assert table(1, 3) == pytest.approx(8.0)
    table.observe(1, 3, float("nan"))
    assert table(1, 3) == pytest.approx(8.0)


def confident_drafter(top1):
    """A propose() whose drafter puts ``top1`` on one token per depth (the rest ~0)."""

    def propose(hidden, k):
        n = hidden.shape[0]
        log_probs = torch.full((n, k), math.log(1e-12), dtype=torch.float32)
        log_probs[:, 0] = math.log(top1)
        return log_probs, torch.arange(k).repeat(n, 1)

    return propose


def run_step(widths: StepWidths, bs: int, accept_len: int, top1: float = 0.9) -> int:
    """One step as the worker runs it: the drafter proposes unless the step skips it."""
    width = widths.start(bs)
    if not widths.skips_draft:
        widths.watch(confident_drafter(top1))(torch.zeros(bs * DEPTH, 8), 4)
    widths.finish(torch.full((bs,), min(accept_len, width - 1), dtype=torch.int64))
    return width


def step_widths(cost, **kw) -> StepWidths:
    return StepWidths((1, 2, 3, 5), cost, DEPTH, make_head=lambda width: width, **kw)


def test_without_a_prediction_the_root_alone_then_the_best_width():
    flat = RoundCostTable((1, 8), (1, 2, 3, 5), [[10.0] * 4, [10.0] * 4])
    widths = step_widths(flat)
    assert widths.heads == {1: 1, 2: 2, 3: 3, 5: 5}
    assert run_step(widths, bs=1, accept_len=4) == 1  # nothing predicted yet
    assert run_step(widths, bs=1, accept_len=4) == 5  # equal costs: the most expected tokens
    assert widths.summary()["width_steps_by_bs"] == {1: {1: 1, 5: 1}}


def chain_expected(top1, width):
    """A confident chain's expected accepted drafts at a verify width (its first nodes)."""
    return sum(top1**d for d in range(1, min(width, DEPTH + 1)))


def test_the_choice_scales_the_last_prediction_to_the_batch_and_flips_with_cost():
    """After one request's step, a batch of ``bs`` expects ``bs`` times its prediction; with
    ``T = bs * w + 4`` the tree pays at small batches and the root alone at large ones."""

    def cost(bs, width):
        return bs * width + 4.0

    table = RoundCostTable.from_function(tuple(range(1, 65)), (1, 2, 3, 5), cost)
    chosen = {}
    for bs in (1, 2, 4, 8, 16, 32, 64):
        widths = step_widths(table)
        widths.chooser.switch_margin = 0.0  # the pure argmax (the hysteresis has its own tests)
        run_step(widths, bs=1, accept_len=0)  # width 1: a prediction, nothing to calibrate yet
        chosen[bs] = widths.start(bs)
        rates = {w: (bs * chain_expected(0.9, w) + bs) / cost(bs, w) for w in (1, 2, 3, 5)}
        assert chosen[bs] == max(rates, key=lambda w: (rates[w], -w)), (bs, rates)
        scores = {s.width: s.expected_accepted for s in widths.chooser.last_scores}
        assert scores == pytest.approx({w: bs * chain_expected(0.9, w) for w in (1, 2, 3, 5)}, rel=1e-6)
    assert chosen[1] == 5 and chosen[64] == 1, chosen


def test_calibration_learns_what_the_target_accepts():
    flat = RoundCostTable((1,), (1, 2, 3, 5), [[1.0] * 4])
    widths = step_widths(flat, predict_every=1)
    for _ in range(200):  # the drafter predicts 0.9 per depth; the target accepts one draft only
        run_step(widths, bs=2, accept_len=1)
    widths.start(2)  # absorbs the last step
    scale = widths.expected.calibration.scale
    assert scale[0] == pytest.approx(1 / 0.9, rel=0.05)
    assert scale[1:] == pytest.approx([0.2] * (DEPTH - 1))  # clamped: deeper depths never reached


def test_measured_costs_probe_every_width_twice_before_choosing():
    widths = step_widths(ProbedCostTable((1, 2, 4), (1, 2, 3, 5), probes=2))
    assert run_step(widths, bs=1, accept_len=4) == 1 and not widths.skips_draft  # nothing predicted
    assert widths.cost.counts[0].tolist() == [0, 0, 0, 0]  # a width-1 round with a draft: not width 1's cost
    # the first round after a change is not costed (under overlap its period is the round
    # before it), so each width runs once more than its probes
    probes = [run_step(widths, bs=1, accept_len=4) for _ in range(12)]
    assert probes == [1, 1, 1, 2, 2, 2, 3, 3, 3, 5, 5, 5]
    assert run_step(widths, bs=1, accept_len=4) in (1, 2, 3, 5)
    assert run_step(widths, bs=3, accept_len=4) == 1  # a new batch-size row is probed again
    assert widths.cost.counts[0].tolist() == [2, 2, 2, 2]
    assert np.all(widths.cost.ms[0] > 0)


# --- width 1 without the drafter --------------------------------------------------------------


@pytest.mark.parametrize("backend", [PythonBackend(), CppBackend()], ids=["python", "cpp"])
def test_root_only_trees_are_what_a_build_at_budget_zero_gives(backend):
    rng = np.random.default_rng(7)
    bs, depth, k, vocab = 5, 4, 3, 100
    log_probs = np.sort(np.log(rng.dirichlet(np.ones(k), size=(bs, depth))), axis=-1)[..., ::-1].copy()
    token_ids = rng.integers(0, vocab, size=(bs, depth, k)).astype(np.int64)
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    prefix = rng.integers(0, 5000, size=bs).astype(np.int64)
    ref = build_tree_batch_ref(log_probs.astype(np.float32), token_ids, roots, 0, 1)
    t = torch.as_tensor
    built = backend.build(t(log_probs).float(), t(token_ids), t(roots), t(prefix), 0, 1)
    roots_in, prefix_in = t(roots).clone(), t(prefix).clone()
    root_only = Trees.root_only(roots_in, prefix_in)
    want = {
        "tokens": ref.tokens,
        "depths": ref.depths,
        "parents": ref.parents,
        "positions": ref.positions(prefix),
        "tree_sizes": ref.tree_sizes,
        "mask_words": pack_mask_words(ref.visibility),
    }
    for field, expected in want.items():
        got = getattr(root_only, field)
        assert got.dtype == getattr(built, field).dtype, field
        assert torch.equal(got, t(expected).to(got.dtype)), field
        assert torch.equal(got, getattr(built, field)), field
    root_only.positions += 1  # copies: the round clamps positions in place
    root_only.tokens += 1
    assert torch.equal(prefix_in, t(prefix)) and torch.equal(roots_in, t(roots))


def test_a_step_without_the_drafter_gets_root_only_trees_clamped_to_the_last_position():
    widths = step_widths(RoundCostTable((1,), (1, 2, 3, 5), [[1.0] * 4]))
    trees, top1 = widths.root_only(torch.tensor([7, 8]), torch.tensor([3, 40]), last_position=31)
    assert trees.width == 1 and trees.positions.tolist() == [[3], [31]]
    assert top1.shape == (2, DEPTH)


def batch_heavy_cost(bs, width):
    """Flat at batch size 1 (the largest tree wins); above it a tree costs ``10 w^2``."""
    return 10.0 if bs == 1 else 10.0 * width * width


def test_width_one_skips_the_drafter_keeps_the_prediction_and_the_tree_comes_back():
    table = RoundCostTable.from_function((1, 2, 4, 8), (1, 2, 3, 5), batch_heavy_cost)
    widths = step_widths(table, first_refresh=64)  # no refresh in these steps (the next tests)
    assert run_step(widths, bs=1, accept_len=4) == 1 and not widths.skips_draft  # nothing predicted yet
    assert run_step(widths, bs=1, accept_len=4) == 5 and not widths.skips_draft
    widths._absorb_landed()
    scale, kept = widths.expected.calibration.scale.copy(), widths.expected.per_request.copy()
    loaded = [(run_step(widths, bs=8, accept_len=0), widths.skips_draft) for _ in range(20)]
    assert loaded == [(1, True)] * 20  # under load: the root alone, no drafter
    assert widths.summary()["width1_steps_without_draft"] == 20
    widths._absorb_landed()
    np.testing.assert_array_equal(widths.expected.calibration.scale, scale)  # no evidence about any depth
    np.testing.assert_array_equal(widths.expected.per_request, kept)  # the last prediction, kept as it was
    assert run_step(widths, bs=1, accept_len=4) == 5  # the batch shrank: the tree is back
    assert not widths.skips_draft
    scores = {s.width: s.expected_accepted for s in widths.chooser.last_scores}
    assert scores[5] == pytest.approx(widths.expected.calibration.calibrated(kept)[3])
    assert run_step(widths, bs=8, accept_len=0) == 1 and widths.skips_draft  # and gone again under load


def test_a_long_run_at_width_one_drafts_once_in_a_while_to_refresh_the_prediction():
    table = RoundCostTable.from_function((1, 8), (1, 2, 3, 5), batch_heavy_cost)
    widths = step_widths(table, refresh_every=8)
    drafted = []
    for _ in range(27):
        assert run_step(widths, bs=8, accept_len=0) == 1
        drafted.append(not widths.skips_draft)
    # the first (nothing predicted), then one after 2, 4, 8 and again 8 steps without a draft
    runs = "".join("D" if d else "." for d in drafted).split("D")
    assert drafted[0] and [len(r) for r in runs[1:-1]] == [2, 4, 8, 8], drafted
    assert widths.summary()["width1_steps_without_draft"] == 22
    run_step(widths, bs=8, accept_len=0)
    widths._absorb_landed()
    assert widths.expected.per_request[-1].sum() == pytest.approx(
        chain_expected(0.9, 5)
    )  # refreshed, per request


def test_refresh_every_zero_keeps_a_width_one_run_without_drafts(monkeypatch):
    """``$SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY=0`` (the A/B's width-1-only arm, the step
    alone): once a prediction is made no width-1 step drafts, neither after a run nor for a
    batch of new requests; unset, the same steps refresh."""
    from sglang_ddtree.adapter.draft_head import DraftTreeHead
    from sglang_ddtree.config import DDTreeConfigError

    table = RoundCostTable.from_function((1, 8), (1, 2, 3, 5), batch_heavy_cost)
    for refresh_every, drafts in ((0, 1), (REFRESH_EVERY, 6)):
        widths = step_widths(table, refresh_every=refresh_every)
        drafted = 0
        for step in range(40):
            if step == 20:
                widths.interrupt(joined=8)  # the whole batch new
            assert run_step(widths, bs=8, accept_len=0) == 1
            drafted += not widths.skips_draft
        assert drafted == drafts  # the first step (nothing predicted yet) only, or its refreshes
    head = DraftTreeHead(trees_backend=PythonBackend(), budget=4, width=5, block=5, k=4, last_position=63)
    assert StepWidths.like(head, 4, DEPTH).refresh.refresh_every == REFRESH_EVERY
    monkeypatch.setenv("SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY", "0")
    assert StepWidths.like(head, 4, DEPTH).refresh.refresh_every == 0
    monkeypatch.setenv("SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY", "-1")
    with pytest.raises(DDTreeConfigError, match="REFRESH_EVERY"):
        StepWidths.like(head, 4, DEPTH)


def test_a_noisy_prediction_that_chose_width_one_is_checked_again_within_a_few_steps():
    """One drafted step's prediction is noisy: a low one (top-1 0.05 at one step) chooses width 1,
    and the next steps skip the drafter on it. After FIRST_REFRESH of them a step drafts again
    (the drafter is confident again) and the tree is back: not ``refresh_every`` steps later."""
    table = RoundCostTable((1, 8), (1, 2, 3, 5), [[1.0, 3.0, 3.0, 3.0]] * 2)
    widths = step_widths(table, predict_every=1)  # every drafted step predicts
    steps = []
    for top1 in (0.9, 0.9, 0.05, 0.9, 0.9, 0.9, 0.9, 0.9):
        width = run_step(widths, bs=1, accept_len=3 if top1 > 0.5 else 0, top1=top1)
        steps.append((width, widths.skips_draft))
    # the first (nothing predicted), the tree, the tree whose draft predicts little, width 1
    # without the drafter twice on that prediction, a refresh at width 1, the tree again
    assert steps == [
        (1, False),
        (5, False),
        (5, False),
        (1, True),
        (1, True),
        (1, False),
        (5, False),
        (5, False),
    ]
    # after the tree, a later run at width 1 is re-checked as soon
    assert widths.refresh.after == FIRST_REFRESH


def test_a_batch_half_new_since_the_prediction_refreshes_it_at_its_next_width_one_step():
    """A request the drafter cannot follow (top-1 0.05) leaves a prediction that picks width 1;
    the next request (top-1 0.95) joins through a prefill, and its first step drafts to
    predict instead of serving the root alone on the old prediction for ``refresh_every``
    steps. An idle pass brings no request; one request joining a batch of 8 leaves the
    prediction as it was, until half the batch is new."""
    table = RoundCostTable((1, 8), (1, 2, 3, 5), [[1.0, 3.0, 3.0, 3.0], [1.0, 3.0, 3.0, 3.0]])
    widths = step_widths(table, first_refresh=64)  # only a joining batch refreshes here
    for _ in range(4):
        assert run_step(widths, bs=1, accept_len=0, top1=0.05) == 1
    assert widths.skips_draft  # the root alone, on the kept prediction
    widths.interrupt()  # an idle pass
    assert run_step(widths, bs=1, accept_len=0) == 1 and widths.skips_draft
    widths.interrupt(joined=1)  # the next request's prefill: the whole batch is new
    assert run_step(widths, bs=1, accept_len=3, top1=0.95) == 1 and not widths.skips_draft
    assert run_step(widths, bs=1, accept_len=3, top1=0.95) == 5  # its own prediction: the tree

    widths = step_widths(table, first_refresh=64)
    for _ in range(4):
        assert run_step(widths, bs=8, accept_len=0, top1=0.05) == 1
    for _ in range(3):  # one request a prefill: 1, 2, 3 of 8 new
        widths.interrupt(joined=1)
        assert run_step(widths, bs=8, accept_len=0, top1=0.05) == 1 and widths.skips_draft
    widths.interrupt(joined=1)  # 4 of 8
    assert run_step(widths, bs=8, accept_len=0, top1=0.05) == 1 and not widths.skips_draft
    widths.interrupt(joined=1)  # the prediction was just made: 1 of 8 again
    assert run_step(widths, bs=8, accept_len=0, top1=0.05) == 1 and widths.skips_draft


def test_pinned_the_online_budget_chooses_and_books_but_runs_the_widest_tree(monkeypatch):
    """``$SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST`` (the round benchmark's ``+pinned``): every
    step does the online budget's work (the prediction, the choice, the table) and runs the
    widest tree, so a server's own cost of that work can be set apart from its choices."""
    from sglang_ddtree.adapter.draft_head import DraftTreeHead

    cheap_root = RoundCostTable((8,), (1, 2, 3, 5), [[1.0, 30.0, 30.0, 30.0]])
    for pinned, expected in ((False, 1), (True, 5)):
        widths = step_widths(cheap_root, pinned=pinned)
        run_step(widths, bs=8, accept_len=0)
        assert run_step(widths, bs=8, accept_len=0) == expected
        assert [s.width for s in widths.chooser.last_scores] == [1, 2, 3, 5]  # a choice was made
        assert not widths.skips_draft or not pinned  # the widest tree drafts
    head = DraftTreeHead(trees_backend=PythonBackend(), budget=4, width=5, block=5, k=4, last_position=63)
    assert not StepWidths.like(head, 4, DEPTH).pinned
    monkeypatch.setenv("SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST", "1")
    assert StepWidths.like(head, 4, DEPTH).pinned


def test_only_width_one_rounds_without_a_draft_cost_width_one():
    widths = step_widths(ProbedCostTable((1, 8), (1, 2, 3, 5), probes=1))
    run_step(widths, bs=8, accept_len=0)  # width 1 with a draft: nothing predicted yet
    assert run_step(widths, bs=8, accept_len=0) == 1 and widths.skips_draft
    assert widths.cost.counts[1].tolist() == [0, 0, 0, 0]  # the first step's period: not width 1's
    # the first width-1 step without a draft follows a drafted one (under overlap its period
    # is that step's round): not costed either; the next one is
    assert run_step(widths, bs=8, accept_len=0) == 1 and widths.skips_draft
    assert widths.cost.counts[1].tolist() == [0, 0, 0, 0]
    run_step(widths, bs=8, accept_len=0)  # its start ends the period of the width-1 step before
    assert widths.cost.counts[1].tolist() == [1, 0, 0, 0]


def test_a_step_costs_its_period_unless_another_batch_ran_in_between(monkeypatch):
    """The cost of a step is the host time from its start to the next step's start (what the
    step costs the server, the scheduler's work between steps included). Left out: a step with
    a prefill after it (``interrupt``), the step after that prefill, and a step that ran
    otherwise than the one before it (under overlap both periods hold the device time of what
    ran before them: the prefill, the other width's round)."""
    import sglang_ddtree.adapter.widths as widths_module

    clock = iter([0.0, 1.0, 1.5, 1.504, 1.6, 1.610, 5.0, 5.003])
    monkeypatch.setattr(widths_module.time, "perf_counter", lambda: next(clock))
    widths = step_widths(ProbedCostTable((1, 8), (1, 2, 3, 5), probes=1))
    run_step(widths, bs=8, accept_len=0)  # t=0: width 1 with a draft (not width 1's cost)
    assert run_step(widths, bs=8, accept_len=0) == 1 and widths.skips_draft  # t=1.0: after a draft
    assert run_step(widths, bs=8, accept_len=0) == 1  # t=1.5: not costed, so still unprobed
    assert run_step(widths, bs=8, accept_len=0) == 2  # t=1.504: the width-1 step took 4 ms
    assert widths.cost.counts[1].tolist() == [1, 0, 0, 0] and widths.cost(8, 1) == pytest.approx(4.0)
    assert run_step(widths, bs=8, accept_len=0) == 2  # t=1.6: the first width-2 step was not costed
    widths.interrupt()  # a prefill: the width-2 step that started at 1.6 is not costed
    assert run_step(widths, bs=8, accept_len=0) == 2  # t=1.610, still unprobed
    assert widths.cost.counts[1].tolist() == [1, 0, 0, 0]
    # t=5.0: the step after the prefill took 3390 ms, the prefill's device time with it
    assert run_step(widths, bs=8, accept_len=0) == 2
    assert widths.cost.counts[1].tolist() == [1, 0, 0, 0]
    assert run_step(widths, bs=8, accept_len=0) == 3  # t=5.003: the next width-2 step took 3 ms
    assert widths.cost.counts[1].tolist() == [1, 1, 0, 0] and widths.cost(8, 2) == pytest.approx(3.0)


def test_one_drafted_step_in_predict_every_makes_the_prediction():
    """The prediction costs device work every step it is made; it is made on the first step,
    then on one drafted step in ``predict_every``. The steps in between choose from the last
    prediction (scaled to their batch size)."""
    flat = RoundCostTable((1, 8), (1, 2, 3, 5), [[10.0] * 4, [10.0] * 4])
    widths = step_widths(flat, predict_every=4)
    predicted, chosen = [], []
    for _ in range(13):
        chosen.append(run_step(widths, bs=2, accept_len=2))
        predicted.append(widths._pending[-1].values is not None)
    assert chosen == [1] + [5] * 12  # nothing predicted yet, then the widest (equal costs)
    assert predicted == [True, False, False, False] * 3 + [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_online_budget_step_does_not_synchronise_with_the_gpu():
    """``start``/``finish`` of a predicting step on CUDA tensors, under PyTorch's sync debug
    mode set to raise: a copy from pageable memory or a host read of a device value (both
    stall the overlapped scheduler every step) fails the test."""
    table = TimedCostTable((1, 8), (1, 2, 3, 5), [[1.0] * 4, [2.0] * 4], probe_after=2)
    widths = step_widths(table, predict_every=1)

    def propose(hidden, k):
        log_probs = torch.full((hidden.shape[0], k), math.log(1e-6), device="cuda")
        log_probs[:, 0] = math.log(0.9)
        return log_probs, torch.arange(k, device="cuda").repeat(hidden.shape[0], 1)

    def step():
        width = widths.start(4)
        if not widths.skips_draft:
            widths.watch(propose)(torch.zeros(4 * DEPTH, 8, device="cuda"), 4)
        widths.verify_started()
        torch.cuda._sleep(1000)  # the verify forward
        widths.verify_finished()
        widths.finish(torch.full((4,), min(2, width - 1), dtype=torch.int64, device="cuda"))

    for _ in range(3):  # first-use work (pinned host blocks, kernels) outside the check
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    widths.start(4)
    assert sum(widths.history.values()) == 14 and widths.expected.per_request is not None
    assert table.rows_served()[1]  # the timed rounds reached the table (through their verify times)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_steps_verify_is_timed_on_the_device_and_the_rest_of_its_period_is_the_rows():
    """A host-bound round: the verify's kernels take ~2 ms of device time while the host goes on
    for 3 ms before the next step (the device's 2 ms hide under it). The cell gets the verify's
    device time (CUDA events, not the host's clock), the row's rest the remainder of the period,
    so the width costs its period."""
    import time

    def sleep_kernel_ms(cycles: int) -> float:
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        torch.cuda._sleep(cycles)
        ended.record()
        torch.cuda.synchronize()
        return began.elapsed_time(ended)

    cycles = int(1_000_000 * 2.0 / sleep_kernel_ms(1_000_000))  # about 2 ms of device time
    device_ms = statistics.median(sleep_kernel_ms(cycles) for _ in range(5))
    table = TimedCostTable((4,), (1, 2, 3, 5), [[0.5] * 4], probe_after=10**6)
    widths = step_widths(table)
    starts = []
    for _ in range(24):
        starts.append(time.perf_counter())
        width = widths.start(4)
        if not widths.skips_draft:
            widths.watch(confident_drafter(0.9))(torch.zeros(4 * DEPTH, 8), 4)
        widths.verify_started()
        torch.cuda._sleep(cycles)
        widths.verify_finished()
        time.sleep(0.003)  # the host's work after the verify, the scheduler's between steps
        widths.finish(torch.full((4,), min(2, width - 1), dtype=torch.int64))
    torch.cuda.synchronize()
    widths.start(4)  # lands what the steps recorded
    column = table.widths.index(5)
    assert table.cells.rounds[0, column] >= 8
    assert table.cells.median[0, column] + 0.5 == pytest.approx(device_ms, rel=0.1)
    period_ms = statistics.median(np.diff(starts)) * 1e3
    assert 3.0 <= period_ms < 5.0  # the host's 3 ms (the device's 2 hidden under them) and its Python
    assert table.rest.median[0, 0] == pytest.approx(period_ms - device_ms, abs=0.3)
    assert table(4, 5) == pytest.approx(period_ms, abs=0.3)


def test_step_events_are_recorded_on_the_stream_asked_by_device_index(monkeypatch):
    """The verify clock records its CUDA events on the current stream asked for by the current
    device's index, and the worker's stream helper does too: without an index torch looks the
    device up through its availability check (NVML, environment reads) at every call, tens of
    microseconds a step on a host-bound GPU server."""
    from sglang_ddtree.adapter.streams import current_stream
    from sglang_ddtree.adapter.verify_clock import VerifyTime

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: asked.append(device) or f"stream {device}"
    )

    class Event:
        def record(self, stream=None):
            self.stream = stream

    clock = VerifyTime([Event(), Event()])
    clock.end()
    assert (clock.began.stream, clock.ended.stream) == ("stream 3", "stream 3")
    assert current_stream(torch.device("cuda")) == "stream 3"
    assert asked == [3, 3, 3]
    assert current_stream("cpu") is not None and asked == [3, 3, 3]  # a CPU server's own stream


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_prediction_graph_replays_the_eager_prediction_at_every_batch_size():
    """The prediction captured once over the drafter graph's kept buffer (``kept_prediction.py``):
    at each batch size, after larger batches left their rows behind, its replay gives what the
    operations one by one give for the batch alone, and it waits for nothing on the host."""
    from sglang_ddtree.adapter.kept_prediction import KeptLogProbs, PredictionGraph
    from sglang_ddtree.tree.expected_accept import reach_totals_at_widths

    depth, k, max_bs = 7, 16, 32
    widths = candidate_widths(63)
    kept = KeptLogProbs(max_bs, depth, k, "cuda")
    graph = PredictionGraph(kept, widths)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for bs in (32, 5, 17, 1, 32, 2):
        logits = torch.randn(bs * depth, k, device="cuda", generator=gen)
        logits[:, 0] += 4.0
        log_probs = torch.log_softmax(logits, -1).sort(-1, descending=True).values
        kept.keeping(lambda hidden, k, drafted=log_probs: (drafted, None))(None, k)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replayed = graph.predict(bs).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager = reach_totals_at_widths(log_probs.view(bs, depth, k), widths)
        torch.testing.assert_close(replayed, eager, rtol=1e-9, atol=1e-9)
