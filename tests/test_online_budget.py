"""The online budget: calibration, cost table and the width choice (CPU only, injected costs)."""

import math

import numpy as np
import pytest
import torch

from sglang_ddtree.budget import (
    DepthCalibration,
    RoundCostTable,
    WidthChooser,
    reach_counts,
    score_widths,
)
from sglang_ddtree.tree import topk_log_probs
from sglang_ddtree.tree.batched import accept_walk
from sglang_ddtree.tree.expected_accept import expected_accepted, reach_at_widths, reach_by_depth
from sglang_ddtree.tree.layout import build_tree_batch_ref

BATCH_SIZES = tuple(range(1, 65))


class OnlineBudget:
    """The chooser and the calibration composed as a step uses them, on this step's own
    prediction (the server's ``adapter/widths.py`` chooses from the previous step's, so that
    it never waits for the device; the arithmetic is the same)."""

    def __init__(self, widths, cost, depth, calibration=None, switch_margin=0.03):
        self.chooser = WidthChooser(widths, cost, switch_margin)
        self.widths = self.chooser.widths
        self.calibration = calibration or DepthCalibration(depth)
        self.history: dict[int, int] = {}
        self._chosen = None

    def choose(self, reach: torch.Tensor) -> int:
        totals = reach_at_widths(reach, self.widths).to(torch.float64).numpy()  # [n_widths, depth]
        width = self.chooser.choose(reach.shape[0], self.calibration.calibrated(totals))
        self._chosen = totals[self.widths.index(width)]
        self.history[width] = self.history.get(width, 0) + 1
        return width

    def record(self, accept_lens: torch.Tensor) -> None:
        if self._chosen is None:
            raise RuntimeError("record() without a choose() before it")
        predicted, self._chosen = self._chosen, None
        self.calibration.update(reach_counts(accept_lens, self.calibration.depth), predicted)


def chain_log_probs(bs, depth, top1, k=4):
    """A drafter sure of one token per depth with probability ``top1`` (the rest ~0): its
    best-first tree of budget b <= depth is a chain accepting sum_{d<=b} top1^d."""
    log_probs = torch.full((bs, depth, k), math.log(1e-15), dtype=torch.float64)
    log_probs[:, :, 0] = math.log(top1)
    return log_probs


def chain_expected(top1, width):
    return sum(top1**d for d in range(1, width))


def linear_cost(fixed_ms, per_token_ms):
    return lambda bs, width: fixed_ms + per_token_ms * bs * width


# --------------------------------------------------------------------------- the choice


def test_choice_flips_from_tree_to_plain_where_the_arithmetic_says():
    # rate(4) > rate(1)  <=>  (1 + g)(c0 + c1 bs) > c0 + 4 c1 bs  <=>  bs < g c0 / (c1 (3 - g))
    top1, c0, c1 = 0.8, 10.0, 0.5
    gain = chain_expected(top1, 4)
    crossover = gain * c0 / (c1 * (3 - gain))
    assert 2 < crossover < 63  # the flip lies inside the captured batch sizes
    cost = RoundCostTable.from_function(BATCH_SIZES, (1, 4), linear_cost(c0, c1))
    for bs in BATCH_SIZES:
        budget = OnlineBudget((1, 4), cost, depth=3, switch_margin=0.0)
        width = budget.choose(reach_by_depth(chain_log_probs(bs, 3, top1), 3))
        assert width == (4 if bs < crossover else 1), bs


@pytest.mark.parametrize("top1", [0.5, 0.75, 0.9, 0.97])
@pytest.mark.parametrize("c0, c1", [(5.0, 0.01), (5.0, 0.2), (1.0, 1.0)])
def test_choice_is_the_argmax_of_tokens_per_ms_over_many_widths(top1, c0, c1):
    widths, depth = (1, 2, 3, 5, 8), 7
    cost = RoundCostTable.from_function((1, 2, 4, 8, 16, 32, 64), widths, linear_cost(c0, c1))
    for bs in (1, 3, 5, 16, 40, 64):
        budget = OnlineBudget(widths, cost, depth, switch_margin=0.0)
        served = min(b for b in (1, 2, 4, 8, 16, 32, 64) if b >= bs)  # the graph that holds bs
        rates = {w: bs * (1 + chain_expected(top1, w)) / (c0 + c1 * served * w) for w in widths}
        reach = reach_by_depth(chain_log_probs(bs, depth, top1), widths[-1] - 1)
        assert budget.choose(reach) == max(widths, key=lambda w: (rates[w], -w))


