"""Request features and sampling through the GPU suite's servers (test_gpu_features.py): the
feature requests, their comparison with the plain float32 server under the suite's float32 tie
rule, the log-prob comparison, and the chi-square goodness-of-fit of sampled tokens against the
plain server's own distribution. Pure functions, tested on the CPU
(tests/test_gpu_feature_checks.py)."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .arms import FP32_TIE, first_difference, is_float32_tie

FEATURE_TOKENS = 48
REGEX = "[0-9]+( [a-z]+)*"
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
EBNF = 'root ::= "x" [0-9]+ "y"'
# On this pair's tokenizer " return" is one token and ":\n" spans two ("):" then "\n   "), so a
# round that accepts "):", "\n   ", " return" holds both. SGLang's one call per round walks the
# stop strings in list order: with "return" listed first it ended such a round at " return",
# one token late (sglang_ddtree/adapter/stops.py). Both orders are served.
STOPS_RETURN_FIRST = ["return", ":\n"]
STOPS_NEWLINE_FIRST = [":\n", "return"]
# SGLang's ``DisallowedTokensLogitsProcessor.to_str()`` without importing SGLang into the test
# process (thousands of modules): the class pickled by reference, which the server's dill loads.
DISALLOWED_TOKENS = json.dumps(
    {
        "callable": b"\x80\x02csglang.srt.sampling.custom_logit_processor\nDisallowedTokensLogitsProcessor\n.".hex()
    }
)
MIN_NEW_TOKENS = 10
TOP_LOGPROBS = 5
CHOICES = 3  # n of the n>1 request
# A log-prob is compared within the tie rule's float32 allowance: the plain decode and the tree
# verify round the same logits differently by up to ~1e-4 nats (the tie seen at 27ce76a was
# 5.2e-5); a wrong prefix, a stale KV entry or a missed adjustment moves log-probs by far more.
LOGPROB_TOL = FP32_TIE

FEATURES = (
    "none",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "logit_bias",
    "custom_logit_processor",
    "regex",
    "json_schema",
    "ebnf",
    "stop_return_first",
    "stop_newline_first",
    "stop_token_ids",
    "stop_string_and_token_id",
    "logprobs",
    "n",
)
GRAMMARS = ("regex", "json_schema", "ebnf")


@dataclass
class FeatureRequest:
    feature: str
    prompt: list[int]
    params: dict  # sampling parameters
    extra: dict = field(default_factory=dict)  # return_logprob, custom_logit_processor, ...

    @property
    def n(self) -> int:
        return int(self.params.get("n", 1))

    def payload(self, n: int | None = None) -> dict:
        """The ``/generate`` body; ``n=1``: one choice (the plain reference of an n>1 request)."""
        params = dict(self.params)
        if n is not None:
            params["n"] = n
        return {"input_ids": self.prompt, "sampling_params": params, **self.extra}


def _distinct(tokens: list[int], start: int, avoid: int) -> int:
    return next(t for t in tokens[start:] + tokens if t != avoid)


def token_before(texts: list[str], stop: str, default: int) -> int:
    """The index of the token before the one that completes ``stop`` in the text of ``texts``
    (one entry per token): a stop token id there ends the request one token before the stop
    string would."""
    text = ""
    for k, piece in enumerate(texts):
        text += piece
        if stop in text:
            return max(k - 1, 0)
    return default


# Held-out prompts whose greedy continuation (48 tokens, the CPU's float32) holds ":\n" with
# " return" in the next token (5, 42), ":\n" then "return" 19 tokens later (10), "return" alone
# (14): the stop requests end in different ways and at the case that used to end late.
STOP_PROMPTS = {"stop_return_first": (5, 42, 10), "stop_newline_first": (5, 42, 14)}
STOPS = {"stop_return_first": STOPS_RETURN_FIRST, "stop_newline_first": STOPS_NEWLINE_FIRST}
FEATURE_PROMPTS = (0, 1, 2, 3, 4, 5, 6, 7, 10, 14, 42)  # the held-out prompts the requests use


def feature_requests(
    prompts: dict[int, list[int]],
    unconstrained: dict[int, list[int]],
    texts: dict[int, list[str]],
    processor: str,
) -> list[FeatureRequest]:
    """Every feature of ``FEATURES`` on the held-out prompts ``FEATURE_PROMPTS`` (by index).
    ``unconstrained``: plain's greedy output of each (``FEATURE_TOKENS``, EOS ignored) and
    ``texts`` its tokens' texts, for the features keyed on what the model says: a stop token it
    emits early (held back by ``min_new_tokens``, or ending the request just before a stop
    string), tokens a bias or a custom processor pushes away."""
    u = unconstrained
    greedy = {"max_new_tokens": FEATURE_TOKENS, "temperature": 0.0}
    # One list for every request: the processor requires equal parameters across a batch.
    forbidden = sorted({u[i][j] for i in (4, 5) for j in (1, 4)})
    custom = {"custom_logit_processor": processor}
    logprobs = {"return_logprob": True, "top_logprobs_num": TOP_LOGPROBS}

    def bias(i: int) -> dict:
        return {"logit_bias": {str(u[i][3]): -100.0, str(_distinct(u[i], 9, u[i][3])): 4.0}}

    def stop_and_id(i: int, stops: list[str]) -> dict:
        return {"stop": stops, "stop_token_ids": [u[i][token_before(texts[i], ":\n", 5)]]}

    spec = [
        ("none", 0, {}, {}),
        ("frequency_penalty", 1, {"frequency_penalty": 1.5}, {}),
        ("frequency_penalty", 2, {"frequency_penalty": 1.5}, {}),
        ("presence_penalty", 3, {"presence_penalty": 1.5}, {}),
        ("repetition_penalty", 4, {"repetition_penalty": 1.75}, {}),
        ("repetition_penalty", 5, {"repetition_penalty": 1.75}, {}),
        ("min_new_tokens", 1, {"stop_token_ids": [u[1][2]], "min_new_tokens": MIN_NEW_TOKENS}, {}),
        ("min_new_tokens", 6, {"stop_token_ids": [u[6][2]], "min_new_tokens": MIN_NEW_TOKENS}, {}),
        ("logit_bias", 2, bias(2), {}),
        ("logit_bias", 7, bias(7), {}),
        ("custom_logit_processor", 4, {"custom_params": {"token_ids": forbidden}}, custom),
        ("custom_logit_processor", 5, {"custom_params": {"token_ids": forbidden}}, custom),
        ("regex", 6, {"regex": REGEX}, {}),
        ("json_schema", 7, {"json_schema": JSON_SCHEMA}, {}),
        ("ebnf", 0, {"ebnf": EBNF}, {}),
        *[(name, i, {"stop": STOPS[name]}, {}) for name, ids in STOP_PROMPTS.items() for i in ids],
        ("stop_token_ids", 3, {"stop_token_ids": [u[3][9]]}, {}),
        ("stop_token_ids", 4, {"stop_token_ids": [u[4][9]]}, {}),
        # a stop token id just before ":\n" completes: plain ends on the id, one token earlier
        ("stop_string_and_token_id", 5, stop_and_id(5, STOPS_RETURN_FIRST), {}),
        ("stop_string_and_token_id", 42, stop_and_id(42, STOPS_NEWLINE_FIRST), {}),
        ("logprobs", 1, {}, logprobs),
        ("logprobs", 6, {}, logprobs),
        ("n", 7, {"n": CHOICES}, {}),
    ]
    return [FeatureRequest(name, prompts[i], {**greedy, **params}, extra) for name, i, params, extra in spec]


def batches(requests: list[FeatureRequest], limit: int) -> list[list[int]]:
    """Indices of ``requests`` in batches of at most ``limit`` sequences (an n>1 request counts
    n), the features mixed: taken round-robin over the features."""
    by_feature: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_feature.setdefault(r.feature, []).append(i)
    order = [i for group in itertools.zip_longest(*by_feature.values()) for i in group if i is not None]
    out: list[list[int]] = [[]]
    size = 0
    for i in order:
        if out[-1] and size + requests[i].n > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += requests[i].n
    return out


def same_adjustment(params: dict, prefix: list[int], expected: int, got: int, eos: int) -> bool:
    """Whether the request's features move the logits of ``expected`` and ``got`` alike after
    ``prefix`` (the output before them): then their gap is the raw forward's, and the tie rule
    read from the raw forward holds for the adjusted logits too. Penalties follow each token's
    count in the output, the bias its own entry, ``min_new_tokens`` and the custom processor ban
    their tokens. A grammar's mask keeps the gap of two tokens it allows (a grammar
    request's tie also needs its answer in the language: :func:`judge`)."""
    pair = {expected, got}
    bias = params.get("logit_bias") or {}
    if float(bias.get(str(expected), 0.0)) != float(bias.get(str(got), 0.0)):
        return False
    penalised = (
        params.get("frequency_penalty", 0.0) != 0.0
        or params.get("presence_penalty", 0.0) != 0.0
        or params.get("repetition_penalty", 1.0) != 1.0
    )
    if penalised and prefix.count(expected) != prefix.count(got):
        return False
    banned = {eos, *params.get("stop_token_ids", [])}
    if len(prefix) < params.get("min_new_tokens", 0) and pair & banned:
        return False
    return not pair & set((params.get("custom_params") or {}).get("token_ids", []))


