"""The trace replay: a drafter's real draws recorded (``lab.bench.draw_recorder``), joined with the
target's greedy continuation into a trace (``lab.bench.draw_trace``), and replayed by the replay
drafter (``lab.bench.trace_replay``).

Unit: the trace keeps each round's log-probs and the true token's rank, drops rows off the
continuation, and resolves an unrecorded offset to the nearest earlier record, shifted; the
replay puts the true token at the recorded rank under the recorded log-probs, and leaves
requests off the recording or past the trace to the drafter. Server: the trained pair's own
trace, replayed on the pair, gives back its served rounds exactly (lab/notes/trace-replay.md)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from serving import SHARED_SERVERS, server_spec

from lab.bench.draw_trace import build_trace, read_json, write_json
from lab.bench.replay_drafter import Recording
from lab.bench.trace_replay import TraceReplayDrafter, resolve_offsets

PROMPT = [1, 2]
CONTINUATION = PROMPT + [10, 11, 12, 13, 14, 15]  # offsets 0..5: roots 10..15


def row(root_pos: int, ids: list[list[int]], prompt=PROMPT) -> dict:
    """A recorder row (log-probs -0.1, -0.2, ... per depth)."""
    from lab.bench.draw_recorder import prompt_hash

    root = CONTINUATION[root_pos] if root_pos < len(CONTINUATION) else 0
    logp = [[-0.1 * (r + 1) for r in range(len(depth))] for depth in ids]
    return {
        "prompt": prompt_hash(prompt),
        "prompt_len": len(prompt),
        "root_pos": root_pos,
        "root": root,
        "logp": logp,
        "ids": ids,
    }


def test_an_unrecorded_offset_takes_the_nearest_earlier_record_shifted():
    records, shifts = resolve_offsets([0, 3, 4], 8)
    assert records == [0, 0, 0, 1, 2, 2, 2, 2]
    assert shifts == [0, 1, 2, 0, 0, 1, 2, 3]
    assert resolve_offsets([2], 3) == ([-1, -1, 0], [0, 0, 0])  # nothing before the first record


def test_a_trace_joins_each_rounds_draws_with_the_continuation():
    arm_a = [
        row(2, [[99, 11], [12, 98]]),  # root offset 0: truth 11 at rank 1, then 12 at rank 0
        row(4, [[99, 98], [97, 96]]),  # offset 2: truths 13 and 14 not proposed
        row(8, [[1, 2], [3, 4]]),  # a last round past max_new_tokens
        row(2, [[5], [6]], prompt=[7, 7]),  # a prompt the continuation does not hold
    ]
    arm_b = [
        row(2, [[11, 99, 98], [97, 12, 96]]),  # offset 0 again, a wider top-k: kept in place of a's
        row(6, [[14, 15], [15, 0]]),  # offset 4: truth 15 at rank 1, then past the continuation
    ]
    left = CONTINUATION[:6] + [0, 0]  # arm c's own output left the continuation at position 6
    arm_c = [row(3, [[12, 0], [13, 0]]), row(6, [[15, 0], [0, 0]])]
    trace = build_trace([CONTINUATION], [(arm_a, None), (arm_b, None), (arm_c, [left])], topk=3)
    (request,) = trace["requests"]
    assert (request["prompt_len"], request["length"]) == (2, 6)
    assert request["offsets"] == [0, 1, 2, 4]
    assert request["rank"] == [[0, 1], [0, 0], [-1, -1], [1, -1]]
    assert request["logp"][0] == [[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]]
    summary = trace["summary"]
    assert (summary["unknown_prompt"], summary["past_end"], summary["off_continuation"]) == (1, 1, 1)
    assert summary["top1_share"] == [0.5, 0.25] and summary["in_topk_share"] == [0.75, 0.5]
    assert (trace["depth"], trace["topk"]) == (2, 3)


@pytest.mark.parametrize("name", ["t.json", "t.json.gz", "t.json.xz"])
def test_a_trace_file_is_read_back_as_written_and_compressed_by_its_suffix(tmp_path, name):
    trace = build_trace([CONTINUATION], [([row(2, [[11, 99], [12, 98]])], None)], topk=2)
    write_json(tmp_path / name, trace)
    assert read_json(tmp_path / name) == trace
    magic = (tmp_path / name).read_bytes()[:6]
    assert magic.startswith({"t.json": b"{", "t.json.gz": b"\x1f\x8b", "t.json.xz": b"\xfd7zXZ"}[name])


def test_a_trace_narrower_than_the_ask_is_padded_below_every_recorded_log_prob():
    """A trace of top-2 asked for 4 ranks (the recorder beside a replay asks its own k): the
    recorded two, then the floor, and the rank kept."""
    from lab.bench.replay_profiles import LOG_FLOOR
    from lab.bench.trace_replay import TraceTables

    request = {"prompt": "x", "prompt_len": 2, "length": 2, "offsets": [0]}
    request |= {"logp": [[[-0.1, -2.0]]], "rank": [[1]]}
    tables = TraceTables({"format": "ddtree-trace/1", "depth": 1, "topk": 2, "requests": [request]}, 2, "cpu")
    log_probs, ranks = tables.draws(torch.tensor([0]), torch.tensor([0]), 4)
    assert torch.equal(log_probs, torch.tensor([[[-0.1, -2.0, LOG_FLOOR, LOG_FLOOR]]]))
    assert ranks.tolist() == [[1]]


def _req(slot: int, prompt: list[int]):
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=slot), origin_input_ids=prompt)


def test_the_replay_puts_the_true_token_at_the_recorded_rank_under_the_recorded_log_probs():
    """Trace request 0 has records at offsets 0 and 2 (depth 3); recorded row 1 (another prompt)
    cycles onto it too (rows modulo the trace's requests)."""
    logp = [[[-0.5, -1.0, -2.0], [-0.2, -3.0, -4.0], [-1.5, -1.6, -1.7]]] * 2
    trace = {
        "format": "ddtree-trace/1",
        "depth": 3,
        "topk": 3,
        "requests": [
            {
                "prompt": "x",
                "prompt_len": 2,
                "length": 6,
                "offsets": [0, 2],
                "logp": logp,
                "rank": [[1, 0, -1], [2, 1, 0]],
            }
        ],
    }
    recording = Recording([CONTINUATION, [5, 20, 21, 22, 23, 24, 25]], device="cpu")
    drafter = TraceReplayDrafter(recording, trace, pool_rows=4, k=3, depth=3, profile="pycode-4l-ranks")
    drafter.register([_req(0, PROMPT), _req(1, [5]), _req(2, [40, 41])])  # the last: off the recording
    depth, k = 3, 3
    roots, prefix_lens = torch.tensor([11, 21, 50]), torch.tensor([3, 2, 2])  # offsets 1, 1 and none
    slots = torch.tensor([0, 1, 2])
    candidates = torch.arange(100, 100 + 3 * depth * (k + 1)).view(3 * depth, k + 1)
    own = torch.full((3 * depth, k), -7.0)
    log_probs, ids = drafter.replace_from_trace(own, candidates, roots, prefix_lens, slots, depth, k)
    # offset 1: the record at 0 shifted by 1: depths 2, 3 of it, then "not proposed"
    shifted = torch.tensor([[-0.2, -3.0, -4.0], [-1.5, -1.6, -1.7], [-1.5, -1.6, -1.7]])
    assert torch.equal(log_probs[:depth], shifted)
    truths = [[12, 13, 14], [22, 23, 24]]  # each request's own recorded tokens after its root
    for request, true_tokens in enumerate(truths):
        rows = ids[request * depth : (request + 1) * depth].tolist()
        assert rows[0][0] == true_tokens[0] and rows[1] == [
            100 + 4 * (request * depth + 1) + j for j in range(3)
        ]
        assert true_tokens[2] not in rows[2]
    assert torch.equal(log_probs[2 * depth :], own[2 * depth :])  # off the recording: the drafter's own
    assert torch.equal(ids[2 * depth :], candidates[2 * depth :, :k])
    at_record = torch.tensor([4, 2, 2])  # request 0 at offset 2, a record of its own
    exact = drafter.replace_from_trace(
        own, candidates, torch.tensor([12, 21, 50]), at_record, slots, depth, k
    )[1]
    assert exact[0].tolist()[2] == 13 and exact[1].tolist()[1] == 14 and exact[2].tolist()[0] == 15
    drafter.count(roots, prefix_lens, slots)
    assert drafter._kinds.tolist() == [0, 2, 0]  # two shifted (on their recording), one off it
    assert drafter.log_line().endswith("on the trace: 0 exact, 2 shifted, 0 off it")
    past = drafter.replace_from_trace(own, candidates, roots, torch.tensor([9, 9, 2]), slots, depth, k)
    assert torch.equal(past[0], own)  # past the trace's continuation: the drafter's own


def test_the_k26_preset_replays_a_trace_on_every_speculative_arm(tmp_path):
    from lab import ab_k26
    from sglang_ddtree.ab.arms import parse_arm_env
    from sglang_ddtree.ab.cli import build_parser

    trace = tmp_path / "trace.json.gz"
    args = ab_k26.ab_args(
        "T", "D", tmp_path / "p.json", tmp_path / "r.json", "dflash-k25-code", [], trace=trace
    )
    env = parse_arm_env(build_parser().parse_args(args).arm_env)
    assert env and all(values["SGLANG_DDTREE_REPLAY_TRACE"] == str(trace) for values in env.values())
    plain = ab_k26.ab_args("T", "D", tmp_path / "p.json", tmp_path / "r.json", "dflash-k25-code", [])
    assert "SGLANG_DDTREE_REPLAY_TRACE" not in " ".join(plain)
    short = {"format": "ddtree-trace/1", "requests": [{"length": 64}, {"length": 32}]}
    ab_k26.check_trace(short, 32)
    with pytest.raises(SystemExit, match="shorter than --output-len 64"):
        ab_k26.check_trace(short, 64)


# --------------------------------------------------------------------------- the pair itself

# One budget that branches (16): the GPU job checks 7, 16, 32 and 64 (gpu/jobs/trace_pair.sh).
ARMS_TEXT, PROMPTS, OUTPUT_LEN = "16", 4, 32
TEST = "test_trace_replay.py::test_replaying_the_pairs_own_trace_gives_back_its_rounds"


@functools.cache
def _setup():
    from lab.bench.pair_eval import DEFAULT_PAIR, load_pair
    from lab.bench.trace_pair import arm_env, parse_arms, server_args

    pair = load_pair(DEFAULT_PAIR)
    arms = parse_arms(ARMS_TEXT, pair["block"])
    work = SHARED_SERVERS.folder("trace-replay")
    (work / "record").mkdir(exist_ok=True)
    specs = {
        arm: server_spec(
            server_args(pair, arm, []),
            arm_env(arm, work / "record" / arm.name, None),
            name=arm.name,
            tmp=work / "record",
        )
        for arm in arms
    }
    return pair, arms, work, specs


SHARED_SERVERS.plan(
    lambda: {a.name: s for a, s in _setup()[3].items()}, {"ddtree@7": TEST, "ddtree@16": TEST}
)


@pytest.mark.server
def test_replaying_the_pairs_own_trace_gives_back_its_rounds(servers):
    """Budget 16 served with the real drafter and recorded, then replayed from its trace: the
    same tokens per round, every request's rounds at the same roots, the same
    outputs. The replay is seen to use the trace: every tree it built had the trace's
    log-probs, which are rounded to 3 decimals where the drafter's own are not."""
    from lab.bench.draw_trace import read_draws
    from lab.bench.trace_pair import arm_server, compare_arms, launched, serve_arms, write_trace

    pair, arms, work, specs = _setup()
    prompts = [q["input_ids"] for q in pair["prompts"][:PROMPTS]]
    served = serve_arms(
        {arm: servers.take(spec) for arm, spec in specs.items()}, prompts, OUTPUT_LEN, work / "record"
    )
    trace = write_trace(work, arms, served, 64, {"test": TEST})
    assert trace["summary"]["off_continuation"] == 0 and trace["summary"]["records"] > 40
    replay = {"tokens": work / "continuation.json", "trace": work / "trace.json"}
    replay_servers = launched({a: arm_server(pair, a, work / "replay", [], replay) for a in arms})
    replayed = serve_arms(replay_servers, prompts, OUTPUT_LEN, work / "replay")
    for result in compare_arms(work, arms, served, replayed, trace):
        assert result["ratio"] == pytest.approx(1.0, abs=0.02), result
        assert result["same_rounds"] == result["same_outputs"] == PROMPTS, result
        assert result["replay_rounds"]["shifted"] == 0, result
    recorded = {
        (r["prompt"], r["prompt_len"] + o): lp
        for r in trace["requests"]
        for o, lp in zip(r["offsets"], r["logp"])
    }
    for arm in arms:
        rows = [r for r in read_draws(work / "replay" / arm.name) if (r["prompt"], r["root_pos"]) in recorded]
        assert len(rows) > 20
        for r in rows:
            for got, traced in zip(r["logp"], recorded[(r["prompt"], r["root_pos"])]):
                n = min(len(got), len(traced))  # a record of a narrower arm is padded
                assert got[:n] == traced[:n], (arm, r["root_pos"])
        assert "a trace of 4 requests" in (work / "replay" / f"{arm.name}.log").read_text()
