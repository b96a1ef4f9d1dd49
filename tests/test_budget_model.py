"""Budget model: acceptance curves, cost interpolation and the budget choice (CPU only)."""

import json
import math

import pytest

from lab.budget_model import (
    CostCurve,
    acceptance_from_node_probs,
    allreduce_ms,
    attention_cost_from_mla_json,
    best_budget,
    layer_cost_from_moe_json,
    main,
    recommend,
    synthetic_node_probs,
)

# The TP-8 shard curve of docs/anchors.md (H200, eager), ms per MoE layer.
SHARD = {
    1: 0.229,
    4: 0.219,
    8: 0.210,
    16: 0.237,
    32: 0.315,
    64: 0.405,
    128: 0.487,
    256: 0.555,
    512: 0.639,
    1024: 0.940,
}


# --------------------------------------------------------------------------- acceptance


def test_acceptance_is_one_plus_sum_of_largest_probabilities():
    tau = acceptance_from_node_probs([0.2, 0.9, 0.5, 0.7])
    assert tau == pytest.approx([1.0, 1.9, 2.6, 3.1, 3.3])


def test_acceptance_is_nondecreasing_and_concave():
    tau = acceptance_from_node_probs(synthetic_node_probs())
    gains = [b - a for a, b in zip(tau, tau[1:])]
    assert all(g >= 0 for g in gains)
    assert all(g1 >= g2 - 1e-15 for g1, g2 in zip(gains, gains[1:]))


@pytest.mark.parametrize("bad", [[0.5, 1.2], [-0.1], [float("nan")]])
def test_acceptance_rejects_non_probabilities(bad):
    with pytest.raises(ValueError):
        acceptance_from_node_probs(bad)


def test_synthetic_drafter_is_calibrated_to_dflash_accept_length():
    # Default: a 7-token chain accepts 5.3 tokens per step (bonus token included).
    probs = synthetic_node_probs()
    chain = acceptance_from_node_probs(probs[:7])[-1]
    assert chain == pytest.approx(5.3, abs=0.01)
    assert max(probs) == pytest.approx(0.878)
    # Path probabilities shrink with depth: the b best nodes form a tree.
    assert len(probs) == 512 and probs == sorted(probs, reverse=True)


# --------------------------------------------------------------------------- cost curve


def test_cost_curve_hits_points_and_interpolates_in_log_m():
    c = CostCurve.from_points({1: 1.0, 4: 3.0, 16: 4.0})
    assert c(1) == 1.0 and c(4) == 3.0 and c(16) == 4.0
    assert c(2) == pytest.approx(2.0)  # halfway in log2 between 1 and 4
    assert c(8) == pytest.approx(3.5)
    assert c(0.5) == 1.0  # flat below the first point


def test_cost_curve_extrapolates_linearly_in_m():
    c = CostCurve.from_points({256: 3.0, 512: 3.5, 1024: 6.0})
    assert c(2048) == pytest.approx(6.0 + 2.5 / 512 * 1024)


@pytest.mark.parametrize(
    "points", [{1: 1.0}, [(2, 1.0), (2, 2.0)], {1: 1.0, 2: 0.0}, {1: 1.0, 2: float("inf")}, {0: 1.0, 2: 2.0}]
)
def test_cost_curve_rejects_bad_points(points):
    with pytest.raises(ValueError):
        CostCurve.from_points(points)


def test_cost_curve_sum_and_scale():
    a = CostCurve.from_points({1: 1.0, 4: 2.0})
    b = CostCurve.from_points({2: 1.0, 4: 1.0})
    s = CostCurve.sum([(a, 2.0), (b, 1.0)])
    assert s.ms == (1, 2, 4)
    assert s(4) == pytest.approx(5.0)
    assert a.scaled(3, add_ms=1)(4) == pytest.approx(7.0)


# --------------------------------------------------------------------------- the choice


