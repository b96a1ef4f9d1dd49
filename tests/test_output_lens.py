"""Output lengths of the modelled server's requests (``online_budget_sim``): seeded, spread around
the mean, bounded."""

import statistics

import pytest

from lab.bench.output_lens import output_lens


def test_the_same_arguments_draw_the_same_lengths():
    assert output_lens(16, 64, 0.5, seed=8) == output_lens(16, 64, 0.5, seed=8)
    assert output_lens(16, 64, 0.5, seed=8) != output_lens(16, 64, 0.5, seed=9)


def test_lengths_spread_around_the_mean_within_the_bounds():
    lens = output_lens(4000, 64, 0.5, seed=1)
    assert min(lens) >= 32 and max(lens) <= 96
    assert statistics.mean(lens) == pytest.approx(64, rel=0.02)
    assert len(set(lens)) > 50  # requests drift apart: no lockstep


def test_no_spread_is_one_length_and_a_bad_spread_is_refused():
    assert output_lens(5, 64, 0.0, seed=3) == [64] * 5
    with pytest.raises(ValueError):
        output_lens(5, 64, 1.0, seed=3)
