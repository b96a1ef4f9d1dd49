"""DDTREE served by real SGLang on a GPU: exact in float32 against the plain server (eager
and CUDA graphs, overlap on and off, page 1 and 16, chunked prefill, radix hits, bs 1 to 16
with padded graph shapes and mixed lengths, aborts), margin-exact in bf16, with the CUDA
tree kernels in the round."""

from __future__ import annotations

import ast
import concurrent.futures
import json
import re
import urllib.error

import pytest

from sglang_ddtree.launch import http_json

from .arms import (
    ARMS,
    NEOX_ARMS,
    REFERENCE,
    first_difference,
    greedy,
    greedy_batch,
    heldout_prompts,
    is_float32_tie,
    margin_violations,
    top2_logprobs,
    tp_size,
)

pytestmark = pytest.mark.gpu_server

N_PROMPTS, N_TOKENS = 16, 128
FP32_DDTREE_ARMS = [
    "ddtree_fp32_graphs",
    "ddtree_fp32_graphs_page16_no_overlap_chunked",
    "ddtree_fp32_eager",
]
# Batches that land on captured graph sizes (16, 8) and on padded ones (11 -> 12, 5 -> 8),
# with mixed output lengths so requests leave the batch at different rounds.
BATCHES = [(16, None), (11, [128, 17, 64, 96, 33, 128, 5, 80, 128, 47, 111]), (5, [40, 128, 9, 77, 128])]


@pytest.fixture(scope="session")
def prompts():
    return heldout_prompts(N_PROMPTS)


@pytest.fixture(scope="session")
def plain_outputs(fleet, prompts):
    """Greedy outputs of each plain float32 server, computed once."""
    cache = {}

    def outputs(arm):
        name = REFERENCE.get(arm, "plain_fp32")
        if name not in cache:
            cache[name] = [greedy(fleet[name], p, N_TOKENS) for p in prompts]
        return fleet[name], cache[name]

    return outputs


def _record_identity(results, name, outputs, reference, prompts):
    """Record the first differing token per request, with the reference's own top-2
    log-probs there. Returns the first difference per request that is a defect: a float32
    tie (:func:`is_float32_tie`) ends the comparison of its request without failing it, and
    is recorded as such."""
    server, expected = reference
    diffs = [first_difference(o, r[: len(o)]) for o, r in zip(outputs, expected)]
    gaps, ties = {}, {}
    for i, d in enumerate(diffs):
        if d is not None:
            _, top = top2_logprobs(server, prompts[i], expected[i][: d + 1])[d]
            at = {"index": d, "expected": expected[i][d], "got": outputs[i][d], "reference_top2": top}
            (ties if is_float32_tie(top, expected[i][d], outputs[i][d]) else gaps)[i] = at
    results[name] = {
        "requests": len(outputs),
        "first_difference": diffs,
        "identical": not gaps,
        "at_difference": gaps,
        "float32_ties": ties,
    }
    return [None if i in ties else d for i, d in enumerate(diffs)]


@pytest.mark.parametrize("arm", FP32_DDTREE_ARMS)
def test_fp32_sequential_identical_to_plain(fleet, prompts, plain_outputs, results, arm):
    server = fleet[arm]
    outputs = [greedy(server, p, N_TOKENS) for p in prompts]
    diffs = _record_identity(results, f"{arm}/bs1", outputs, plain_outputs(arm), prompts)
    results[f"{arm}/bs1"]["accept_length"] = server.accept_length()
    assert all(d is None for d in diffs), f"first differing token per prompt: {diffs}"
    assert server.accept_length() > 1.5  # the tree is used, not bypassed


@pytest.mark.parametrize("arm", FP32_DDTREE_ARMS)
def test_fp32_batches_identical_to_plain(fleet, prompts, plain_outputs, results, arm):
    server = fleet[arm]
    failures = []
    for size, lengths in BATCHES:
        lengths = lengths or [N_TOKENS] * size
        outputs = greedy_batch(server, prompts[:size], lengths)
        diffs = _record_identity(results, f"{arm}/batch{size}", outputs, plain_outputs(arm), prompts)
        failures += [(size, i, d) for i, d in enumerate(diffs) if d is not None]
    assert not failures, f"(batch, request, first differing token): {failures}"


