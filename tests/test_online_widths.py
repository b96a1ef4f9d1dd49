"""The online budget's per-step width as the eager round drives it (``adapter/widths.py``),
without a server: the candidate widths, the probed cost table, and the step loop's use of
the previous step's prediction, its calibration and its costs (CPU, torch)."""

import math

import numpy as np
import pytest
import torch

from sglang_ddtree.adapter.widths import StepWidths
from sglang_ddtree.budget import ProbedCostTable, RoundCostTable, candidate_widths

DEPTH = 4


def test_candidate_widths_are_plain_powers_of_two_and_the_largest():
    assert candidate_widths(1) == (1, 2)
    assert candidate_widths(7) == (1, 2, 3, 5, 8)
    assert candidate_widths(16) == (1, 2, 3, 5, 9, 17)
    assert candidate_widths(32) == (1, 2, 3, 5, 9, 17, 33)
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
    width = widths.start(bs)
    widths.watch(confident_drafter(top1))(torch.zeros(bs * DEPTH, 8), 4)
    widths.finish(torch.full((bs,), min(accept_len, width - 1), dtype=torch.int64))
    return width


def step_widths(cost) -> StepWidths:
    return StepWidths((1, 2, 3, 5), cost, DEPTH, make_head=lambda width: width)


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
    widths = step_widths(flat)
    for _ in range(200):  # the drafter predicts 0.9 per depth; the target accepts one draft only
        run_step(widths, bs=2, accept_len=1)
    widths.start(2)  # absorbs the last step
    scale = widths.calibration.scale
    assert scale[0] == pytest.approx(1 / 0.9, rel=0.05)
    assert scale[1:] == pytest.approx([0.2] * (DEPTH - 1))  # clamped: deeper depths never reached


def test_measured_costs_probe_every_width_twice_before_choosing():
    widths = step_widths(ProbedCostTable((1, 2, 4), (1, 2, 3, 5), probes=2))
    probes = [run_step(widths, bs=1, accept_len=4) for _ in range(8)]
    assert probes == [1, 1, 2, 2, 3, 3, 5, 5]
    assert run_step(widths, bs=1, accept_len=4) in (1, 2, 3, 5)
    assert run_step(widths, bs=3, accept_len=4) == 1  # a new batch-size row is probed again
    assert widths.cost.counts[0].tolist() == [2, 2, 2, 2]
    assert np.all(widths.cost.ms[0] > 0)
