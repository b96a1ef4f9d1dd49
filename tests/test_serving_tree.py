"""What the tree buys, through the real server (CPU mode).

A drafter whose proposals the test controls (``tests/oracle_plugin.py``) puts the right
token at rank 1 at some depths. A chain cannot accept past those depths; the tree
must - while every output (greedy tokens, stop conditions, log-probs, seeded
samples) stays identical to the non-speculative server. The same at width 1 at every batch
size (the online budget's decoding steps) under the sync scheduler.
"""

from __future__ import annotations

import ast
import functools
import urllib.error

import pytest
from serving import (
    GREEDY,
    PROMPTS,
    SHARED_SERVERS,
    ServerSpec,
    add_to_script,
    check_width1_drafts_only_to_predict,
    ddtree_args,
    deterministic_tree_script,
    deterministic_tree_spec,
    last_tree_stats,
    oracle_env,
    oracle_reference,
    output_ids,
    reference_server,
    run_all,
    server_spec,
    token_requests,
    uses_reference,
    width1_cost_table,
)

from lab.models.tiny import build_tiny_models
from sglang_ddtree.budget import candidate_widths

pytestmark = pytest.mark.server

SEEDED = {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "sampling_seed": 1234}


def last_phase_times(log_path) -> dict:
    lines = [ln for ln in log_path.read_text().splitlines() if "DDTREE phase host us/round:" in ln]
    assert lines, "no phase-time line in the server log"
    return ast.literal_eval(lines[-1].split("us/round:", 1)[1].strip())


def _stop_requests(tokenizer, expected):
    """Stops that fire inside an accepted path: an odd token budget, a stop token
    taken from the expected output, and a stop string."""
    requests = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, expected)):
        ids = tokenizer(prompt)["input_ids"]
        params = {"max_new_tokens": 13 + i, "temperature": 0.0}
        if i % 3 == 1:
            params["stop_token_ids"] = [out[9]]
        if i % 3 == 2:
            params["stop"] = [tokenizer.decode(out[6:8])]
        requests.append({"input_ids": ids, "sampling_params": params})
    return requests


