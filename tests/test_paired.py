"""The paired judgement of a benchmark's ratio (``bench/paired.py``): a goal is met or missed
only where the repeats' paired ratios resolve it."""

import pytest

from lab.bench import gpu_rounds_report
from lab.bench.paired import UNRESOLVED, judge, median_interval, paired_ratios

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


def test_the_report_judges_the_online_budget_by_its_paired_passes():
    def level(tps, passes):
        return {"concurrency": 1, "tok_per_s": tps, "accept_length": 3.0, "round_ms": 1.0, "requests": 8,
                "tok_per_s_passes": passes}  # fmt: skip

    levels = {
        "plain": {1: level(480.0, [630.0, 453.0, 482.0, 448.0, 498.0])},
        "ddtree@64": {1: level(705.9, DDTREE64_C1)},
        "ddtree@auto64": {1: level(612.8, AUTO64_C1)},
    }
    rows = {r[0]: r for r in gpu_rounds_report.online_budget_targets(levels)}
    best = rows["ddtree@auto64 tok/s / best fixed (ddtree@64) tok/s, c=1"]
    assert best[1].startswith("0.868 [") and best[3] == UNRESOLVED
    # 1.27x plain by the medians, but one repeat's pair made 0.87x: five repeats do not resolve it
    over_plain = rows["ddtree@auto64 tok/s / plain tok/s, c=1"]
    assert over_plain[1].startswith("1.277 [0.873, ") and over_plain[3] == UNRESOLVED


def test_committed_runs_are_judged_again_by_their_paired_passes(tmp_path):
    import json

    from lab.bench import online_budget_judged

    def arm(name, passes):
        level = {"concurrency": 1, "tok_per_s": sorted(passes)[len(passes) // 2], "tok_per_s_passes": passes}
        return {"arm": name, "levels": [level]}

    run = {
        "stamp": {"commit": "6125f69abc"},
        "arms": [arm("ddtree@64", DDTREE64_C1), arm("ddtree@auto64", AUTO64_C1)],
    }
    without_auto = {"stamp": {"commit": "0000000"}, "arms": [arm("ddtree@64", DDTREE64_C1)]}
    (tmp_path / "a.json").write_text(json.dumps(run))
    (tmp_path / "b.json").write_text(json.dumps(without_auto))
    assert (
        online_budget_judged.main(
            [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path)]
        )
        == 0
    )
    report = (tmp_path / "online_budget_judged_cpu.md").read_text()
    assert "## `a.json` (6125f69): met 0, missed 0, unresolved 1" in report and "b.json" not in report
    assert "| ddtree@auto64 tok/s / best fixed (ddtree@64) tok/s, c=1 | 0.868 [0.650, 0.981] |" in report
