"""The paired judgement of a benchmark's ratio (``sglang_ddtree/ab/paired.py``): a goal is met or missed
only where the repeats' paired ratios resolve it."""

import pytest

from sglang_ddtree.ab.paired import UNRESOLVED, judge, median_interval, paired_ratios

# the trained pair at 6125f69, c=1: each repeat's pass of `auto64` and of DDTREE@64 (tok/s)
AUTO64_C1 = [549.8, 612.8, 682.6, 642.3, 562.0]
DDTREE64_C1 = [846.4, 705.9, 842.9, 654.8, 697.6]


def test_a_slow_spell_shared_by_both_passes_of_a_repeat_does_not_blur_the_ratio():
    spells = [0.5, 2.0, 1.0, 0.7, 1.6]  # the host's pace in each repeat, shared by both arms
    fast = [1100 * s for s in spells]
    slow = [1000 * s for s in spells]
    assert paired_ratios(fast, slow) == pytest.approx([1.1] * 5)
    text, met = judge(fast, slow, ratio=1.1, goal=0.95)
    assert met is True and text == "1.100 [1.100, 1.100]"
    # unpaired, the same passes would not resolve 0.95 (the arms' passes overlap 2x)
    shuffled = slow[1:] + slow[:1]
    assert judge(fast, shuffled, ratio=1.1, goal=0.95)[1] == UNRESOLVED


def test_the_goal_is_missed_only_where_every_likely_median_misses_it():
    text, met = judge([800, 810, 790, 805], [1000, 1000, 1000, 1000], ratio=0.80, goal=0.95)
    assert met is False and text.startswith("0.800 [")
    low, high = median_interval(paired_ratios([800, 810, 790, 805], [1000] * 4))
    assert 0.79 <= low <= high <= 0.81


def test_the_pairs_measured_at_6125f69_c1_do_not_resolve_5_percent():
    ratios = paired_ratios(AUTO64_C1, DDTREE64_C1)
    low, high = median_interval(ratios)
    assert low < 0.95 * 0.9 and high >= 0.95  # 0.65-0.98: the run cannot say
    assert judge(AUTO64_C1, DDTREE64_C1, ratio=612.8 / 705.9, goal=0.95)[1] == UNRESOLVED


def test_without_enough_repeats_the_point_ratio_decides():
    assert judge([900.0], [1000.0], ratio=0.9, goal=0.95) == ("0.900", False)
    assert judge(None, [1000.0] * 5, ratio=0.96, goal=0.95) == ("0.960", True)
