"""The online budget's policy on a modelled server (``bench/online_budget_sim.py``): the real
step loop on a clock of its own, deterministic, on the CPU."""

import json
from pathlib import Path

import pytest

from lab.bench import online_budget_sim
from lab.bench.draw_trace import read_json
from lab.bench.online_budget_sim import (
    MODELS,
    Server,
    TraceDraws,
    make_requests,
    rank_verify_ms,
    run_arm,
    serve_pass,
)
from sglang_ddtree.budget import candidate_widths

PAIR = MODELS["pair"]
RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_a_fixed_arm_runs_its_width_and_the_online_budget_serves_the_widest_where_it_wins():
    fixed = run_arm(PAIR, "64", concurrency=1, passes=2, seed=0)
    auto = run_arm(PAIR, "auto", concurrency=1, passes=2, seed=0)
    assert list(fixed["width_steps"]) == [65] and "probe_steps" not in fixed
    # alone, with ~4 ms of host work in every round, the widest tree gives the most tokens per ms
    steps = sum(auto["width_steps"].values())
    assert auto["width_steps"][65] > 0.95 * steps and auto["probe_steps"] < 0.05 * steps
    assert 0.95 < auto["tok_per_ms"] / fixed["tok_per_ms"] < 1.02
    again = run_arm(PAIR, "auto", concurrency=1, passes=2, seed=0)
    assert again.pop("start_us") and auto.pop("start_us")  # the host's clock: the one thing that differs
    assert again == auto  # the same run, the same steps


def test_under_load_the_online_budget_decides_anew_at_more_of_its_steps():
    """Alone a batch's size holds and its kept width serves most steps; at c=64 the size walks
    through the table's rows, whose unsettled cells move with every timed verify, so the probe
    check and the choice are made again at far more steps (what grows the served `width choice`)."""
    shares = {}
    for c in (1, 64):
        auto = run_arm(PAIR, "auto", concurrency=c, passes=2, seed=0)
        shares[c] = auto["decided_steps"] / sum(auto["width_steps"].values())
        assert auto["start_us"]["mean"] >= auto["start_us"]["median"] > 0
    assert shares[1] < 0.1 and shares[64] > 3 * shares[1]


def test_the_narrowest_fixed_width_loses_to_the_widest_on_a_host_bound_round():
    """The model's own arithmetic: every round pays ~4.3 ms of host work, so a tree of one node
    (at most 2 tokens a round) makes far fewer tokens per ms than one of 64 (~4 a round)."""
    narrow = run_arm(PAIR, "1", concurrency=8, passes=2, seed=1)
    wide = run_arm(PAIR, "64", concurrency=8, passes=2, seed=1)
    assert narrow["tok_per_ms"] < 0.6 * wide["tok_per_ms"]


def test_the_benchmark_writes_its_table(tmp_path):
    argv = ["--concurrency", "1", "8", "--passes", "2", "--fixed", "16", "64", "--out", str(tmp_path)]
    assert online_budget_sim.main(argv) == 0
    results = json.loads((tmp_path / "pycode-4l_cpu_online_budget_sim.json").read_text())
    assert [level["concurrency"] for level in results["levels"]] == [1, 8]
    for level in results["levels"]:
        assert set(level["arms"]) == {"auto", "16", "64"} and level["best_fixed"] in ("16", "64")
        assert level["auto_over_best"] > 0.9
    assert (
        "| conc | auto tok/ms | auto / DDTREE@16 | auto / DDTREE@64 | best other |"
        in (tmp_path / "pycode-4l_cpu_online_budget_sim.md").read_text()
    )


def test_the_rank_model_serves_the_rank_at_the_pace_the_h200_measured():
    """The K2.6 rank's model: a batch runs in the smallest captured graph that holds it, and
    alone, at DDTREE@7's width, it makes ~0.23 tokens a ms, as the rank made 230-240 tok/s at
    c=1 on the H200 (f9eaf01, 40a3f9d)."""
    assert rank_verify_ms(9, 8) == rank_verify_ms(10, 8) == 15.03 and rank_verify_ms(1, 1) == 6.777
    alone = run_arm(MODELS["k26-rank"], "7", concurrency=1, passes=6, seed=0)  # the benchmark's passes
    assert 0.23 * 0.95 < alone["tok_per_ms"] < 0.24 * 1.05


def test_noise_stalls_the_share_of_rounds_it_says_and_leaves_a_quiet_model_alone():
    import numpy as np

    from lab.bench.online_budget_sim import STALL_MS, Noise

    rng = np.random.default_rng(0)
    assert Noise().apply(4.3, rng) == 4.3
    assert Noise(stall_share=1.0).apply(4.3, rng) == 4.3 + STALL_MS
    jittered = [Noise(jitter=0.25).apply(4.3, rng) for _ in range(2000)]
    assert 4.1 < float(np.median(jittered)) < 4.5 and min(jittered) < 3.0 < 6.0 < max(jittered)
    quiet = run_arm(PAIR, "64", concurrency=1, passes=2, seed=0)
    noisy = run_arm(PAIR, "64", concurrency=1, passes=2, seed=0, noise=Noise(jitter=0.25, stall_share=0.02))
    assert noisy["width_steps"] == quiet["width_steps"] and noisy["tok_per_ms"] < quiet["tok_per_ms"]


