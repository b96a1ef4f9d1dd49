"""Request features under a tree, through the real server (CPU mode, float32).

Every request of one concurrent batch carries a feature - json_schema, regex,
EBNF, frequency / presence / repetition penalty, min_new_tokens, logit_bias, a
custom logit processor, seeded sampling with a penalty or a grammar - or none.
The DDTREE server (overlap on) must answer token for token what the plain
server answers, while the controlled drafter puts the right token behind a decoy
at some depths, so accepted paths go through non-argmax siblings. A chain
accepts at most one draft per round under that script; each feature request
must average more than two tokens per round.

A server of ``--speculative-ddtree-budget auto`` whose injected costs make width 1 win at
every batch size runs nearly every step as a decoding step (``adapter/decode_step.py``: the
root alone, no tree); the same requests, and stop strings besides, must come out as the plain
server's there too.

The plain reference runs with ``--disable-overlap-schedule``: with overlap on,
SGLang 0.5.23's plain server counts penalties one token late (docs/features.md);
DDTREE applies the exact counts.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re

import pytest
from serving import (
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
    reference_server,
    server_spec,
    stats_between,
    uses_reference,
    width1_spec,
)
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from transformers import AutoTokenizer

from lab.models.tiny import build_tiny_models

pytestmark = pytest.mark.server

GREEDY = {"max_new_tokens": 20, "temperature": 0.0}
SEEDED = {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "sampling_seed": 77}
REGEX = "[0-9]+( [a-z]+)*"
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
EBNF = 'root ::= "x" [0-9]+ "y"'
FEATURES = {
    "json": {"json_schema": JSON_SCHEMA},
    "regex": {"regex": REGEX},
    "ebnf": {"ebnf": EBNF},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": 1.5},
    "repetition": {"repetition_penalty": 1.75},
    "logit_bias": {"logit_bias": {"68": 6.0, "404": -20.0, "24": 4.0}},
}
# Requests whose drafter puts a token the grammar forbids at rank 0 at every depth.
INVALID_DECOY = ("regex", "json")
PLAIN_OPTIONS = ["--enable-deterministic-inference", "--enable-custom-logit-processor"]


def _request(tokenizer, name: str, prompt: str, params: dict, extra: dict | None = None) -> dict:
    # A per-feature prefix keeps every prompt distinct: the drafter keys on it.
    ids = tokenizer(f"{name}: {prompt}")["input_ids"]
    return {"input_ids": ids, "sampling_params": params, **(extra or {}), "_name": name}


def _feature_requests(tokenizer) -> list[dict]:
    requests = []
    for name, feature in FEATURES.items():
        for prompt in PROMPTS[:3]:
            requests.append(_request(tokenizer, name, prompt, {**GREEDY, **feature}))
    for prompt in PROMPTS[:2]:
        requests.append(_request(tokenizer, "none", prompt, dict(GREEDY)))
    requests.append(_request(tokenizer, "seeded-frequency", PROMPTS[1], {**SEEDED, "frequency_penalty": 1.0}))
    requests.append(_request(tokenizer, "seeded-regex", PROMPTS[2], {**SEEDED, "regex": REGEX}))
    return requests


def _dependent_requests(tokenizer, unconstrained: dict[str, list[int]]) -> list[dict]:
    """Features keyed on what the unconstrained model says: a stop token it emits
    early (held back by min_new_tokens) and tokens a custom processor forbids."""
    requests = []
    processor = DisallowedTokensLogitsProcessor.to_str()
    # One list for every request: the processor requires equal parameters per batch.
    forbidden = sorted({unconstrained[p][i] for p in PROMPTS[:3] for i in (1, 4)})
    for prompt in PROMPTS[:3]:
        params = {**GREEDY, "stop_token_ids": [unconstrained[prompt][2]], "min_new_tokens": 8}
        requests.append(_request(tokenizer, "min_new_tokens", prompt, params))
        params = {**GREEDY, "custom_params": {"token_ids": forbidden}}
        requests.append(_request(tokenizer, "custom", prompt, params, {"custom_logit_processor": processor}))
    return requests


def _send_all(server, requests) -> list[dict]:
    """All requests in flight at once: one mixed batch."""
    payloads = [{k: v for k, v in r.items() if k != "_name"} for r in requests]
    with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(server.generate, payloads))


def _oracle(requests, outputs, tokenizer):
    overrides = {}
    decoy = tokenizer("{")["input_ids"][0]  # no grammar under test allows it after its first token
    for index, request in enumerate(requests):
        if request["_name"] in INVALID_DECOY:
            overrides[str(index)] = {"ranks": [1], "decoy_token": decoy}
    continuations = [r["input_ids"] + out for r, out in zip(requests, outputs)]
    # Both servers read one script: the overlap server's (test_serving_tree.py adds its part).
    return add_to_script(deterministic_tree_script(), "features", continuations, overrides)


MODULE = "test_serving_features.py::"
TEST_OF = {
    "ddtree": (
        f"{MODULE}test_every_feature_is_token_identical_to_the_plain_server",
        f"{MODULE}test_accepted_paths_go_through_non_argmax_branches",
        f"{MODULE}test_grammar_output_is_valid_despite_invalid_rank0_proposals",
    ),
    "ddtree-sync": f"{MODULE}test_features_with_the_sync_scheduler",
    "ddtree-width1": f"{MODULE}test_features_and_stops_at_width_1_decode_like_the_plain_server",
}


@functools.cache
def feature_servers() -> dict[str, ServerSpec]:
    """Launched before the reference answers: the drafter's script is written from those
    answers before the first request. The overlap server is shared with the seeded-sampling
    test of test_serving_tree.py (serving.deterministic_tree_spec), the width-1 server with
    test_serving_greedy.py and test_serving_online_budget.py (serving.width1_spec)."""
    tiny, folder = build_tiny_models(), SHARED_SERVERS.folder("features")
    # Without overlap: the grammar advances in the result processor (no barrier) before every round.
    sync = ddtree_args(tiny, budget=16, extra=["--disable-overlap-schedule", *PLAIN_OPTIONS])
    return {
        "ddtree": deterministic_tree_spec(),
        "ddtree-sync": server_spec(sync, oracle_env(deterministic_tree_script()), "ddtree-sync", folder),
        "ddtree-width1": width1_spec(),
    }


SHARED_SERVERS.plan(feature_servers, TEST_OF)
uses_reference(MODULE)


@pytest.fixture(scope="module")
def reference(tiny, servers):
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    requests = _feature_requests(tokenizer)
    server = reference_server(servers, tiny)  # sync scheduler, PLAIN_OPTIONS
    unconstrained = {
        p: server.generate({"text": p, "sampling_params": GREEDY})["output_ids"] for p in PROMPTS[:3]
    }
    requests += _dependent_requests(tokenizer, unconstrained)
    results = _send_all(server, requests)
    outputs = [r["output_ids"] for r in results]
    return {
        "tokenizer": tokenizer,
        "requests": requests,
        "outputs": outputs,
        "texts": [r["text"] for r in results],
        "unconstrained": unconstrained,
        "oracle": _oracle(requests, outputs, tokenizer),
    }


@pytest.fixture(scope="module")
def tree_results(servers, reference):
    server = servers.get(feature_servers()["ddtree"])
    assert server.server_info()["disable_overlap_schedule"] is False
    info = server.server_info()["ddtree"]
    assert (info["budget"], info["stats_interval"]) == (24, 1)
    results = _send_all(server, reference["requests"])
    return results, server.log_path


def test_every_feature_is_token_identical_to_the_plain_server(reference, tree_results):
    results, _ = tree_results
    for request, want, got in zip(reference["requests"], reference["outputs"], results):
        assert got["output_ids"] == want, request["_name"]


def test_features_change_the_output(reference):
    """The reference itself exercises each feature: its outputs differ from the
    unconstrained ones (a feature that changed nothing would prove nothing)."""
    unconstrained = [reference["unconstrained"].get(p) for p in PROMPTS[:3]]
    for name in [*FEATURES, "min_new_tokens", "custom"]:
        outputs = [o for r, o in zip(reference["requests"], reference["outputs"]) if r["_name"] == name]
        assert any(out != base for out, base in zip(outputs, unconstrained)), name


def test_accepted_paths_go_through_non_argmax_branches(reference, tree_results):
    results, log = tree_results
    for request, result in zip(reference["requests"], results):
        if request["_name"] == "none":
            continue
        meta = result["meta_info"]
        # a chain accepts at most one draft (+ the bonus) per round under this script
        assert meta["completion_tokens"] < 6 or meta["spec_accept_length"] > 2.0, (request["_name"], meta)
    assert last_tree_stats(log)["non_argmax_share"] > 0.3


def test_grammar_output_is_valid_despite_invalid_rank0_proposals(reference, tree_results):
    results, _ = tree_results
    for request, result in zip(reference["requests"], results):
        text, finished = result["text"], result["meta_info"]["finish_reason"]["type"] == "stop"
        if request["_name"] == "regex":
            assert re.fullmatch("[0-9]+( [a-z]*)*", text), text  # every prefix of the language
            assert not finished or re.fullmatch(REGEX, text)
        if request["_name"] == "json" and finished:
            assert isinstance(json.loads(text)["a"], int)
        if request["_name"] == "ebnf":
            assert re.fullmatch("x[0-9]*y?", text), text


def test_features_with_the_sync_scheduler(servers, reference):
    """Without overlap: the grammar advances in the result processor (no barrier)
    before every round, and the features still hold token for token."""
    with servers.take(feature_servers()["ddtree-sync"]) as server:
        results = _send_all(server, reference["requests"])
    for request, want, got in zip(reference["requests"], reference["outputs"], results):
        assert got["output_ids"] == want, request["_name"]


def _stop_requests(tokenizer, plain) -> list[dict]:
    """Per prompt, two stop strings from the plain server's own text (the later one listed
    first) and a stop token id after them: the request ends at the earliest, as plain decoding
    ends it."""
    requests = []
    for prompt in PROMPTS[:3]:
        request = _request(tokenizer, "stop", prompt, dict(GREEDY))
        ids = plain.generate({"input_ids": request["input_ids"], "sampling_params": GREEDY})["output_ids"]
        later, earlier = tokenizer.decode(ids[9:11]), tokenizer.decode(ids[5:7])
        stops = [s for s in (later, earlier) if s.strip()]
        request["sampling_params"] |= {"stop": stops, "stop_token_ids": [ids[-1]]}
        requests.append(request)
    return requests


def test_features_and_stops_at_width_1_decode_like_the_plain_server(servers, reference):
    """Width 1 at every batch size: every step that does not draft (to predict) is a decoding
    step; every feature request, and the stop cases, answer as on the plain server."""
    plain = reference_server(servers, build_tiny_models())
    stops = _stop_requests(reference["tokenizer"], plain)
    plain_stops = _send_all(plain, stops)
    server = servers.get(feature_servers()["ddtree-width1"])
    before = last_tree_stats(server.log_path, required=False)
    results = _send_all(server, reference["requests"])
    stop_results = _send_all(server, stops)
    stats = last_tree_stats(server.log_path)
    ours = stats_between(before, stats)
    for request, want, got in zip(reference["requests"], reference["outputs"], results):
        assert got["output_ids"] == want, request["_name"]
    for request, want, got in zip(stops, plain_stops, stop_results):
        assert got["output_ids"] == want["output_ids"], request["sampling_params"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert all(w["meta_info"]["finish_reason"]["type"] == "stop" for w in plain_stops)
    check_width1_drafts_only_to_predict(server.log_path, stats)
    assert ours["decode_steps"] > 0, (ours, stats)  # these requests ran decoding steps