def grammar_holds(feature: str, text: str, finished: bool) -> bool:
    """The answer of a grammar request is in its language (finished) or a prefix of it."""
    if feature == "regex":
        return bool(re.fullmatch("[0-9]+( [a-z]*)*", text)) and (
            not finished or bool(re.fullmatch(REGEX, text))
        )
    if feature == "json_schema":
        if not finished:
            return text.lstrip().startswith("{") or not text.strip()
        try:
            return isinstance(json.loads(text)["a"], int)
        except (ValueError, KeyError, TypeError):
            return False
    if feature == "ebnf":
        return bool(re.fullmatch("x[0-9]*y?", text)) and (not finished or text.endswith("y"))
    return True


def finished_on_stop(answer: dict) -> bool:
    return (answer["meta_info"].get("finish_reason") or {}).get("type") == "stop"


Top2 = Callable[[list[int], list[int]], list]  # (prompt, output) -> top2_logprobs rows


def judge(request: FeatureRequest, want, got, top2: Top2, eos: int) -> dict:
    """One answer (one choice) against plain's: identical tokens, finish reason and text; or a
    first difference that is a float32 tie (:func:`arms.is_float32_tie` on the reference's
    forward, the features adjusting both tokens alike: :func:`same_adjustment`; a grammar
    request's answer still in its language), which ends the comparison; anything else is a
    defect."""
    if isinstance(want, Exception):
        return {"ok": False, "defect": f"the plain request failed: {want!r}"}
    if isinstance(got, Exception):
        return {"ok": False, "defect": f"the request failed: {got!r}"}
    w, g = want["output_ids"], got["output_ids"]
    d = first_difference(g, w)
    verdict = {
        "first_difference": d,
        "tokens": len(g),
        "finish_reason": got["meta_info"].get("finish_reason"),
    }
    if d is None:
        ends = (want["meta_info"].get("finish_reason"), want["text"])
        if ends != (got["meta_info"].get("finish_reason"), got["text"]):
            return {**verdict, "ok": False, "defect": {"expected_end": ends, "got_text": got["text"]}}
        return {**verdict, "ok": True}
    if d >= len(w) or d >= len(g):  # one ended where the other went on
        return {
            **verdict,
            "ok": False,
            "defect": {"expected_tokens": len(w), "expected_finish": want["meta_info"].get("finish_reason")},
        }
    _, top = top2(request.prompt, w[: d + 1])[d]
    at = {"index": d, "expected": w[d], "got": g[d], "reference_top2": top}
    if not is_float32_tie(top, w[d], g[d]) or not same_adjustment(request.params, w[:d], w[d], g[d], eos):
        return {**verdict, "ok": False, "defect": at}
    if request.feature in GRAMMARS and not grammar_holds(request.feature, got["text"], finished_on_stop(got)):
        return {**verdict, "ok": False, "defect": {**at, "outside_the_grammar": got["text"]}}
    return {**verdict, "ok": True, "tie": at}


