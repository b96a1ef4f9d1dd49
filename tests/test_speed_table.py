"""The README's speed table is what ``lab.speed_table`` writes from the committed series."""

import pytest

from lab import speed_table


def test_readme_table_is_generated_from_the_committed_series():
    readme = (speed_table.ROOT / "README.md").read_text()
    expected = speed_table.table(speed_table.ROOT / "results")
    assert expected in readme, (
        "README.md's speed table differs from its series: run python -m lab.speed_table"
    )
    assert len(speed_table.ROWS) <= 8


def _comparison(**over):
    row = dict(arm="ddtree@32", reference="plain", concurrency=1, ratio=1.391, interval=[1.28, 1.61])
    row.update(aa_band=[0.79, 1.26], pairs=4, verdict="wins")
    return {**row, **over}


def test_a_level_states_ratio_interval_aa_and_verdict():
    assert speed_table.level_text(_comparison()) == "c=1: 1.39x [1.28, 1.61], A/A [0.79, 1.26], **wins**"
    two = speed_table.level_text(_comparison(pairs=2, verdict="unresolved"))
    assert two == "c=1: 1.39x (2 pairs, no interval), A/A [0.79, 1.26], unresolved"


def test_an_alternating_level_states_the_start_spread_of_its_arms():
    level = _comparison(aa_band=None, verdict="unresolved", start_spread={"ddtree@32": None, "plain": 1.24})
    assert speed_table.level_text(level) == "c=1: 1.39x [1.28, 1.61], A/A -, start spread 1.24x, unresolved"


def test_a_row_without_its_comparison_is_refused():
    row = speed_table.Row("s", "ddtree@64", "plain", "what")
    with pytest.raises(ValueError, match="no comparison of ddtree@64 with plain"):
        speed_table.row_text(row, {"comparisons": [_comparison()]})


def test_edits_outside_the_markers_are_kept():
    readme = f"intro\n{speed_table.START}\nold\n{speed_table.END}\noutro\n"
    assert speed_table.replaced(readme, "NEW") == "intro\nNEW\noutro\n"


def test_a_row_from_a_series_whose_greedy_check_failed_says_so():
    row = speed_table.Row("s", "ddtree@32", "plain", "what")
    report = {"comparisons": [_comparison()], "greedy_check": {"ok": False}}
    assert speed_table.row_text(row, report).endswith("(its greedy check failed: see the series) |")
    assert "greedy" not in speed_table.row_text(row, {**report, "greedy_check": {"ok": True}})