def test_ties_go_to_the_smaller_width():
    cost = RoundCostTable.from_function((1,), (1, 2), lambda bs, w: float(w))
    # width 2 commits twice the tokens in twice the time
    assert WidthChooser((1, 2), cost, switch_margin=0.0).choose(1, [0.0, 1.0]) == 1


def test_hysteresis_switches_only_past_the_margin_both_ways():
    top1, c0, c1, margin = 0.8, 10.0, 0.5, 0.05
    cost = RoundCostTable.from_function(BATCH_SIZES, (1, 4), linear_cost(c0, c1))
    gain = chain_expected(top1, 4)

    def rates(bs):
        return bs / cost(bs, 1), bs * (1 + gain) / cost(bs, 4)

    chooser = WidthChooser((1, 4), cost, switch_margin=margin)
    up = [chooser.choose(bs, [0.0, bs * gain]) for bs in BATCH_SIZES]
    down = [chooser.choose(bs, [0.0, bs * gain]) for bs in reversed(BATCH_SIZES)]
    to_plain = next(bs for bs in BATCH_SIZES if rates(bs)[0] > rates(bs)[1] * (1 + margin))
    to_tree = next(bs for bs in reversed(BATCH_SIZES) if rates(bs)[1] > rates(bs)[0] * (1 + margin))
    assert up == [4 if bs < to_plain else 1 for bs in BATCH_SIZES]
    assert down == [1 if bs > to_tree else 4 for bs in reversed(BATCH_SIZES)]
    crossover = gain * c0 / (c1 * (3 - gain))
    assert to_tree < crossover < to_plain  # a band where neither direction switches


def test_score_widths_reports_the_rate_of_every_width():
    cost = RoundCostTable((4,), (1, 9), [[2.0, 5.0]])
    scores = score_widths(3, (1, 9), [0.0, 6.0], cost)
    assert [s.tokens_per_ms for s in scores] == pytest.approx([3 / 2.0, 9 / 5.0])


# --------------------------------------------------------------------------- cost table


def test_cost_table_serves_a_batch_from_the_smallest_captured_size_that_holds_it():
    table = RoundCostTable((1, 4, 16), (1, 8), [[1.0, 2.0], [1.5, 3.0], [2.0, 6.0]])
    assert table(1, 8) == 2.0
    assert table(2, 8) == 3.0 and table(4, 8) == 3.0
    assert table(5, 1) == 2.0
    assert table(32, 8) == pytest.approx(12.0)  # past the largest graph: eager, grows with bs


@pytest.mark.parametrize(
    "args",
    [((1, 1), (2,), [[1.0], [1.0]]), ((1,), (2,), [[0.0]]), ((1,), (3, 2), [[1.0, 1.0]])],
)
def test_cost_table_rejects_bad_tables(args):
    with pytest.raises(ValueError):
        RoundCostTable(*args)


def test_cost_table_refuses_a_width_it_never_measured():
    with pytest.raises(ValueError, match="width 3"):
        RoundCostTable((1,), (2,), [[1.0]])(1, 3)


# --------------------------------------------------------------------------- calibration


def test_calibration_is_the_ratio_of_measured_to_predicted_per_depth():
    calibration = DepthCalibration(3, decay=1.0, bounds=(0.1, 3.0))
    calibration.update([4.0, 1.0, 0.0], [8.0, 4.0, 0.0])
    np.testing.assert_allclose(calibration.scale, [0.5, 0.25, 1.0])  # depth 3 predicted nothing
    assert calibration.calibrated([[2.0, 2.0, 1.0]]) == pytest.approx([2.0 * 0.5 + 2.0 * 0.25 + 1.0])


def test_calibration_is_bounded_and_running():
    calibration = DepthCalibration(2, decay=0.5, bounds=(0.5, 1.5), prior_weight=1.0)
    calibration.update([0.0, 30.0], [1.0, 10.0])
    np.testing.assert_allclose(calibration.scale, [0.5, 1.5])  # 0.5 / 1 and 15.5 / 5.5, clamped
    for _ in range(60):
        calibration.update([0.8, 2.0], [1.0, 2.0])
    np.testing.assert_allclose(calibration.scale, [0.8, 1.0], rtol=1e-6)


@pytest.mark.parametrize("kw", [{"decay": 0.0}, {"bounds": (1.2, 2.0)}, {"prior_weight": 0.0}])
def test_calibration_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        DepthCalibration(3, **kw)


def test_reach_counts():
    counts = reach_counts(torch.tensor([0, 3, 1, 2, 3]), 4)
    assert counts.tolist() == [4, 3, 2, 0]


