"""The K2.6-rank preset of the A/B tool (``python -m lab.ab_k26``), without a GPU: the engine's
command line it builds (alternating, the replay drafter on every speculative arm), its prompts,
and the hook that records plain's continuations before any speculative server starts."""

from __future__ import annotations

import json
import shlex

import pytest

from lab import ab_k26
from sglang_ddtree.ab.arms import build_arms, parse_arm_env
from sglang_ddtree.ab.cli import build_parser


def _parsed(args):
    return build_parser().parse_args(args)


def test_every_speculative_arm_replays_plains_recording(tmp_path):
    args = ab_k26.ab_args("T", "D", tmp_path / "p.json", tmp_path / "rec.json", "pycode-4l-ranks", [])
    opts = _parsed(args)
    assert opts.schedule == "alternating" and opts.dataset == "custom"
    assert opts.arms.startswith("plain,") and "chain+again" in opts.arms
    env = parse_arm_env(opts.arm_env)
    assert set(env) == {
        "chain",
        "ddtree@7",
        "ddtree@16",
        "ddtree@32",
        "ddtree@auto7",
    }  # not plain, not +again
    for values in env.values():
        assert values["SGLANG_DDTREE_REPLAY_TOKENS"] == str(tmp_path / "rec.json")
        assert values["SGLANG_DDTREE_REPLAY_PROFILE"] == "pycode-4l-ranks"
        assert values["SGLANG_DDTREE_TEST_PLUGIN"].split(",")[-1] == "lab.bench.replay_drafter"
    # ARM+heapq: its arm's replay, and the tree built by Python's heapq (SGLang's DDTree's builder)
    args = ab_k26.ab_args(
        "T",
        "D",
        tmp_path / "p.json",
        tmp_path / "r.json",
        "dflash-k25-code",
        ["--arms", "chain,ddtree@32,ddtree@32+heapq"],
    )
    opts = _parsed(args + ["--block-size", "8"])
    arms = {a.name: a for a in build_arms(opts, "T", "D", shlex.split(opts.server_args), cpu=False)}
    assert arms["ddtree@32+heapq"].env["SGLANG_DDTREE_TREE_BACKEND"] == "python"
    assert arms["ddtree@32+heapq"].env["SGLANG_DDTREE_REPLAY_PROFILE"] == "dflash-k25-code"
    assert "SGLANG_DDTREE_TREE_BACKEND" not in arms["chain"].env | arms["ddtree@32"].env
    # the online budget's arm logs its widths within a call's ~1,000 steps; the others do not log them
    assert env["ddtree@auto7"]["SGLANG_DDTREE_ONLINE_BUDGET_LOG_EVERY"] == "100"
    assert "SGLANG_DDTREE_ONLINE_BUDGET_LOG_EVERY" not in env["ddtree@7"]
    server = shlex.split(opts.server_args)
    assert server[server.index("--load-format") + 1] == "dummy"
    # later options win, and the arms finally asked for are the ones that replay
    args = ab_k26.ab_args(
        "T", "D", tmp_path / "p.json", tmp_path / "r.json", "dflash-k25-code", ["--arms", "plain,ddtree@8"]
    )
    opts = _parsed(args)
    assert opts.arms == "plain,ddtree@8" and set(parse_arm_env(opts.arm_env)) == {"ddtree@8"}
    arms = {a.name: a for a in build_arms(opts, "T", "D", shlex.split(opts.server_args), cpu=False)}
    assert "SGLANG_DDTREE_REPLAY_TOKENS" not in arms["plain"].env
    assert arms["ddtree@8"].env["SGLANG_DDTREE_REPLAY_PROFILE"] == "dflash-k25-code"


def test_prompts_carry_their_profile_and_length():
    base = [[10, 11, 12], [20, 21]]
    prompts = ab_k26.prompt_ids(base, 7, 1, 3)
    assert all(len(p) == 7 and p[0] == 2 for p in prompts)
    assert prompts[0] != prompts[1]


class _Arm:
    def __init__(self, name):
        self.name = name


class _Server:
    def __init__(self):
        self.calls = 0

    def generate(self, payload):
        self.calls += 1
        n = payload["sampling_params"]["max_new_tokens"]
        return {"output_ids": [p + 100 for p in payload["input_ids"][:1]] * n}


def test_plains_first_server_records_once_before_the_others(tmp_path):
    prompts = [[1, 5, 6], [1, 7, 8]]
    path = tmp_path / "recording.json"
    hook = ab_k26.recorder(prompts, 4, "dflash-k25-code", path)
    server = _Server()
    hook(_Arm("chain"), server, {})
    assert not path.exists() and server.calls == 0
    hook(_Arm("plain"), server, {})
    recording = json.loads(path.read_text())
    assert recording["sequences"] == [[1, 5, 6, 101, 101, 101, 101], [1, 7, 8, 101, 101, 101, 101]]
    assert recording["profiles"] == ["dflash-k25-code"] * 2
    hook(_Arm("plain"), server, {})  # plain's second start keeps the first recording
    assert server.calls == 2
    ab_k26.check_recording(recording, prompts, 4)
    with pytest.raises(SystemExit, match="no continuation of 5 tokens"):
        ab_k26.check_recording(recording, prompts, 5)


def test_a_run_that_does_not_start_with_plain_needs_a_recording(tmp_path):
    argv = ["--model", "T", "--drafter", "D", "--work", str(tmp_path), "--arms", "chain,plain"]
    with pytest.raises(SystemExit, match="must begin with plain"):
        ab_k26.main(argv)