def _logprob_requests(tokenizer):
    params = {**GREEDY, "max_new_tokens": 16}
    return [
        {
            "input_ids": r["input_ids"],
            "sampling_params": params,
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        for r in token_requests(tokenizer)[:3]
    ]


def _logprobs(results):
    return [[entry[0] for entry in r["meta_info"]["output_token_logprobs"]] for r in results]


@pytest.fixture(scope="module")
def plain(tiny, servers):
    """Everything the non-speculative server answers, and the oracle built from it.
    Its deterministic inference honours per-request sampling seeds."""
    server = reference_server(servers, tiny)
    reference = oracle_reference(server, tiny, SHARED_SERVERS.folder("tree"))
    continuations = [r["input_ids"] + out for r, out in zip(reference["requests"], reference["greedy"])]
    add_to_script(deterministic_tree_script(), "tree", continuations)
    tokenizer = reference["tokenizer"]
    stops = _stop_requests(tokenizer, reference["greedy"])
    return {
        **reference,
        "stops": stops,
        "stop": output_ids(run_all(server, stops)),
        "logprobs": _logprobs(run_all(server, _logprob_requests(tokenizer))),
        "seeded": output_ids(run_all(server, token_requests(tokenizer, SEEDED))),
    }


# server -> (budget, launch options, extra environment)
SERVERS = {
    # the chain through the server flag, which /server_info reports
    "chain": (7, ["--speculative-ddtree-max-topk", "1"], {}),
    "tree": (32, [], {}),
    # the phase timer must not change the output
    "pages-sync": (
        24,
        ["--page-size", "16", "--disable-overlap-schedule"],
        {"SGLANG_DDTREE_PHASE_TIMES": "5"},
    ),
    # width 1 at every batch size (its cost table below): decoding steps, sync scheduler, pages
    "width1-sync": (
        "auto",
        ["--speculative-num-draft-tokens", "17", "--page-size", "16", "--disable-overlap-schedule"],
        {},
    ),
}
# Seeded sampling runs on the DDTREE server the request features run on (overlap on,
# deterministic inference: serving.deterministic_tree_spec); this module adds its
# requests to that server's drafter script.
MODULE = "test_serving_tree.py::"
TEST_OF = {
    "chain": f"{MODULE}test_tree_accepts_through_siblings_and_beats_the_chain",
    "tree": f"{MODULE}test_tree_accepts_through_siblings_and_beats_the_chain",
    "pages-sync": f"{MODULE}test_tree_with_pages_and_without_overlap",
    "width1-sync": f"{MODULE}test_width_1_without_overlap_matches_plain",
}
SEEDED_TEST = f"{MODULE}test_seeded_sampling_is_stable_and_matches_plain"


@functools.cache
def tree_servers() -> dict[str, ServerSpec]:
    """Launched before the reference answers: the drafter's script (``oracle.json`` in
    the folder) is written from those answers before the first request."""
    tiny, folder = build_tiny_models(), SHARED_SERVERS.folder("tree")
    specs = {}
    width1 = width1_cost_table(folder / "width1_cost_table.json", candidate_widths(16))
    for name, (budget, extra, env) in SERVERS.items():
        if budget == "auto":
            env = {**env, "SGLANG_DDTREE_BUDGET_COST_TABLE": str(width1)}
        args = ddtree_args(tiny, budget=budget, extra=["--log-level", "info", *extra])
        specs[name] = server_spec(
            args, {**oracle_env(folder / "oracle.json"), **env}, f"ddtree-{name}", folder
        )
    return specs


SHARED_SERVERS.plan(tree_servers, TEST_OF)
SHARED_SERVERS.plan(lambda: {"seeded": deterministic_tree_spec()}, {"seeded": SEEDED_TEST})
uses_reference(MODULE)


def _take(servers, name):
    return servers.take(tree_servers()[name])


def test_tree_accepts_through_siblings_and_beats_the_chain(servers, plain):
    with _take(servers, "chain") as server:
        ddtree_info = server.server_info()["ddtree"]
        assert (ddtree_info["budget"], ddtree_info["max_topk"], ddtree_info["stats_interval"]) == (7, 1, 1)
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]
        chain_accept = server.accept_length()
        chain_log = server.log_path
    with _take(servers, "tree") as server:
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]
        tree_accept = server.accept_length()
        # stop token, stop string and odd max_new_tokens land inside accepted paths
        assert output_ids(run_all(server, plain["stops"])) == plain["stop"]
        tree_logprobs = _logprobs(run_all(server, _logprob_requests(plain["tokenizer"])))
        tree_log = server.log_path
    chain_stats, tree_stats = last_tree_stats(chain_log), last_tree_stats(tree_log)
    # the chain stops at the first rank-1 depth: one draft + bonus per round
    assert chain_stats["non_argmax_share"] == 0.0
    assert chain_accept < 2.2
    # the tree reaches past it through siblings
    assert tree_stats["non_argmax_share"] > 0.1
    assert tree_accept > chain_accept + 1.0
    assert tree_stats["mean_tree_nodes"] == pytest.approx(32.0)
    for got, want in zip(tree_logprobs, plain["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)


def test_tree_with_pages_and_without_overlap(servers, plain):
    """Accepted off-spine nodes move their KV inside 16-token pages; sync scheduler."""
    with _take(servers, "pages-sync") as server:
        info = server.server_info()
        assert info["page_size"] == 16 and info["disable_overlap_schedule"] is True
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]
        assert output_ids(run_all(server, plain["stops"])) == plain["stop"]
        assert server.accept_length() > 3.0
    assert last_tree_stats(server.log_path)["non_argmax_share"] > 0.1
    phases = last_phase_times(server.log_path)
    steps = {k: v for k, v in phases.items() if k not in ("round", "between rounds")}
    assert {"draft forward", "tree step", "verify forward", "accept", "draft kv commit"} <= set(steps)
    assert 0 < sum(steps.values()) <= phases["round"]


def test_width_1_without_overlap_matches_plain(servers, plain):
    """Width 1 at every batch size (decoding steps, ``adapter/decode_step.py``) under the sync
    scheduler, which takes the batch's lengths from each step's result, in pages of 16: greedy
    output, stops and log-probs as the plain server's."""
    with _take(servers, "width1-sync") as server:
        assert server.server_info()["disable_overlap_schedule"] is True
        assert output_ids(run_all(server, plain["requests"])) == plain["greedy"]
        assert output_ids(run_all(server, plain["stops"])) == plain["stop"]
        logprobs = _logprobs(run_all(server, _logprob_requests(plain["tokenizer"])))
    for got, want in zip(logprobs, plain["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)
    stats = last_tree_stats(server.log_path)
    check_width1_drafts_only_to_predict(server.log_path, stats)


def test_seeded_sampling_is_stable_and_matches_plain(servers, plain):
    """One target sample per tree slot, drawn by SGLang's sampler with the slot's
    position: a seeded request draws what the plain server draws."""
    server = servers.get(deterministic_tree_spec())
    assert server.server_info()["disable_overlap_schedule"] is False
    first = output_ids(run_all(server, token_requests(plain["tokenizer"], SEEDED)))
    second = output_ids(run_all(server, token_requests(plain["tokenizer"], SEEDED)))
    with pytest.raises(urllib.error.HTTPError) as refused:
        server.generate({"text": "hello", "sampling_params": {"top_k": 1}, "return_sampling_mask": True})
    assert server.process.poll() is None
    assert first == second
    assert first == plain["seeded"]
    assert refused.value.code == 400
    assert (
        "DDTREE speculative decoding does not support return_sampling_mask" in refused.value.read().decode()
    )