def choices(request: FeatureRequest, got) -> list:
    """An n>1 answer is a list of n answers; an error stands for each of them."""
    if isinstance(got, Exception) or request.n == 1:
        return [got] * request.n
    if not isinstance(got, list) or len(got) != request.n:
        return [ValueError(f"expected {request.n} choices, got {got!r:.200}")] * request.n
    return got


def logprob_differences(want_meta: dict, got_meta: dict, upto: int, tol: float = LOGPROB_TOL) -> dict:
    """Over the first ``upto`` output positions: the largest |difference| of the emitted
    tokens' log-probs and of the top log-probs both lists hold; a token in one top list only
    must lie within ``tol`` of the other list's last entry (the two lists cut a near-tie
    differently). ``ok`` when all of it is within ``tol``."""
    worst, problems = 0.0, []
    want_tokens, got_tokens = want_meta["output_token_logprobs"], got_meta["output_token_logprobs"]
    want_tops, got_tops = want_meta["output_top_logprobs"], got_meta["output_top_logprobs"]
    if min(len(want_tokens), len(got_tokens), len(want_tops), len(got_tops)) < upto:
        return {"ok": False, "max_abs_difference": None, "problems": ["fewer log-prob rows than tokens"]}
    for i in range(upto):
        worst = max(worst, abs(want_tokens[i][0] - got_tokens[i][0]))
        want_top = {entry[1]: entry[0] for entry in want_tops[i]}
        got_top = {entry[1]: entry[0] for entry in got_tops[i]}
        if len(want_top) != len(got_top):
            problems.append({"index": i, "top_sizes": [len(want_top), len(got_top)]})
        for token in want_top.keys() & got_top.keys():
            worst = max(worst, abs(want_top[token] - got_top[token]))
        for token in want_top.keys() ^ got_top.keys():
            mine, other = (want_top, got_top) if token in want_top else (got_top, want_top)
            if mine[token] - min(other.values()) > tol:
                problems.append({"index": i, "only_in_one_top": token, "logprob": mine[token]})
    return {"ok": worst <= tol and not problems, "max_abs_difference": worst, "problems": problems}


