"""The online budget (``--speculative-ddtree-budget auto``) through the real CPU server.

The drafter is the tests' oracle (``tests/oracle_plugin.py``: the right token at rank 0 or 1
per depth), so acceptance is controlled and every width has something to accept. Every
output must equal the non-speculative server's, whatever width each step ran.

* measured costs: each batch size first probes every candidate width (so the widths change
  from step to step), then chooses from the measured round times;
* an injected cost table (``SGLANG_DDTREE_BUDGET_COST_TABLE``) whose arithmetic leaves no
  choice: at batch size 1 every width costs the same, so the largest tree (the most
  expected tokens) must win; from batch size 2 a round costs ``w^2``, so no tree can pay
  for itself (``E_w <= 2 (w - 1) bs`` even at the calibration's largest scale, below the
  ``(w^2 - 1) bs`` it would need) and every step must verify the root alone, without running
  the drafter (the phase timer, on for this server, logs one line per round: a round that
  ran the drafter has a ``draft forward`` phase); when the batch is gone, the tree must come
  back at batch size 1;
* an injected cost table where width 1 wins at every batch size: every step but the ones that
  draft to predict (a request's first, a refresh) is a decoding step
  (``adapter/decode_step.py``): the phase lines of those steps hold its phases and none of the
  round's (no window, mask, tree verify, accept walk or KV move), and the output is the plain
  server's, one request at a time and in a batch.
"""

from __future__ import annotations

import ast
import functools
import re

import pytest
from serving import (
    SHARED_SERVERS,
    ServerSpec,
    check_width1_drafts_only_to_predict,
    ddtree_args,
    decode_checks,
    last_tree_stats,
    one_batch,
    oracle_env,
    oracle_reference,
    output_ids,
    reference_server,
    run_all,
    server_spec,
    stats_between,
    uses_reference,
    width1_spec,
    write_json,
)

from lab.models.tiny import build_tiny_models
from sglang_ddtree.ab.profiling import profile_level
from sglang_ddtree.budget import candidate_widths

pytestmark = pytest.mark.server

MAX_BUDGET = 16
WIDTHS = list(candidate_widths(MAX_BUDGET))  # [1, 2, 4, 8, 16, 17]


def run_batch(server, requests) -> list[list[int]]:
    """All requests in one call, so that the scheduler decodes them as one batch."""
    return output_ids(server.generate(one_batch(requests)))


@pytest.fixture(scope="module")
def plain(tiny, servers):
    return oracle_reference(reference_server(servers, tiny), tiny, SHARED_SERVERS.folder("online-budget"))


# A cost table whose arithmetic leaves no choice (module docstring).
INJECTED_BATCH_SIZES = [1, 2, 4, 8]
INJECTED_TABLE = {
    "batch_sizes": INJECTED_BATCH_SIZES,
    "widths": WIDTHS,
    "ms": [[10.0] * len(WIDTHS)] + [[10.0 * w * w for w in WIDTHS] for _ in INJECTED_BATCH_SIZES[1:]],
}
MODULE = "test_serving_online_budget.py::"
TEST_OF = {
    "auto-measured": f"{MODULE}test_auto_with_measured_costs_is_identical_to_plain",
    "auto-injected": f"{MODULE}test_injected_costs_flip_the_width_where_the_arithmetic_says",
    "auto-width1": f"{MODULE}test_width_1_everywhere_decodes_like_the_plain_server",
}
# Phases only a round (a tree, or width 1 with the drafter) has; a decoding step has none.
ROUND_PHASES = {"window", "mask", "verify prepare", "verify forward", "accept", "target kv commit"}
DECODE_PHASES = {"decode prepare", "decode forward", "posterior", "draft kv commit"}
# A plain step (adapter/plain_steps.py): plain decoding's forward and sampler, the drafter's KV.
PLAIN_PHASES = {"plain step", "draft kv commit"}
DECODING_STEP_ONLY = (DECODE_PHASES | {"features"}) - PLAIN_PHASES  # none of them in a plain step