def test_the_served_call_model_drafts_its_profile_in_short_requests():
    """``k26-rank-code``: every request drafts the replay profile's log-probs (the chain accepts
    5.4), outputs of 32-64 tokens, bs 1-64 from K2.6 call 7's start-up replays."""
    import torch

    from lab.bench.online_budget_sim import make_requests, profile_log_probs

    model = MODELS["k26-rank-code"]
    requests = make_requests(40, (1, 2, 4, 8), seed=3, model=model)
    assert all(32 <= r.length <= 64 for r in requests) and len({r.length for r in requests}) > 10
    assert all(torch.equal(r.log_probs, profile_log_probs("dflash-k25-code")) for r in requests)
    chain = requests[0].reach[7]  # P(accepted >= d) at width 8: the chain of 7 nodes
    assert abs(1 + float(chain.sum()) - 5.4) < 0.05
    assert model.verify_ms(64, 8) == 36.001 and model.verify_ms(33, 4) == 20.92


@pytest.fixture(scope="module")
def pair_draws():
    return TraceDraws(read_json(RESULTS / "pycode-4l_cpu_trace.json.gz"))


def test_the_pair_s_trace_replays_what_the_pair_served(pair_draws):
    """Each of the trace's 43 continuations alone, at each arm: the tokens per round are the
    ones the pair's CPU servers made with the real drafter (``pycode-4l_cpu_trace_selfcheck``:
    the served rounds, the prefill's first token counted as the A/B tool counts it)."""
    served = json.loads((RESULTS / "pycode-4l_cpu_trace_selfcheck.json").read_text())
    served = {row["arm"].removeprefix("ddtree@"): row["served_tokens_per_round"] for row in served["rows"]}
    assert set(served) == {"chain", "7", "16", "32", "64"}
    replayed = {}
    for arm in [*served, "plain"]:
        server = Server(PAIR, candidate_widths(64), arm, seed=0)
        requests = make_requests(len(pair_draws), None, 0, PAIR, pair_draws)
        assert sorted(r.row for r in requests) == list(range(len(pair_draws)))
        made = sum(serve_pass(server, [request], 1) for request in requests)
        replayed[arm] = (made + len(requests)) / sum(server.width_steps.values())
    assert replayed["plain"] == pytest.approx(1 + len(requests) / (made + 1e-9), abs=0.01)  # one a step
    for arm, tokens_per_round in served.items():
        assert replayed[arm] == pytest.approx(tokens_per_round, abs=1e-4), arm


def test_a_trace_offset_without_a_record_drafts_the_earlier_record_shifted():
    """As the served replay: root offset 2 has no record, so it drafts record 0's depths 2..,
    the depths past it not proposed; a rank past the top-k is a miss."""
    depth, k = 7, 64
    logp = [[[-0.01 * (d + 1) if r == 0 else -3.0 - r for r in range(k)] for d in range(depth)]]
    trace = {
        "format": "ddtree-trace/1",
        "depth": depth,
        "topk": k,
        "requests": [{"length": 9, "offsets": [0], "logp": logp, "rank": [[0, 0, 0, 1, 0, 70, 0]]}],
    }
    draws = TraceDraws(trace)
    assert draws.accepted(0, 0, 0) == 3  # the chain: three top-1 matches, then rank 1
    assert draws.accepted(0, 0, 65) == 5  # a tree of 64 holds rank 1 at depth 4; rank 70 is a miss
    shifted = draws.log_probs(0, 2)
    assert shifted[0, 0] == pytest.approx(-0.03) and shifted[4, 0] == pytest.approx(-0.07)
    assert float(shifted[5, 0]) < -60  # past the record: not proposed
    assert draws.accepted(0, 2, 0) == 1 and draws.accepted(0, 2, 65) == 3  # ranks 0, 1, 0, then the miss


def test_a_trace_of_top_2_drafts_its_two_ranks_then_the_floor():
    """A trace narrower than the simulator's top-k (a smaller file) is padded, as the served
    replay pads it: a tree never holds a rank the trace does not know, so it accepts what the
    recorded ranks allow."""
    logp = [[[-0.1, -1.0]] * 7]
    trace = {"format": "ddtree-trace/1", "depth": 7, "topk": 2}
    trace["requests"] = [{"length": 9, "offsets": [0], "logp": logp, "rank": [[1, 0, 0, 0, 0, 0, 0]]}]
    draws = TraceDraws(trace)
    assert float(draws.log_probs(0, 0)[0, 2]) < -60
    assert draws.accepted(0, 0, 0) == 0  # the chain: rank 1 at depth 1 misses
    assert draws.accepted(0, 0, 9) == 1  # 8 nodes: the chain of 7, then the sibling at depth 1
    # the 7 + 28 paths with at most one rank-1 step hold the sibling's whole chain; no rank past 1
    assert draws.accepted(0, 0, 36) == 7


@pytest.mark.parametrize(
    "trace_pair, name",
    [
        (None, "k26-rank-code_cpu_online_budget_sim_trace"),
        ("pycode-4l", "k26-rank-code_cpu_online_budget_sim_trace"),
        ("pycode-4l-drafter-d4", "k26-rank-code_cpu_online_budget_sim_trace-drafter-d4"),
    ],
)
def test_a_trace_of_another_drafter_names_its_own_series(trace_pair, name):
    from types import SimpleNamespace

    from lab.bench.online_budget_sim import series_name

    args = SimpleNamespace(model="k26-rank-code", trace="t.json.xz", rest_jitter=0.0, stall_share=0.0)
    assert series_name(args, "cpu", trace_pair) == name


def test_on_the_trace_plain_never_drafts_and_the_chain_runs_its_one_width(pair_draws):
    plain = run_arm(PAIR, "plain", concurrency=4, passes=2, seed=0, draws=pair_draws)
    chain = run_arm(PAIR, "chain", concurrency=4, passes=2, seed=0, draws=pair_draws)
    assert list(plain["width_steps"]) == [1] and list(chain["width_steps"]) == [8]
    # ~4.3 ms of host work a round: a chain accepting ~1.6 drafts a round beats decoding one token
    assert chain["tok_per_ms"] > 1.5 * plain["tok_per_ms"]