@pytest.mark.parametrize("arm", ["ddtree_fp32_graphs", "ddtree_fp32_graphs_page16_no_overlap_chunked"])
def test_fp32_aborts_leave_the_server_exact(fleet, prompts, plain_outputs, results, arm):
    """Requests dropped mid-generation by their clients (SGLang aborts them) do not
    disturb the KV or the trees of the requests that follow."""
    server = fleet[arm]

    def dropped(prompt):
        payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        try:
            http_json(f"{server.url}/generate", payload, timeout=0.3)
        except (urllib.error.URLError, TimeoutError, OSError):
            pass

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(dropped, prompts[:8]))
    outputs = greedy_batch(server, prompts[:8], [N_TOKENS] * 8)
    diffs = _record_identity(results, f"{arm}/after_aborts", outputs, plain_outputs(arm), prompts)
    assert all(d is None for d in diffs), diffs


@pytest.mark.parametrize("arm", ["ddtree_bf16_graphs", "dflash_bf16_graphs"])
def test_bf16_margin_aware_exact(fleet, prompts, results, arm):
    """Every emitted token is the plain bf16 server's argmax for its prefix wherever that
    argmax leads by more than bf16 noise (BF16_MARGIN); near-ties are counted."""
    server, reference = fleet[arm], fleet["plain_bf16_graphs"]
    outputs = [greedy(server, p, N_TOKENS) for p in prompts]
    outputs += greedy_batch(server, prompts, [N_TOKENS] * len(prompts))
    checks = [margin_violations(reference, p, o) for p, o in zip(prompts + prompts, outputs)]
    violations = [v for c in checks for v in c["violations"]]
    results[f"{arm}/bf16_margin"] = {
        "tokens": sum(len(o) for o in outputs),
        "violations": violations,
        "near_ties": sorted(g for c in checks for g in c["near_ties"]),
        "accept_length": server.accept_length(),
    }
    assert not violations, violations[:5]


def test_tree_kernels_serve_the_round(fleet):
    """The worker builds its trees with the CUDA kernels (CuPy) on the GPU, inside the
    drafter's CUDA graphs where graphs are captured, and the drafter's block attention runs as
    a split-KV decode (its start-up self-check passed; a wrong one would also sink the accept
    lengths the identity tests check)."""
    for arm in ("ddtree_fp32_graphs", "ddtree_bf16_graphs"):
        assert "tree builder=cuda" in fleet.log_text(arm), arm
        assert "tree step folded into the drafter's CUDA graphs" in fleet.log_text(arm), arm
        assert "the drafter's block attention runs as a split-KV decode" in fleet.log_text(arm), arm
    if "ddtree_fp32_eager" in fleet.servers:  # not among the TP-2 job's arms
        assert "tree step folded" not in fleet.log_text("ddtree_fp32_eager")


def test_graph_arms_decode_on_graphs(fleet):
    """The CUDA-graph arms run their rounds on graphs (not silently eager), the eager arm not."""
    for arm in ("ddtree_fp32_graphs", "ddtree_bf16_graphs", "ddtree_fp32_graphs_page16_no_overlap_chunked"):
        assert "cuda graph: True" in fleet.log_text(arm), arm
    assert "cuda graph: True" not in fleet.log_text("ddtree_fp32_eager")


