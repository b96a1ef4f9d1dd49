"""Two servers that built the same trees (an A/A) in the K2.6 A/B report: which arms pair up,
the spread they measure, and the verdicts that a margin inside it leaves unsettled."""

from __future__ import annotations

import pytest

from lab.bench.k26_ab_report import to_markdown, verdicts
from lab.bench.k26_ab_same_trees import aa_spread, same_tree_pairs


def _cell(c, tok_per_s, accept, length=4096, ttft=100.0, itl=2.0):
    return {
        "prompt_len": length,
        "profile": "p",
        "concurrency": c,
        "tok_per_s": tok_per_s,
        "accept_length": accept,
        "round_ms": 20.0,
        "tpot_ms": 1e3 / tok_per_s,
        "ttft_ms": ttft,
        "itl_ms": itl,
    }


def _cells(arms: dict) -> dict:
    """``{arm: [cell, ...]}`` -> the report's ``{(len, profile, c): {arm: cell}}``."""
    table: dict = {}
    for arm, cells in arms.items():
        for cell in cells:
            table.setdefault((cell["prompt_len"], cell["profile"], cell["concurrency"]), {})[arm] = cell
    return table


def test_arms_pair_up_only_on_one_width_and_equal_accept_in_every_shared_cell():
    cells = _cells(
        {
            "plain": [_cell(1, 100.0, 1.0), _cell(8, 300.0, 1.0)],
            "chain": [_cell(1, 200.0, 4.98), _cell(8, 500.0, 5.12)],
            "ddtree@7": [_cell(1, 250.0, 4.98), _cell(8, 450.0, 5.12)],
            "ddtree@8": [_cell(1, 240.0, 4.98), _cell(8, 480.0, 5.12)],  # width 9: another tree
            "ddtree@16": [_cell(1, 230.0, 5.24), _cell(8, 420.0, 5.12)],  # differs at c=1
            "ddtree@auto7": [_cell(1, 260.0, 4.98), _cell(8, 470.0, 5.12)],  # widths change per step
            "ddtree@7+sglang-verify": [_cell(1, 90.0, 4.98), _cell(8, 300.0, 5.12)],  # a variant
        }
    )
    assert same_tree_pairs(cells) == [("chain", "ddtree@7")]
    # the faster over the slower, either way round, over every cell
    assert aa_spread(cells) == pytest.approx(max(250.0 / 200.0, 500.0 / 450.0))


def test_one_differing_cell_breaks_the_pair_and_no_pair_means_no_spread():
    cells = _cells(
        {
            "chain": [_cell(1, 200.0, 4.98), _cell(8, 500.0, 5.12)],
            "ddtree@7": [_cell(1, 250.0, 4.98), _cell(8, 450.0, 5.2)],
        }
    )
    assert same_tree_pairs(cells) == []
    assert aa_spread(cells) == 1.0


def _results(chain_c1: float, ddtree_c1: float, ddtree8_c1: float) -> dict:
    return {
        "args": {"profiles": ["p"]},
        "arms": [
            {"arm": "plain", "cells": [{**_cell(1, 100.0, 1.0), "profile": None}]},
            {"arm": "chain", "cells": [_cell(1, chain_c1, 4.98, ttft=113.0)]},
            {"arm": "ddtree@7", "cells": [_cell(1, ddtree_c1, 4.98, ttft=180.0)]},
            {"arm": "ddtree@8", "cells": [_cell(1, ddtree8_c1, 5.3)]},
        ],
    }


def test_a_margin_inside_the_calls_aa_spread_is_said_to_be_unsettled():
    # chain and DDTREE@7 built the same trees and differ by 1.25x: DDTREE@8's 1.20x over the
    # chain is inside it, its 1.30x is not
    inside = verdicts(_results(200.0, 160.0, 240.0))[0]
    assert "ddtree@8 wins (1.20x the next arm, within this call's A/A spread 1.25x)" in inside
    outside = verdicts(_results(200.0, 160.0, 260.0))[0]
    assert "ddtree@8 wins (1.30x the next arm)" in outside


