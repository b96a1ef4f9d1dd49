"""Request features and sampling through DDTREE on the GPU: the float32 CUDA-graph arm against
the plain float32 server without overlap (which counts penalties as plain decoding does:
docs/features.md).

* Greedy requests with penalties, ``min_new_tokens``, ``logit_bias``, a custom logit processor,
  regex / JSON-schema / EBNF grammars, stop strings in both list orders (one spanning tokens),
  stop token ids, log-probs with top log-probs, and n>1, each token-identical to plain, at bs 1
  and in mixed batches of up to the captured graph size; a float32 difference passes only as a
  tie (the suite's rule, the features adjusting both tokens alike) and is recorded.
* Sampling at temperature 1: the joint distribution of the first two sampled tokens, and of the
  two tokens after the most frequent first one (the first two a tree round emits), against
  plain's own log-probs by a chi-square goodness-of-fit at p = 0.001.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from collections import Counter

import pytest

from .arms import GRAPH_MAX_BS, PAIR, heldout_prompts, top2_logprobs
from .features import (
    DISALLOWED_TOKENS,
    FEATURE_PROMPTS,
    FEATURE_TOKENS,
    FEATURES,
    GRAMMARS,
    LOGPROB_TOL,
    MIN_EXPECTED,
    P_VALUE,
    batches,
    chi_square_sf,
    choices,
    feature_requests,
    finished_on_stop,
    forward_logprobs,
    goodness_of_fit,
    grammar_holds,
    greedy_draft_statistic,
    joint_cells,
    judge,
    logprob_differences,
    next_token_probabilities,
)

pytestmark = pytest.mark.gpu_server

ARM = "ddtree_fp32_graphs"
REFERENCE = "plain_fp32_sync"
MODES = ("bs1", "batched")

# Held-out prompt 23 ends in "max_size: int": " =" follows with p ~ 0.64 and the default value
# after it is spread over many tokens, and so is the token after that; 2400 samples give ~30 cells
# of at least 5 expected samples for each check.
SAMPLING_PROMPT = 23
SAMPLES, SAMPLES_PER_REQUEST = 2400, 16  # n=16: one batch of the captured graph size
SAMPLED_TOKENS = 3
REFERENCE_TOP = 32  # the reference's top log-probs per position; the rest cell holds the others
MIN_CELLS = 10


def _servers(fleet):
    """The DDTREE arm and its reference; skipped where GPU_SERVER_ARMS left either out (a server
    that failed to start fails the test: ``Fleet``)."""
    return fleet[ARM], fleet[REFERENCE]


def _answer(server, payload):
    """The server's answer, or the error in its place (each request is judged on its own)."""
    try:
        return server.generate(payload)
    except Exception as error:  # noqa: BLE001 - recorded and failed by the request's own test
        return error


def _eos() -> int:
    return int(json.loads((PAIR / "target" / "config.json").read_text())["eos_token_id"])


@pytest.fixture(scope="module")
def features(fleet):
    """Plain's answer to every feature request, one at a time."""
    _, plain = _servers(fleet)
    heldout = heldout_prompts(max(FEATURE_PROMPTS) + 1)
    prompts = {i: heldout[i] for i in FEATURE_PROMPTS}
    params = {"max_new_tokens": FEATURE_TOKENS, "temperature": 0.0, "ignore_eos": True}
    unconstrained, texts = {}, {}
    for i, prompt in prompts.items():
        answer = plain.generate(
            {
                "input_ids": prompt,
                "sampling_params": params,
                "return_logprob": True,
                "return_text_in_logprobs": True,
            }
        )
        unconstrained[i] = answer["output_ids"]
        texts[i] = [entry[2] for entry in answer["meta_info"]["output_token_logprobs"]]
    requests = feature_requests(prompts, unconstrained, texts, DISALLOWED_TOKENS)
    return {
        "requests": requests,
        "want": [_answer(plain, r.payload(n=1)) for r in requests],
        "unconstrained": unconstrained,
        "prompts": prompts,
        "top2": lambda prompt, output: top2_logprobs(plain, prompt, output),
    }


@pytest.fixture(scope="module")
def answers_bs1(fleet, features):
    ddtree, _ = _servers(fleet)
    return [_answer(ddtree, r.payload()) for r in features["requests"]]