def test_calibration_learns_a_target_that_disagrees_with_the_drafter():
    """The target samples from its own distribution; the calibrated prediction converges to
    the true expected accept length (analytic, from the target's probabilities)."""
    depth, vocab, budget, bs, steps = 3, 5, 8, 64, 300
    generator = torch.Generator().manual_seed(11)
    draft_logits = torch.randn((depth, vocab), generator=generator, dtype=torch.float64)
    target_logits = draft_logits + 0.8 * torch.randn((depth, vocab), generator=generator, dtype=torch.float64)
    top = topk_log_probs(draft_logits, budget)
    layout = build_tree_batch_ref(top.log_probs[None], top.token_ids[None], np.array([0]), budget, budget + 1)
    true_reach = analytic_reach(layout, torch.log_softmax(target_logits, -1), depth)
    draft_reach = reach_by_depth(top.log_probs[None], budget)[0, budget]
    assert not np.allclose(true_reach, draft_reach.numpy(), rtol=0.1)  # the drafter is off

    budget_state = OnlineBudget((budget + 1,), RoundCostTable((bs,), (budget + 1,), [[1.0]]), depth)
    budget_state.calibration = DepthCalibration(depth, decay=0.02, bounds=(0.05, 5.0))
    reach = reach_by_depth(np.repeat(top.log_probs[None], bs, 0), budget)
    probs = torch.softmax(torch.cat([target_logits, torch.zeros((1, vocab))]), dim=-1)
    for _ in range(steps):
        assert budget_state.choose(reach) == budget + 1
        budget_state.record(walk_target(layout, probs, bs, depth, generator).accept_lens)
    calibrated = budget_state.calibration.calibrated(draft_reach.numpy())
    assert calibrated == pytest.approx(true_reach.sum(), rel=0.06)
    np.testing.assert_allclose(budget_state.calibration.scale * draft_reach.numpy(), true_reach, atol=0.05)


def analytic_reach(layout, target_log_probs, depth):
    """Per depth, the probability that the target's walk reaches it (sum over that depth's
    nodes of the target's probabilities along the path)."""
    reach = np.zeros(depth)
    path_log_prob = {0: 0.0}
    for slot in range(1, int(layout.tree_sizes[0])):
        parent, d = int(layout.parents[0, slot]), int(layout.depths[0, slot])
        path_log_prob[slot] = path_log_prob[parent] + float(target_log_probs[d - 1, layout.tokens[0, slot]])
        reach[d - 1] += math.exp(path_log_prob[slot])
    return reach


def walk_target(layout, probs, bs, depth, generator):
    samples = torch.multinomial(probs, bs, replacement=True, generator=generator)  # [depth + 1, bs]
    posterior = samples[torch.from_numpy(layout.depths[0])].T
    return accept_walk(
        torch.from_numpy(layout.tokens).expand(bs, -1),
        torch.from_numpy(layout.parents).expand(bs, -1),
        torch.from_numpy(layout.tree_sizes).expand(bs),
        posterior,
        depth,
    )


def test_choice_follows_the_calibration():
    """A drafter more confident than the target: the tree wins on the drafter's prediction;
    once half the requests accept the whole chain and half accept nothing (1.5 accepted per
    request instead of the predicted 1.95), plain decoding wins, exactly as the rates say."""
    top1, c0, c1, bs = 0.8, 10.0, 0.5, 24
    cost = RoundCostTable.from_function(BATCH_SIZES, (1, 4), linear_cost(c0, c1))
    predicted_gain, measured_gain = chain_expected(top1, 4), 1.5
    assert bs * (1 + predicted_gain) / cost(bs, 4) > bs / cost(bs, 1)
    assert bs * (1 + measured_gain) / cost(bs, 4) < bs / cost(bs, 1)
    budget = OnlineBudget((1, 4), cost, 3, DepthCalibration(3, decay=1.0), switch_margin=0.0)
    reach = reach_by_depth(chain_log_probs(bs, 3, top1), 3)
    assert expected_accepted(reach)[:, 3].sum().item() == pytest.approx(bs * predicted_gain)
    assert budget.choose(reach) == 4
    budget.record(torch.tensor([3] * (bs // 2) + [0] * (bs - bs // 2)))
    np.testing.assert_allclose(budget.calibration.scale * reach[:, 3].sum(0).numpy(), [bs / 2] * 3)
    assert budget.calibration.calibrated(reach[:, 3].sum(0).numpy()) == pytest.approx(bs * measured_gain)
    assert budget.choose(reach) == 1
    assert budget.history == {4: 1, 1: 1}


def test_record_needs_a_choice_first():
    budget = OnlineBudget((1, 2), RoundCostTable((1,), (1, 2), [[1.0, 1.0]]), 2)
    with pytest.raises(RuntimeError):
        budget.record(torch.tensor([1]))