@functools.cache
def budget_servers() -> dict[str, ServerSpec]:
    """Launched before the reference answers: the drafter's script (``oracle.json`` in
    the folder) is written from those answers before the first request."""
    tiny, folder = build_tiny_models(), SHARED_SERVERS.folder("online-budget")
    args = ddtree_args(
        tiny,
        budget="auto",
        extra=["--speculative-num-draft-tokens", str(MAX_BUDGET + 1), "--log-level", "info"],
    )
    table = write_json(folder / "cost_table.json", INJECTED_TABLE)
    envs = {
        "auto-measured": {},
        "auto-injected": {"SGLANG_DDTREE_BUDGET_COST_TABLE": str(table), "SGLANG_DDTREE_PHASE_TIMES": "1"},
    }
    specs = {
        name: server_spec(args, {**oracle_env(folder / "oracle.json"), **env}, name, folder)
        for name, env in envs.items()
    }
    return {**specs, "auto-width1": width1_spec()}  # shared with two other modules


SHARED_SERVERS.plan(budget_servers, TEST_OF)
uses_reference(MODULE)


def _take(servers, name):
    return servers.take(budget_servers()[name])


def test_auto_with_measured_costs_is_identical_to_plain(servers, plain):
    with _take(servers, "auto-measured") as server:
        info = server.server_info()["ddtree"]
        assert info["budget"] == "auto"
        assert info["online_budget"] == {
            "max_budget": MAX_BUDGET,
            "widths": WIDTHS,
            "verify_graphs": "none (eager)",
            "cost_table": "measured",
        }
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]  # batch size 1
        assert run_batch(server, plain["requests"]) == plain["greedy"]  # batch sizes up to 8
        both = [plain["requests"][0]["input_ids"], plain["requests"][1]["input_ids"]]
        profile = profile_level(
            server.url, both, 2, plain["tmp"] / "profile", steps=6, max_new_tokens=96, export_seconds=60
        )
    stats = last_tree_stats(server.log_path)
    # the probes ran every width at batch size 1, each at least twice
    assert set(stats["width_steps_by_bs"][1]) == set(WIDTHS), stats
    assert min(stats["width_steps_by_bs"][1].values()) >= 2, stats
    assert len(stats["width_steps_by_bs"]) > 1, stats  # and the batch ran at other sizes
    # the A/B tool's profile (--profile ARM@2) through this server: two requests decoding together
    # under SGLang's torch profiler, its rounds counted from SGLang's forward names in the trace (a
    # CPU trace: host time only); the profiler started once both were decoding
    assert "error" not in profile, profile
    assert profile["rounds"] >= 2 and profile["round_us"] > 0 and "gpu_busy_us" not in profile, profile
    rounds = [f for f in profile["forwards"] if re.match(r"step\[(VERIFY|DECODE) ", f)]
    assert rounds and all(" bs=2]" in f for f in rounds), profile
    assert not any(f.startswith("step[EXTEND") for f in profile["forwards"]), profile


def phase_rounds(log) -> list[dict]:
    """Per decode round, the phase timer's line of that round (phase -> host us)."""
    lines = [line for line in log.read_text().splitlines() if "DDTREE phase host us/round:" in line]
    return [ast.literal_eval(re.sub(r"^.*us/round: ", "", line)) for line in lines]


def drafter_rounds(log) -> list[bool]:
    """Per decode round: did the drafter run."""
    return ["draft forward" in phases for phases in phase_rounds(log)]


def check_decoding_steps(log, stats) -> None:
    """Every round without the drafter ran as a decoding step: its phases, none of a round's."""
    rounds = phase_rounds(log)
    decoding = [phases for phases in rounds if "draft forward" not in phases]
    assert len(decoding) == stats["decode_steps"] == stats["width1_steps_without_draft"], stats
    plain = [phases for phases in decoding if "plain step" in phases]
    assert len(plain) == stats["plain_steps"], stats
    for phases in decoding:
        assert not ROUND_PHASES & set(phases), phases
        if "plain step" in phases:  # plain decoding's own step, none of the decoding step's
            assert PLAIN_PHASES <= set(phases) and not DECODING_STEP_ONLY & set(phases), phases
        else:
            assert DECODE_PHASES <= set(phases) and "plain step" not in phases, phases
    for phases in rounds:
        if "draft forward" in phases:
            # a drafted round of width 1 verifies its one-node tree by the decode forward: no mask
            assert ROUND_PHASES - {"mask"} <= set(phases) and "decode forward" not in phases, phases