def test_a_loss_inside_the_calls_aa_spread_is_said_to_be_one():
    # the A/A (chain / DDTREE@7) spread is 1.25x: DDTREE@8, the best tree, at 0.85x the chain
    inside = verdicts(_results(200.0, 160.0, 170.0))[0]
    assert (
        "ddtree@8 0.85x chain (decode 1.00x by ITL) (DDTREE LOSES, inside this call's A/A spread)" in inside
    )
    # the chain and its repeat differ by 1.05x: DDTREE@8 at 0.80x the chain is a loss outside it
    outside = {
        "args": {"profiles": ["p"]},
        "arms": [
            {"arm": "chain", "cells": [_cell(1, 200.0, 4.98)]},
            {"arm": "chain+again", "cells": [_cell(1, 210.0, 4.98)]},
            {"arm": "ddtree@8", "cells": [_cell(1, 160.0, 5.3)]},
        ],
    }
    assert "ddtree@8 0.80x chain (decode 1.00x by ITL) (DDTREE LOSES);" in verdicts(outside)[0] + ";"


def test_the_report_shows_the_pair_with_its_prefill_times():
    markdown = to_markdown({**_results(200.0, 160.0, 240.0), "stamp": {}})
    section = markdown[markdown.index("## Two servers, the same trees") :]
    row = next(line for line in section.splitlines() if line.startswith("| chain / ddtree@7"))
    assert row.split("|")[1:-1] == [
        " chain / ddtree@7 ",
        " 4096 ",
        " p ",
        " 1 ",
        " 4.98 ",
        " 1.25 ",
        " 1 ",
        " 113.0 ",
        " 180.0 ",
    ]
    assert "## Two servers" not in to_markdown(
        {**_results(200.0, 160.0, 240.0), "arms": _results(200.0, 160.0, 240.0)["arms"][:2], "stamp": {}}
    )


def test_host_load_counts_the_processes_that_name_the_marker():
    import subprocess
    import sys
    import time
    import uuid

    from lab.bench._stamp import host_load

    marker = f"host-load-test-{uuid.uuid4().hex}"
    key = f"{marker}_processes"
    assert host_load(marker)[key] == 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # until the child has exec'd, /proc shows it under this process's command line
        deadline = time.monotonic() + 30.0
        while (seen := host_load(marker))[key] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen[key] == 1 and seen["load_1m"] >= 0.0
    finally:
        child.kill()
        child.wait()
    assert host_load(marker)[key] == 0


def test_an_arm_named_again_is_the_same_arm_in_a_server_of_its_own():
    from lab.bench.k26_ab import arm_args, base_arm

    assert base_arm("chain+again") == ("chain", {})
    assert base_arm("ddtree@7+again") == ("ddtree@7", {})
    assert arm_args(base_arm("chain+again")[0], "D", 32) == arm_args("chain", "D", 32)
    with pytest.raises(ValueError, match="only a speculative arm repeats"):
        base_arm("plain+again")
    cells = _cells(
        {
            "chain": [_cell(1, 200.0, 4.98)],
            "ddtree@8": [_cell(1, 240.0, 5.3)],
            "ddtree@8+again": [_cell(1, 220.0, 5.3)],
            "ddtree@8+sglang-verify": [_cell(1, 90.0, 5.3)],  # another kernel: not a repeat
            # the online budget's trees change per step, yet its repeat has the same flags
            "ddtree@auto7": [_cell(1, 250.0, 4.6)],
            "ddtree@auto7+again": [_cell(1, 200.0, 4.5)],
        }
    )
    assert same_tree_pairs(cells) == [("ddtree@8", "ddtree@8+again"), ("ddtree@auto7", "ddtree@auto7+again")]
    assert aa_spread(cells) == pytest.approx(250.0 / 200.0)


@pytest.mark.parametrize(
    "arms, error",
    [("plain,chain,chain", "lists an arm twice"), ("plain,plain+again", "only a speculative arm repeats")],
)
def test_the_call_refuses_its_arms_before_starting_a_server(tmp_path, arms, error, monkeypatch):
    from lab.bench import k26_ab

    monkeypatch.setattr(k26_ab, "start", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(ValueError, match=error):
        k26_ab.main(["--model", "M", "--drafter", "D", "--arms", arms, "--out", str(tmp_path)])