def test_flat_cost_takes_the_largest_budget():
    tau = acceptance_from_node_probs([0.5] * 10)
    choice = best_budget(lambda m: 1.0, tau, streams=4)
    assert choice.budget == 10 and choice.tokens_per_forward == 44


def test_cost_proportional_to_m_takes_no_tree():
    # tau(b) < b + 1 for any probability below one, so per-token cost can only grow.
    tau = acceptance_from_node_probs([0.9] * 10)
    assert best_budget(lambda m: 0.01 * m, tau, streams=1).budget == 0


@pytest.mark.parametrize("a, c, q, expect_max", [(1.0, 0.01, 0.5, True), (0.01, 1.0, 0.5, False)])
def test_linear_acceptance_affine_cost_matches_calculus(a, c, q, expect_max):
    # thr(b) = s (1 + b q) / (a + c s (b + 1)) rises in b iff q a > c s (1 - q).
    s, bmax = 2, 20
    tau = [1 + b * q for b in range(bmax + 1)]
    choice = best_budget(lambda m: a + c * m, tau, streams=s)
    assert (q * a > c * s * (1 - q)) == expect_max
    assert choice.budget == (bmax if expect_max else 0)


def test_choice_matches_brute_force_and_reports_consistent_numbers():
    cost = CostCurve.from_points(SHARD).scaled(61)
    tau = acceptance_from_node_probs(synthetic_node_probs(top1=0.75))[:129]
    for streams in (1, 3, 16):
        ch = best_budget(cost, tau, streams, step_overhead_ms=2.0)
        brute = max(range(129), key=lambda b: (streams * tau[b] / (cost(streams * (b + 1)) + 2.0), -b))
        assert ch.budget == brute
        assert ch.step_ms == pytest.approx(cost(streams * (ch.budget + 1)) + 2.0)
        assert ch.tokens_per_ms == pytest.approx(streams * ch.tau / ch.step_ms)
        assert ch.per_stream_tokens_per_s == pytest.approx(1e3 * ch.tau / ch.step_ms)
        assert len(ch.table) == 129


def test_more_streams_never_want_a_bigger_tree_under_affine_cost():
    # With cost a + c M the choice maximises tau(b) / (a / s + c (b + 1)); a larger fixed share
    # a / s favours larger b for any tau, so the best budget cannot grow with the stream count.
    def cost(m):
        return 5.0 + 0.02 * m

    for top1 in (0.6, 0.75, 0.878):
        tau = acceptance_from_node_probs(synthetic_node_probs(top1=top1))[:257]
        budgets = [c.budget for c in recommend(cost, tau, (1, 2, 4, 8, 16, 32, 64))]
        assert budgets == sorted(budgets, reverse=True), (top1, budgets)
        assert budgets[0] > budgets[-1]


def test_plateau_shaped_cost_can_favour_wider_trees_with_more_streams():
    # The measured MoE curve is concave (a latency floor, then a weight-streaming plateau):
    # there, more streams can push the best M onto the plateau where extra nodes are cheap.
    cost = CostCurve.from_points(SHARD).scaled(61)
    tau = acceptance_from_node_probs(synthetic_node_probs(top1=0.6))[:257]
    one, many = best_budget(cost, tau, 1), best_budget(cost, tau, 8)
    assert many.tokens_per_forward > one.tokens_per_forward
    assert many.tokens_per_ms > one.tokens_per_ms


def test_extra_cost_and_overhead_shift_the_choice():
    tau = acceptance_from_node_probs([0.6] * 32)
    cost = CostCurve.from_points({1: 1.0, 64: 1.0, 128: 8.0})
    base = best_budget(cost, tau, streams=2)
    pricey_tree = best_budget(cost, tau, streams=2, extra_cost=lambda s, b: 2.0 * b)
    assert pricey_tree.budget < base.budget
    # A big fixed step cost makes extra verified tokens relatively cheaper.
    steep = CostCurve.from_points({1: 1.0, 2: 2.0, 64: 64.0})
    assert best_budget(steep, tau, 1, step_overhead_ms=100.0).budget > best_budget(steep, tau, 1).budget


