"""``pair_eval``'s bookkeeping without servers: the acceptance counters read back from the
worker's ``DDTREE stats`` log lines, the per-phase metrics, and the report's rows and table."""

from __future__ import annotations

import pytest

from lab.bench import pair_eval_report as report
from lab.bench import pair_eval_serving as serving


def _stats_line(rounds: int, accepted_per_round: float, non_argmax: float, nodes: float) -> str:
    d = {
        "request_rounds": rounds,
        "accepted_drafts_per_round": accepted_per_round,
        "non_argmax_share": non_argmax,
        "mean_tree_nodes": nodes,
    }
    return f"[2025-01-01 00:00:00 TP0] DDTREE stats: {d}"


def test_phase_metrics_from_two_stats_lines(tmp_path):
    log = tmp_path / "tree.log"
    log.write_text("starting\n")
    before = serving.stats_totals(log)
    assert before == {"request_rounds": 0, "accepted": 0, "non_argmax": 0, "nodes": 0}
    # cumulative counters: the last line counts; 40 rounds, 60 accepted drafts, 15 off the argmax chain
    log.write_text(f"{_stats_line(10, 1.0, 0.1, 9.0)}\nnoise\n{_stats_line(40, 1.5, 0.25, 12.0)}\n")
    after = serving.stats_totals(log)
    assert after == {"request_rounds": 40, "accepted": 60, "non_argmax": 15, "nodes": 480}
    m = serving.phase_metrics(before, after, [[1] * 50, [2] * 50], prompts=2)
    assert m["output_tokens"] == 100 and m["decode_rounds"] == 40
    assert m["tokens_per_round"] == pytest.approx((60 + 40) / 40)
    assert m["non_argmax_share"] == pytest.approx(0.25)
    assert m["mean_tree_nodes"] == pytest.approx(12.0)
    assert m["target_forwards_per_token"] == pytest.approx((40 + 2) / 100)


def test_arms_and_their_servers():
    arms = serving.arms_for(8, [7, 32])
    assert [(a.name, a.budget, a.max_topk) for a in arms] == [
        ("plain", None, None),
        ("chain", 7, 1),
        ("tree-b7", 7, None),
        ("tree-b32", 32, None),
    ]
    pair = {"target": "/t", "drafter": "/d"}
    plain, chain, tree = (serving.server_args(pair, a) for a in arms[:3])
    assert "--speculative-algorithm" not in plain
    assert chain[chain.index("--speculative-ddtree-budget") + 1] == "7"
    assert tree[tree.index("--speculative-draft-model-path") + 1] == "/d"
    assert serving.server_env(arms[1])["SGLANG_DDTREE_MAX_TOPK"] == "1"
    assert "SGLANG_DDTREE_MAX_TOPK" not in serving.server_env(arms[2])


def _result(arm: serving.Arm, outputs, tokens_per_round: float) -> dict:
    greedy = {"seconds": 1.0, "outputs": outputs, "tokens_per_round": tokens_per_round}
    greedy["target_forwards_per_token"] = 1 / tokens_per_round
    phases = {"greedy": greedy}
    if arm.speculative:
        greedy["non_argmax_share"] = 0.1
        phases["sample"] = {"tokens_per_round": tokens_per_round - 0.5, "target_forwards_per_token": 0.6}
    return {"arm": arm.name, "budget": arm.budget, "max_topk": arm.max_topk, "phases": phases}


def test_report_rows_flag_an_arm_that_differs_from_plain():
    plain, chain, tree = serving.arms_for(8, [16])
    same, other = [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]
    results = [_result(plain, same, 1.0), _result(chain, same, 2.0), _result(tree, other, 3.0)]
    rows = report.summarize(results, {"chain": 2.1, "tree-b16": 3.2})
    assert [r["greedy_identical_to_plain"] for r in rows] == [True, True, False]
    assert rows[2]["greedy_offline_prediction"] == 3.2 and rows[0]["greedy_offline_prediction"] is None
    data = {"pair": "p", "rows": rows, "stamp": {}, "config": {"prompts": 2, "max_new_tokens": 8, "block": 8}}
    md = report.markdown(data)
    assert "| chain | 7 (top-1) | 2.00 | 1.00x | 2.10 |" in md
    assert "| tree-b16 | 16 | 3.00 | 1.50x | 3.20 | 10.0% | 0.333 | **NO** | 2.50 | 1.67x |" in md


def test_plot_of_a_greedy_only_run(tmp_path):
    """``--no-sampling`` leaves the T=1 columns empty: the plot draws the T=0 lines only."""
    pytest.importorskip("matplotlib")
    arms = serving.arms_for(8, [16, 32])
    results = [_result(a, [[1, 2]], 1.0 + i) for i, a in enumerate(arms)]
    for r in results:
        r["phases"].pop("sample", None)
    rows = report.summarize(results, {})
    assert all(r["sample_tokens_per_round"] is None for r in rows)
    data = {"pair": "p", "rows": rows, "stamp": {}, "config": {"block": 8}}
    png = report.plot(tmp_path / "greedy.png", data)
    assert png is not None and png.stat().st_size > 0