def test_injected_costs_flip_the_width_where_the_arithmetic_says(servers, plain):
    with _take(servers, "auto-injected") as server:
        log = server.log_path
        assert server.server_info()["ddtree"]["online_budget"]["cost_table"] == "fixed"
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]
        sequential = last_tree_stats(log)
        assert run_batch(server, plain["requests"]) == plain["greedy"]
        after_batch = last_tree_stats(log)
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]  # batch size 1 again
        final = last_tree_stats(log)
    # batch size 1: the largest tree, after the very first step (no prediction yet: width 1)
    alone = sequential["width_steps_by_bs"]
    assert list(alone) == [1] and set(alone[1]) <= {1, WIDTHS[-1]} and alone[1].get(1, 0) <= 1, alone
    assert alone[1][WIDTHS[-1]] > 20
    # in a batch: the root alone, every step
    batched = last_tree_stats(log)["width_steps_by_bs"]
    shared = {bs: steps for bs, steps in batched.items() if bs > 1}
    assert shared and all(set(steps) == {1} for steps in shared.values()), batched
    width1 = sum(steps[1] for steps in shared.values())
    assert width1 > 10, batched
    # the root alone without the drafter: every width-1 step but the very first (nothing
    # predicted yet), the refreshes after the trees (runs of 2, 4, 8, 16 and 32: refresh.py) and
    # one in every 65 after them; the phase lines say the same, round by round
    assert sequential["width1_steps_without_draft"] == 0, sequential
    without = after_batch["width1_steps_without_draft"]
    assert without >= width1 - width1 // 65 - 6, after_batch
    drafted = drafter_rounds(log)
    assert len(drafted) == final["rounds"], (len(drafted), final["rounds"])
    # the online budget's own host work is a phase of every round, drafted or not
    assert all({"width choice", "width record"} <= set(phases) for phases in phase_rounds(log))
    assert drafted.count(False) == final["width1_steps_without_draft"] == without
    check_decoding_steps(log, final)
    # the batch is gone: back to the largest tree at batch size 1, drafting every step
    alone_again = final["width_steps_by_bs"][1]
    assert alone_again[WIDTHS[-1]] - after_batch["width_steps_by_bs"][1][WIDTHS[-1]] > 20, final
    assert alone_again.get(1, 0) == after_batch["width_steps_by_bs"][1].get(1, 0), final


def test_width_1_everywhere_decodes_like_the_plain_server(servers, plain):
    server = servers.get(budget_servers()["auto-width1"])  # the other modules' steps counted apart
    log = server.log_path
    before = last_tree_stats(log, required=False)
    assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]  # batch size 1
    assert run_batch(server, plain["requests"]) == plain["greedy"]  # batch sizes up to 8
    stats = last_tree_stats(log)
    ours = stats_between(before, stats)
    assert set(stats["width_steps"]) == {1}, stats
    # a step drafts (to predict) only where the prediction is missing or stale: a request's
    # first step alone (it joined a batch of 1), the batch's first steps as its requests join,
    # the server's first refreshes (runs of 2, 4, 8, 16, 32: refresh.py), then one in every 65
    # (one more where the run before left the count part-way)
    drafted = ours["rounds"] - ours["decode_steps"]
    assert 0 < drafted <= 2 * len(plain["requests"]) + ours["rounds"] // 65 + 6, (ours, stats)
    check_width1_drafts_only_to_predict(log, stats)
    assert len(stats["width_steps_by_bs"]) > 1, stats  # the batch ran at other sizes
    # a width-1 step right after one that emitted a token per request of the same batch runs as
    # SGLang's own decode step (adapter/plain_steps.py): the first of each run stays in the
    # speculative frame (after a drafted step or a prefill, the host does not know the lengths)
    in_frame = ours["decode_steps"] - ours["plain_steps"]
    assert 0 < in_frame <= drafted + 2 * len(plain["requests"]) + 1 < ours["plain_steps"], ours
    # the KV reservation (adapter/reservation.py) tops up in chunks: a step allocates only where
    # a request is new or has used up its chunk (34 slots and more, in pages of 16), not at
    # every step as DFlash's
    reserved = ours["reservation"]
    assert reserved["steps"] >= ours["rounds"] and 0 < reserved["top_ups"] <= reserved["steps"] // 4, ours
    check_decoding_steps(log, stats)
    # each decoding step's hidden states (what the drafter's KV is written from) are the width-1
    # verify's, the readable reference (tests/decode_check_plugin.py), to float32 rounding
    checks = decode_checks(log)
    assert len(checks) >= ours["decode_steps"] > 0, (len(checks), ours)
    assert all(isinstance(c, tuple) and c[1] <= 1e-4 * max(c[2], 1.0) for c in checks), checks[:5]