def test_budget_argument_validation():
    tau = [1.0, 1.5]
    with pytest.raises(ValueError):
        best_budget(lambda m: 1.0, tau, streams=0)
    with pytest.raises(ValueError):
        best_budget(lambda m: 1.0, tau, streams=1, budgets=[0, 5])
    with pytest.raises(ValueError):
        best_budget(lambda m: 1.0, lambda b: 1.0, streams=1)
    assert best_budget(lambda m: 1.0, lambda b: 1.0 + b, streams=1, budgets=[3, 1]).budget == 3


# --------------------------------------------------------------------------- composition from bench JSON


def _fake_moe_json():
    ms = [1, 8, 64, 512, 1024]

    def rows(f):
        return {"rows": [{"M": m, "graph": f(m)} for m in ms]}

    return {
        "moe": {
            "ffn256": {
                "rows": [{"M": m, "router_graph": 0.01, "core_combine_graph": 0.1 + 1e-3 * m} for m in ms]
            }
        },
        "dense": {"shared_ffn256": rows(lambda m: 0.02), "dense_ffn2304": rows(lambda m: 0.05)},
    }


def test_allreduce_model():
    assert allreduce_ms(0, n_gpus=1) == 0.0
    assert allreduce_ms(0) == pytest.approx(0.015)
    # 2 (n-1)/n bytes over 370 GB/s: 14.68 MB (M=1024) on 8 GPUs
    assert allreduce_ms(1024 * 7168 * 2, latency_us=0) == pytest.approx(1.75 * 1024 * 7168 * 2 / 370e9 * 1e3)


def test_layer_cost_from_moe_json():
    c = layer_cost_from_moe_json(
        _fake_moe_json(), tp=8, moe_layers=60, dense_layers=1, allreduce=lambda b: 0.0
    )
    assert c(1) == pytest.approx(60 * (0.01 + 0.101 + 0.02) + 0.05)
    assert c(512) == pytest.approx(60 * (0.01 + 0.612 + 0.02) + 0.05)


def test_attention_cost_is_linear_between_measurements():
    rows = [
        {"heads": 8, "prefix": 4096, "bs": bs, "n_nodes": w, "split_ms": 0.01 * bs * w}
        for bs in (1, 4, 16)
        for w in (1, 17, 33)
    ] + [{"heads": 8, "prefix": 1024, "bs": 1, "n_nodes": 1, "split_ms": 99.0}]
    f = attention_cost_from_mla_json({"rows": rows}, heads=8, prefix=5000, layers=2)
    assert f.prefix_used == 4096
    assert f(4, 16) == pytest.approx(2 * 0.01 * 4 * 17)
    assert f(8, 24) == pytest.approx(2 * 0.01 * 8 * 25)
    with pytest.raises(ValueError):
        attention_cost_from_mla_json({"rows": rows}, heads=64, prefix=4096)


def test_cli_writes_report(tmp_path):
    src = tmp_path / "moe.json"
    src.write_text(json.dumps(_fake_moe_json()))
    out = tmp_path / "budget_report"
    assert (
        main(["--moe-json", str(src), "--out", str(out), "--concurrency", "1", "16", "--max-budget", "64"])
        == 0
    )
    data = json.loads(out.with_suffix(".json").read_text())
    assert [c["streams"] for c in data["choices"]] == [1, 16]
    assert all(0 <= c["budget"] <= 64 for c in data["choices"])
    assert "best budget" in out.with_suffix(".md").read_text()
    assert math.isclose(data["tau"][0], 1.0)
    pytest.importorskip("matplotlib")
    assert main(["--moe-json", str(src), "--out", str(out), "--png", "--max-budget", "16"]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