def test_draft_kv_graphs_write_what_the_eager_append_writes(fleet, prompts, results):
    """The drafter KV append replayed from CUDA graphs == the eager append. One request at a
    time, a drafter that reads a wrong context proposes differently, so the verify rounds each
    request takes differ; with the same context KV they are the same in both arms."""
    assert "drafter KV append captured" in fleet.log_text("ddtree_fp32_graphs")
    assert "drafter KV append captured" not in fleet.log_text("ddtree_fp32_graphs_eager_kv")
    params = {"max_new_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True}
    rounds = {}
    for arm in ("ddtree_fp32_graphs", "ddtree_fp32_graphs_eager_kv"):
        metas = [
            fleet[arm].generate({"input_ids": p, "sampling_params": params})["meta_info"] for p in prompts
        ]
        rounds[arm] = [m.get("spec_verify_ct") for m in metas]
    results["draft_kv_graphs/rounds_per_request"] = rounds
    assert None not in rounds["ddtree_fp32_graphs"]
    assert rounds["ddtree_fp32_graphs"] == rounds["ddtree_fp32_graphs_eager_kv"]


def test_fused_context_kv_in_graphs_writes_what_its_eager_append_writes(
    fleet, prompts, plain_outputs, results
):
    """A neox-style drafter takes SGLang's fused context-KV path, whose workspace a prefill
    longer than the captured rows (16 x 33) replaces: after such a prefill, the rounds replayed
    on the capture-time workspace must write the drafter KV the eager append writes (the
    verify rounds per request equal) and outputs stay the plain server's."""
    if not set(NEOX_ARMS) <= set(fleet.servers) | set(fleet.errors):  # one that failed fails
        pytest.skip(f"opt-in arms: GPU_SERVER_ARMS=plain_fp32,{','.join(NEOX_ARMS)}")
    long_prompt = [t for p in prompts[:8] for t in p]  # 768 tokens
    _, want = plain_outputs("ddtree_fp32_graphs_neox")
    params = {"max_new_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True}
    rounds = {}
    for arm in ("ddtree_fp32_graphs_neox", "ddtree_fp32_graphs_neox_eager_kv"):
        assert "DFLASH fused KV materialization enabled" in fleet.log_text(arm), arm
        greedy(fleet[arm], long_prompt, 16)
        metas = [fleet[arm].generate({"input_ids": p, "sampling_params": params}) for p in prompts]
        assert [m["output_ids"] for m in metas] == want, arm
        rounds[arm] = [m["meta_info"].get("spec_verify_ct") for m in metas]
    assert "drafter KV append captured" in fleet.log_text("ddtree_fp32_graphs_neox")
    assert "drafter KV append captured" not in fleet.log_text("ddtree_fp32_graphs_neox_eager_kv")
    results["fused_context_kv/rounds_per_request"] = rounds
    assert None not in rounds["ddtree_fp32_graphs_neox"]
    assert rounds["ddtree_fp32_graphs_neox"] == rounds["ddtree_fp32_graphs_neox_eager_kv"]


def test_tp_ranks_build_the_same_trees(fleet, results):
    """Above TP-1 (``GPU_SERVER_TP``) every DDTREE arm runs the rank-agreement check each
    round (``arm_env``); its log must show the check ran and never saw ranks diverge."""
    if tp_size() == 1:
        pytest.skip("TP-1: one rank")
    checked = {}
    for arm in [a for a in fleet.servers if "DDTREE" in ARMS[a]]:
        log = fleet.log_text(arm)
        assert "ranks diverged" not in log, arm
        rounds = [
            int(n) for n in re.findall(r"TP tree check: (\d+) rounds, trees and accepted paths agree", log)
        ]
        assert rounds, f"{arm}: the TP tree check never ran"
        checked[arm] = max(rounds)
    assert checked, "no DDTREE arm was started"
    results["tp_tree_check"] = {"tp_size": tp_size(), "rounds_logged": checked}


def test_width_ones_decode_graphs_append_what_the_eager_append_writes(fleet, prompts, plain_outputs, results):
    """Width 1's decode graphs append the roots' drafter KV themselves (``draft_kv_graphs.py``)
    == the eager append. One batched request (one scheduler message, one prefill) decoded at
    width 1 (the injected table), its longest request then alone in the largest trees, whose
    drafter reads the context KV the width-1 steps wrote: a wrong row, slot or position there
    changes its proposals, so the verify rounds per request must be the eager append's, and
    the outputs plain's."""
    arms = ("ddtree_fp32_graphs_auto_width1", "ddtree_fp32_graphs_auto_width1_eager_kv")
    if not set(arms) <= set(fleet.servers) | set(fleet.errors):  # one that failed fails
        pytest.skip(f"opt-in arms: GPU_SERVER_ARMS=plain_fp32,{','.join(arms)}")
    marker = "the roots' drafter KV append inside"
    assert marker in fleet.log_text(arms[0]) and marker not in fleet.log_text(arms[1])
    lengths = [40, 128, 9, 77, 100]
    requests = prompts[: len(lengths)]
    payload = {
        "input_ids": requests,
        "sampling_params": [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lengths],
    }
    answers = {arm: fleet[arm].generate(payload) for arm in arms}
    rounds = {arm: [a["meta_info"].get("spec_verify_ct") for a in answers[arm]] for arm in arms}
    results["width1_graph_append/rounds_per_request"] = rounds
    outputs = [a["output_ids"] for a in answers[arms[0]]]
    diffs = _record_identity(
        results, "width1_graph_append/identity", outputs, plain_outputs(arms[0]), requests
    )
    assert all(d is None for d in diffs), diffs
    assert None not in rounds[arms[0]]
    assert rounds[arms[0]] == rounds[arms[1]]


def _check_width1_steps(server, prompt, want, stats, log_text):
    """Injected costs: every batched step verified the root alone, and a request alone after
    the batches runs the largest tree again (from the prediction kept through them)."""
    batched = {bs: steps for bs, steps in stats["width_steps_by_bs"].items() if bs > 1}
    assert batched and all(set(steps) == {1} for steps in batched.values()), stats
    largest = max(stats["width_steps"])
    before = stats["width_steps_by_bs"][1].get(largest, 0)
    assert greedy(server, prompt, N_TOKENS) == want
    final = ast.literal_eval(re.findall(r"DDTREE stats: (\{.*\})", log_text())[-1])
    assert final["width_steps_by_bs"][1].get(largest, 0) > before, final


def _check_decode_hidden_states(log_text: str, decode_steps: int, results, arm: str) -> None:
    """Every decoding step's hidden states (width 1's decode graphs: what the drafter's KV is
    written from) against an eager width-1 verify of the same roots (tests/decode_check_plugin.py),
    float32: within the rounding of two attention kernels."""
    lines = re.findall(r"DDTREE decode check: (.*)", log_text)
    checks = [re.match(r"rows (\d+) max \|hidden - reference\| (\S+) scale (\S+)", line) for line in lines]
    worst = max((float(c[2]) / max(float(c[3]), 1.0) for c in checks if c), default=None)
    results[f"{arm}/decode_check"] = {"steps": len(lines), "worst_relative": worst}
    assert len(lines) >= decode_steps > 0, (len(lines), decode_steps)
    assert all(checks) and worst <= 1e-3, [line for line in lines if "shape" in line][:3] or worst


def _near_limit_requests(prompts, context: int, new_tokens: int, budget: int):
    """Prompts that, with ``new_tokens`` more, end exactly at the context limit, one below it
    and one verify budget below it (the tree slots of their last rounds sit past it)."""
    stream = [t for p in prompts for t in p] * (1 + context // max(1, sum(len(p) for p in prompts)))
    ends = [context, context - 1, context - budget]
    return [stream[i : i + end - new_tokens] for i, end in enumerate(ends)]


@pytest.mark.parametrize("arm", ["ddtree_fp32_graphs", "ddtree_fp32_graphs_page16_no_overlap_chunked"])
def test_fp32_requests_ending_at_the_context_limit(fleet, prompts, results, arm):
    """The default context length is the pair's max_position_embeddings (the RoPE tables'
    length): requests ending there, alone and together, must equal the plain server's."""
    from .arms import PAIR

    context = json.loads((PAIR / "target" / "config.json").read_text())["max_position_embeddings"]
    new_tokens = 48
    requests = _near_limit_requests(prompts, context, new_tokens, budget=32)
    reference = fleet[REFERENCE.get(arm, "plain_fp32")]
    want = [greedy(reference, p, new_tokens) for p in requests]
    alone = [greedy(fleet[arm], p, new_tokens) for p in requests]
    together = greedy_batch(fleet[arm], requests, [new_tokens] * len(requests))
    results[f"{arm}_context_limit"] = {"context": context, "identical": alone == want and together == want}
    assert alone == want
    assert together == want


@pytest.mark.parametrize(
    "arm", ["ddtree_fp32_eager_auto", "ddtree_fp32_graphs_auto", "ddtree_fp32_graphs_auto_width1"]
)
def test_fp32_online_budget_identical_to_plain(fleet, prompts, plain_outputs, results, arm):
    """``--speculative-ddtree-budget auto``, eager and with a verify graph set per width:
    token-identical to plain at bs 1 and in the suite's batches whatever width each step ran;
    the stats line shows the widths chosen per batch size, the calibration and the round costs
    (under graphs timed at start-up, then refined). Width-1 steps mostly run no drafter (the
    prediction's refreshes draft); with the injected table of ``..._width1`` every
    batched step is one, in width 1's verify graphs, and the tree comes back at bs 1 after."""
    if arm not in fleet.servers and arm not in fleet.errors:  # not asked for; one that failed fails
        pytest.skip(f"opt-in arm: GPU_SERVER_ARMS=plain_fp32,{arm} (gpu/jobs/online_budget.sh)")
    server = fleet[arm]
    outputs = [greedy(server, p, N_TOKENS) for p in prompts]
    diffs = _record_identity(results, f"{arm}/bs1", outputs, plain_outputs(arm), prompts)
    failures = [(1, i, d) for i, d in enumerate(diffs) if d is not None]
    for size, lengths in BATCHES:
        outputs = greedy_batch(server, prompts[:size], lengths or [N_TOKENS] * size)
        diffs = _record_identity(results, f"{arm}/batch{size}", outputs, plain_outputs(arm), prompts)
        failures += [(size, i, d) for i, d in enumerate(diffs) if d is not None]
    lines = re.findall(r"DDTREE stats: (\{.*\})", fleet.log_text(arm))
    assert lines, "no stats line in the online-budget arm's log"
    stats = ast.literal_eval(lines[-1])
    results[f"{arm}/widths"] = {**stats, "accept_length": server.accept_length()}
    assert not failures, f"(batch, request, first differing token): {failures}"
    assert len(stats["width_steps"]) > 1  # the first step runs the root alone, later ones trees
    # Most width-1 steps skip the drafter, but not all: the first, one in every 65 and one after
    # half the batch has joined since the last prediction draft to refresh it (widths.py).
    width1, skipped = stats["width_steps"].get(1, 0), stats["width1_steps_without_draft"]
    assert width1 // 2 <= skipped < width1, stats
    if arm == "ddtree_fp32_graphs_auto_width1":
        # a width-1 step after one that emitted a token per request of the same batch runs as
        # SGLang's own decode step (adapter/plain_steps.py); the first of each run does not
        assert 0 < stats["plain_steps"] < skipped, stats
        _check_width1_steps(server, prompts[0], plain_outputs(arm)[1][0], stats, lambda: fleet.log_text(arm))
        _check_decode_hidden_states(fleet.log_text(arm), skipped, results, arm)
    if arm == "ddtree_fp32_graphs_auto":
        log = fleet.log_text(arm)
        captured = {
            int(w): kind for kind, w in re.findall(r"(decode|verify) graphs of width (\d+) captured", log)
        }
        results[f"{arm}/startup"] = re.findall(r"start-up round costs .*", log)[-1:]
        # every candidate below the largest (33): width 1 in decode graphs, the rest verify graphs
        assert captured == {1: "decode", 2: "verify", 4: "verify", 8: "verify", 16: "verify", 32: "verify"}, (
            captured
        )
        assert results[f"{arm}/startup"], "no start-up cost table in the log"
        assert "round_ms" in stats