@pytest.fixture(scope="module")
def answers_batched(fleet, features):
    """Every batch's requests in flight at once; batches of at most GRAPH_MAX_BS sequences
    stay on the captured graphs."""
    ddtree, _ = _servers(fleet)
    requests = features["requests"]
    answers = [None] * len(requests)
    for batch in batches(requests, GRAPH_MAX_BS):
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            for i, answer in zip(batch, pool.map(lambda i: _answer(ddtree, requests[i].payload()), batch)):
                answers[i] = answer
    return answers


def _judged(features, answers, feature):
    verdicts = []
    for i, request in enumerate(features["requests"]):
        if request.feature == feature:
            want = features["want"][i]
            for got in choices(request, answers[i]):
                verdicts.append(judge(request, want, got, features["top2"], _eos()))
    return verdicts


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", FEATURES)
def test_fp32_feature_identical_to_plain(request, features, results, feature, mode):
    """Each answer (each choice of n>1) equals plain's: tokens, finish reason, text."""
    verdicts = _judged(features, request.getfixturevalue(f"answers_{mode}"), feature)
    defects = {i: v for i, v in enumerate(verdicts) if not v["ok"]}
    results[f"{ARM}/features/{mode}/{feature}"] = {
        "requests": len(verdicts),
        "first_difference": [v.get("first_difference") for v in verdicts],
        "finish_reason": [v.get("finish_reason") for v in verdicts],
        "identical": not defects,
        "at_difference": defects,
        "float32_ties": {i: v["tie"] for i, v in enumerate(verdicts) if "tie" in v},
    }
    assert verdicts, feature
    assert not defects, defects


@pytest.mark.parametrize("mode", MODES)
def test_fp32_logprobs_match_plain(request, fleet, features, results, mode):
    """The emitted tokens' log-probs and the top log-probs equal plain's decode, up to the first
    difference (a float32 tie ends the comparison, as for the tokens), within what plain's own
    two kernel paths differ by: its decode against its full forward of the same tokens (on the
    H200 the prefill and verify kernels round float32 attention differently from the decode
    kernel by a few 1e-3 nats), twice that, and never less than LOGPROB_TOL."""
    answers = request.getfixturevalue(f"answers_{mode}")
    _, plain = _servers(fleet)
    checks = []
    for i, req in enumerate(features["requests"]):
        if "return_logprob" not in req.extra:
            continue
        want, got = features["want"][i], answers[i]
        verdict = judge(req, want, got, features["top2"], _eos())
        if isinstance(want, Exception) or isinstance(got, Exception):
            checks.append({"ok": False, "error": verdict["defect"]})
            continue
        upto = verdict["first_difference"]
        upto = len(got["output_ids"]) if upto is None else upto
        top = int(req.extra.get("top_logprobs_num", 0))
        forward = forward_logprobs(plain, req.prompt, want["output_ids"][:upto], top)
        spread = logprob_differences(want["meta_info"], forward, upto, tol=math.inf)["max_abs_difference"]
        tol = max(LOGPROB_TOL, 2 * spread)
        check = logprob_differences(want["meta_info"], got["meta_info"], upto, tol=tol)
        checks.append({**check, "compared": upto, "plain_decode_vs_forward": spread, "tolerance": tol})
    results[f"{ARM}/features/{mode}/logprob_values"] = checks
    assert checks
    assert all(c["ok"] for c in checks), checks


def test_feature_requests_change_the_plain_output(features, results):
    """The reference exercises each feature: a stop request ends on a stop, every other feature
    changes plain's greedy output of its prompt on some request (a feature that changed nothing
    would prove nothing)."""
    changed: dict[str, list] = {}
    index = {tuple(prompt): i for i, prompt in features["prompts"].items()}
    for request, want in zip(features["requests"], features["want"]):
        assert not isinstance(want, Exception), (request.feature, want)
        if request.feature.startswith("stop"):
            mark = want["meta_info"]["finish_reason"]
        else:
            base = features["unconstrained"][index[tuple(request.prompt)]]
            mark = want["output_ids"] != base[: len(want["output_ids"])]
        changed.setdefault(request.feature, []).append(mark)
    results[f"{REFERENCE}/features_exercised"] = changed
    for feature, marks in changed.items():
        if feature in ("none", "logprobs", "n"):
            continue
        if feature.startswith("stop"):
            assert any(m.get("type") == "stop" for m in marks), (feature, marks)
        else:
            assert any(marks), feature
    for request, want in zip(features["requests"], features["want"]):
        if request.feature in GRAMMARS:
            assert grammar_holds(request.feature, want["text"], finished_on_stop(want)), want["text"]