def forward_logprobs(reference, prompt: list[int], output: list[int], top: int) -> dict:
    """``reference``'s full forward (its prefill kernels) of ``prompt + output``: for every
    output token its log-prob and the ``top`` best, shaped as a decode's ``meta_info``."""
    meta = reference.generate(
        {
            "input_ids": prompt + output,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": top,
        }
    )["meta_info"]
    tokens = meta["input_token_logprobs"][len(meta["input_token_logprobs"]) - len(output) :]
    if [entry[1] for entry in tokens] != list(output):
        raise AssertionError("forward log-prob rows misaligned with the output tokens")
    tops = meta["input_top_logprobs"][len(meta["input_top_logprobs"]) - len(output) :]
    return {"output_token_logprobs": tokens, "output_top_logprobs": tops}


# --- sampling: a chi-square goodness-of-fit of sampled token pairs ---------------------------

REST = "rest"
MIN_EXPECTED = 5.0  # the chi-square approximation's usual floor for an expected cell count
P_VALUE = 1e-3


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square with ``df`` degrees of freedom: the regularized upper
    incomplete gamma Q(df/2, statistic/2), by its series below df/2 + 1 and Lentz's continued
    fraction above (Numerical Recipes 6.2); no SciPy on the device."""
    s, z = df / 2.0, statistic / 2.0
    if z <= 0.0:
        return 1.0
    log_prefix = s * math.log(z) - z - math.lgamma(s)
    if z < s + 1.0:
        term = total = 1.0 / s
        a = s
        for _ in range(100_000):
            a += 1.0
            term *= z / a
            total += term
            if term < total * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = z + 1.0 - s
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - s)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_prefix) * h)


def joint_cells(
    total: int,
    first: dict[int, float],
    second: dict[int, dict[int, float]],
    min_expected: float = MIN_EXPECTED,
) -> dict[tuple[int, int], float]:
    """The cells ``(a, b)`` of P(a) P(b | a) whose expected count in ``total`` samples reaches
    ``min_expected``; everything else falls in the rest cell, whose expected count must reach
    it too (the smallest cells join it until it does)."""
    cells = {
        (a, b): p * q
        for a, p in first.items()
        for b, q in second.get(a, {}).items()
        if total * p * q >= min_expected
    }
    while cells and total * (1.0 - sum(cells.values())) < min_expected:
        del cells[min(cells, key=cells.get)]
    return cells


def _statistic(observed: dict, total: float, cells: dict) -> tuple[float, int]:
    expected = {**{k: total * p for k, p in cells.items()}, REST: total * (1.0 - sum(cells.values()))}
    statistic = sum((observed.get(k, 0.0) - e) ** 2 / e for k, e in expected.items())
    return statistic, len(expected) - 1


def goodness_of_fit(pairs: list[tuple[int, int]], cells: dict[tuple[int, int], float]) -> dict:
    """The chi-square statistic of the observed ``pairs`` over ``cells`` and the rest cell."""
    observed = Counter(pair if pair in cells else REST for pair in pairs)
    statistic, df = _statistic(observed, len(pairs), cells)
    return {
        "samples": len(pairs),
        "cells": len(cells),
        "df": df,
        "statistic": statistic,
        "p_value": chi_square_sf(statistic, df),
        "rest_observed": observed.get(REST, 0),
        "rest_expected": len(pairs) * (1.0 - sum(cells.values())),
    }


def greedy_draft_statistic(
    total: int, first: dict[int, float], second: dict[int, dict[int, float]], cells: dict
) -> float:
    """The statistic a sampler that emits the greedy draft after each first token would score
    at these cells, in expectation (no sampling noise): every ``(a, .)`` sample lands on
    ``(a, argmax_b P(b | a))``: the target's most likely token, the one a drafter trained on the
    target proposes first, and the fixed choice whose own cell expects the most samples."""
    observed: Counter = Counter()
    for a, p in first.items():
        best = max(second[a], key=second[a].get) if second.get(a) else None
        observed[(a, best) if (a, best) in cells else REST] += total * p
    observed[REST] += total * max(0.0, 1.0 - sum(first.values()))  # first tokens past the top list
    return _statistic(observed, total, cells)[0]


def next_token_probabilities(top_logprobs: list) -> dict[int, float]:
    """``{token: probability}`` from one position's ``output_top_logprobs`` entries."""
    return {int(entry[1]): math.exp(entry[0]) for entry in top_logprobs}