def test_features_ran_in_the_tree_rounds(fleet, answers_batched):
    """The DDTREE arm applied the features inside its rounds (each logs once when it first runs)."""
    log = fleet.log_text(ARM)
    for what in (
        "exact per-path penalties are computed after the verify forward",
        "per-node grammar masks are built on the host each round",
        "custom logit processors run on the host for every tree slot",
    ):
        assert f"DDTREE request features: {what}" in log, what


# --- sampling at temperature 1 ----------------------------------------------------------------


def _next_tokens(server, ids: list[int]) -> dict[int, float]:
    """The reference's next-token distribution after ``ids`` (its REFERENCE_TOP most likely)."""
    answer = server.generate(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": REFERENCE_TOP,
        }
    )
    return next_token_probabilities(answer["meta_info"]["output_top_logprobs"][0])


@pytest.fixture(scope="module")
def samples(fleet):
    """SAMPLES answers of SAMPLED_TOKENS tokens at temperature 1 from the DDTREE arm, no seeds:
    the first token comes from the prefill's sampler, the next from the tree rounds (one target
    sample per tree slot, the accepted path walked through them)."""
    ddtree, _ = _servers(fleet)
    prompt = heldout_prompts(SAMPLING_PROMPT + 1)[SAMPLING_PROMPT]
    params = {"n": SAMPLES_PER_REQUEST, "temperature": 1.0, "max_new_tokens": SAMPLED_TOKENS}
    outputs, accept = [], []
    for _ in range(SAMPLES // SAMPLES_PER_REQUEST):
        answers = ddtree.generate({"input_ids": prompt, "sampling_params": {**params, "ignore_eos": True}})
        outputs += [a["output_ids"] for a in answers]
        accept += [a["meta_info"].get("spec_accept_length") for a in answers]
    assert all(len(o) == SAMPLED_TOKENS for o in outputs), Counter(len(o) for o in outputs)
    return {"prompt": prompt, "outputs": outputs, "accept_lengths": accept}


def _fit(pairs, first, second, total) -> dict:
    cells = joint_cells(total, first, second)
    fit = goodness_of_fit(pairs, cells)
    greedy_statistic = greedy_draft_statistic(total, first, second, cells)
    return {
        **fit,
        "greedy_draft_statistic": greedy_statistic,
        "greedy_draft_p_value": chi_square_sf(greedy_statistic, fit["df"]),
    }


def _assert_fit(fit: dict) -> None:
    assert fit["cells"] >= MIN_CELLS, fit  # enough cells to tell distributions apart
    assert fit["greedy_draft_p_value"] < P_VALUE, fit  # a sampler taking the greedy draft fails it
    assert fit["p_value"] >= P_VALUE, fit


def test_sampling_first_two_tokens_follow_plain(fleet, samples, results):
    """(t1, t2) ~ P(t1) P(t2 | t1) by plain's log-probs: t2 is the first token of the first
    tree round, the target's sample at the root."""
    _, plain = _servers(fleet)
    prompt, outputs = samples["prompt"], samples["outputs"]
    total = len(outputs)
    first = _next_tokens(plain, prompt)
    second = {a: _next_tokens(plain, prompt + [a]) for a, p in first.items() if total * p >= MIN_EXPECTED}
    fit = _fit([(o[0], o[1]) for o in outputs], first, second, total)
    accept = [a for a in samples["accept_lengths"] if a is not None]
    fit["mean_spec_accept_length"] = sum(accept) / len(accept) if accept else None
    results[f"{ARM}/sampling/first_two_tokens"] = fit
    _assert_fit(fit)


def test_sampling_in_a_tree_round_follows_plain(fleet, samples, results):
    """Given the most frequent first token a: (t2, t3) ~ P(t2 | a) P(t3 | a, t2). Both come from
    the first tree round where it accepts a child of the root (t3 the sample at that child), else
    t3 from the next round: the walk through the per-slot samples must keep the target's joint."""
    _, plain = _servers(fleet)
    prompt, outputs = samples["prompt"], samples["outputs"]
    a = Counter(o[0] for o in outputs).most_common(1)[0][0]
    pairs = [(o[1], o[2]) for o in outputs if o[0] == a]
    total = len(pairs)
    first = _next_tokens(plain, prompt + [a])
    second = {b: _next_tokens(plain, prompt + [a, b]) for b, p in first.items() if total * p >= MIN_EXPECTED}
    fit = {**_fit(pairs, first, second, total), "first_token": a}
    results[f"{ARM}/sampling/tree_round_after_first_token"] = fit
    _assert_fit(fit)
