"""The GPU suite's request-feature and sampling checks (tests/gpu_server/features.py), on the CPU:
the feature requests and their batches, the comparison with plain under the float32 tie rule,
the log-prob comparison, and the chi-square goodness-of-fit of sampled token pairs, which an
exact sampler passes and a sampler that takes the greedy draft fails."""

from __future__ import annotations

import random

import pytest
from gpu_server.arms import FP32_TIE
from gpu_server.features import (
    CHOICES,
    DISALLOWED_TOKENS,
    FEATURES,
    MIN_EXPECTED,
    P_VALUE,
    FeatureRequest,
    batches,
    chi_square_sf,
    choices,
    feature_requests,
    goodness_of_fit,
    grammar_holds,
    greedy_draft_statistic,
    joint_cells,
    judge,
    logprob_differences,
    same_adjustment,
    token_before,
)

EOS = 0

# --- the chi-square tail ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "statistic, df, p",
    [
        (3.841459, 1, 0.05),
        (10.827566, 1, 0.001),
        (37.697298, 15, 0.001),
        (63.870370, 33, 0.001),
        (100.887, 61, 0.001),
        (61.0, 61, 0.4757),  # the median lies just below the mean
        (2.0, 30, 1.0),
    ],
)
def test_chi_square_tail_matches_the_tables(statistic, df, p):
    assert chi_square_sf(statistic, df) == pytest.approx(p, rel=1e-3, abs=1e-9)


def test_chi_square_tail_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 17, 33, 60, 61, 150):
        for statistic in (0.01, 0.5, df / 2, df - 1, df, df + 3, 2 * df, 5 * df + 40):
            assert chi_square_sf(statistic, df) == pytest.approx(
                stats.chi2.sf(statistic, df), rel=1e-7, abs=1e-15
            )
    assert chi_square_sf(0.0, 7) == 1.0


# --- the sampling check, simulated ------------------------------------------------------------

VOCAB, SAMPLES = 60, 2400


def _dirichlet(rng: random.Random, alpha: float) -> dict[int, float]:
    draws = [rng.gammavariate(alpha, 1.0) for _ in range(VOCAB)]
    return {t: d / sum(draws) for t, d in enumerate(draws)}


def _model(seed: int):
    """A target over VOCAB tokens: P(t1), and P(t2 | t1) different after every t1."""
    rng = random.Random(seed)
    return _dirichlet(rng, 0.3), {a: _dirichlet(rng, 0.3) for a in range(VOCAB)}


def _top(p: dict[int, float], k: int = 32) -> dict[int, float]:
    """What the server's top log-probs give: the k most likely tokens."""
    return dict(sorted(p.items(), key=lambda kv: -kv[1])[:k])


def _draw(rng: random.Random, p: dict[int, float]) -> int:
    return rng.choices(list(p), weights=list(p.values()))[0]


def _samples(first, second, rng, greedy_share: float = 0.0) -> list[tuple[int, int]]:
    """t1 sampled; t2 sampled, or (a ``greedy_share`` of the time) the greedy draft: the
    target's most likely token after t1."""
    pairs = []
    for _ in range(SAMPLES):
        a = _draw(rng, first)
        b = max(second[a], key=second[a].get) if rng.random() < greedy_share else _draw(rng, second[a])
        pairs.append((a, b))
    return pairs


def _fit(pairs, first, second):
    first_top = _top(first)
    second_top = {a: _top(second[a]) for a, p in first_top.items() if SAMPLES * p >= MIN_EXPECTED}
    cells = joint_cells(SAMPLES, first_top, second_top)
    fit = goodness_of_fit(pairs, cells)
    return fit, greedy_draft_statistic(SAMPLES, first_top, second_top, cells)


@pytest.mark.parametrize("seed", range(5))
def test_an_exact_sampler_passes_and_the_greedy_draft_fails(seed):
    first, second = _model(seed)
    rng = random.Random(100 + seed)
    exact, greedy_expected = _fit(_samples(first, second, rng), first, second)
    greedy, _ = _fit(_samples(first, second, rng, greedy_share=1.0), first, second)
    assert exact["cells"] >= 10
    assert exact["p_value"] >= P_VALUE, exact
    assert greedy["p_value"] < 1e-12, greedy
    # the expected statistic of the greedy draft (what the GPU test requires to fail) is what
    # greedy sampling scores, up to sampling noise
    assert chi_square_sf(greedy_expected, exact["df"]) < 1e-12
    assert greedy["statistic"] == pytest.approx(greedy_expected, rel=0.25)


def test_a_walk_that_takes_the_greedy_draft_a_third_of_the_time_fails():
    first, second = _model(7)
    fit, _ = _fit(_samples(first, second, random.Random(3), greedy_share=1 / 3), first, second)
    assert fit["p_value"] < P_VALUE, fit


def test_false_alarms_are_rare():
    """Under the target's own distribution the check fails about once in 1/P_VALUE runs: in 40
    seeded runs, never, and the p-values spread over (0, 1)."""
    first, second = _model(11)
    p_values = [
        _fit(_samples(first, second, random.Random(s)), first, second)[0]["p_value"] for s in range(40)
    ]
    assert min(p_values) >= P_VALUE
    assert sum(p < 0.5 for p in p_values) in range(8, 33)


def test_joint_cells_keep_every_expected_count_above_the_floor():
    first, second = _model(2)
    for total in (1000, 2400):
        cells = joint_cells(total, first, second)
        assert cells and all(total * p >= MIN_EXPECTED for p in cells.values())
        assert total * (1 - sum(cells.values())) >= MIN_EXPECTED
    # a distribution the cells cover entirely gives the rest cell up to its floor
    cells = joint_cells(1000, {1: 1.0}, {1: {2: 0.5, 3: 0.5}})
    assert 1000 * (1 - sum(cells.values())) >= MIN_EXPECTED and len(cells) == 1


# --- the feature requests ---------------------------------------------------------------------


def _requests():
    prompts = {i: [100 + i] * 4 for i in (0, 1, 2, 3, 4, 5, 6, 7, 10, 14, 42)}
    unconstrained = {i: [1000 * (i + 1) + j for j in range(48)] for i in prompts}
    texts = {i: ["x"] * 48 for i in prompts}
    texts[5] = ["a", "b", "c", "d", "e", "]:", "\n   ", " return", *["x"] * 40]
    return feature_requests(prompts, unconstrained, texts, "processor"), unconstrained


def test_every_feature_is_requested():
    requests, u = _requests()
    assert {r.feature for r in requests} == set(FEATURES)
    assert sum(r.n for r in requests) > 16  # two batches: more than one graph's worth
    by_feature = {}
    for r in requests:
        by_feature.setdefault(r.feature, []).append(r)
    assert by_feature["n"][0].n == CHOICES and by_feature["n"][0].payload(n=1)["sampling_params"]["n"] == 1
    # the stop id sits just before ":\n" completes (token 6 of prompt 5's text)
    ids = [r.params["stop_token_ids"] for r in by_feature["stop_string_and_token_id"]]
    assert ids[0] == [u[5][5]] and ids[1] == [u[42][5]]  # no ":\n" in 42's text here: the default
    assert all(r.params["temperature"] == 0.0 for r in requests)
    assert all(r.extra["custom_logit_processor"] == "processor" for r in by_feature["custom_logit_processor"])
    custom = [r.params["custom_params"] for r in by_feature["custom_logit_processor"]]
    assert custom[0] == custom[1]  # the processor requires one list per batch


def test_batches_hold_every_request_once_and_mix_features():
    requests, _ = _requests()
    packed = batches(requests, 16)
    assert sorted(i for batch in packed for i in batch) == list(range(len(requests)))
    assert all(sum(requests[i].n for i in batch) <= 16 for batch in packed)
    assert len({requests[i].feature for i in packed[0]}) >= 12


def test_token_before():
    assert token_before(["a", "):", "\n   ", " return"], ":\n", 9) == 1
    assert token_before(["a:\n"], ":\n", 9) == 0
    assert token_before(["a", "b"], ":\n", 9) == 9


# --- the comparison with plain ----------------------------------------------------------------


def _answer(ids, finish=None, text="t"):
    return {"output_ids": ids, "text": text, "meta_info": {"finish_reason": finish or {"type": "length"}}}


def _top2(rows):
    return lambda prompt, output: rows


def test_same_adjustment():
    assert same_adjustment({}, [], 5, 6, EOS)
    assert not same_adjustment({"logit_bias": {"5": 1.0}}, [], 5, 6, EOS)
    assert same_adjustment({"logit_bias": {"5": 1.0, "6": 1.0}}, [], 5, 6, EOS)
    assert not same_adjustment({"frequency_penalty": 1.5}, [5], 5, 6, EOS)
    assert same_adjustment({"frequency_penalty": 1.5}, [5, 6], 5, 6, EOS)
    assert not same_adjustment({"repetition_penalty": 1.2}, [6], 5, 6, EOS)
    assert not same_adjustment({"min_new_tokens": 4, "stop_token_ids": [6]}, [1], 5, 6, EOS)
    assert same_adjustment({"min_new_tokens": 4, "stop_token_ids": [6]}, [1, 2, 3, 4], 5, 6, EOS)
    assert not same_adjustment({"min_new_tokens": 4}, [1], EOS, 6, EOS)
    assert not same_adjustment({"custom_params": {"token_ids": [5]}}, [], 5, 6, EOS)


def test_judge():
    request = FeatureRequest("logit_bias", [1, 2], {"logit_bias": {"9": 2.0}})
    tie = [(-1.0, [(-1.0, 7), (-1.0 - FP32_TIE / 2, 8)])] * 3
    want = _answer([3, 4, 7])
    assert judge(request, want, _answer([3, 4, 7]), _top2(tie), EOS)["ok"]
    tied = judge(request, want, _answer([3, 4, 8, 1]), _top2(tie), EOS)
    assert tied["ok"] and tied["tie"]["index"] == 2
    gap = [(-1.0, [(-1.0, 7), (-1.0 - 2 * FP32_TIE, 8)])] * 3
    assert not judge(request, want, _answer([3, 4, 8]), _top2(gap), EOS)["ok"]
    biased = FeatureRequest("logit_bias", [1, 2], {"logit_bias": {"8": 2.0}})
    assert not judge(biased, want, _answer([3, 4, 8]), _top2(tie), EOS)["ok"]
    # ended one token late, or with another finish reason or text: defects
    stop = {"type": "stop", "matched": ":\n"}
    assert not judge(request, _answer([3, 4], stop), _answer([3, 4, 7], stop), _top2(tie), EOS)["ok"]
    assert not judge(request, _answer([3, 4], stop), _answer([3, 4]), _top2(tie), EOS)["ok"]
    assert not judge(request, want, _answer([3, 4, 7], text="u"), _top2(tie), EOS)["ok"]
    assert not judge(request, want, OSError("refused"), _top2(tie), EOS)["ok"]
    assert not judge(request, OSError("refused"), want, _top2(tie), EOS)["ok"]
    # a grammar request's tie holds only inside the grammar
    regex = FeatureRequest("regex", [1, 2], {})
    assert judge(regex, _answer([3, 4, 7], text="12 ab"), _answer([3, 4, 8], text="12 a"), _top2(tie), EOS)[
        "ok"
    ]
    assert not judge(regex, _answer([3, 4, 7], text="12"), _answer([3, 4, 8], text="12{"), _top2(tie), EOS)[
        "ok"
    ]


def test_choices():
    request = FeatureRequest("n", [1], {"n": 3})
    answers = [_answer([1])] * 3
    assert choices(request, answers) == answers
    assert all(isinstance(c, ValueError) for c in choices(request, answers[:2]))
    error = OSError("x")
    assert choices(request, error) == [error] * 3
    assert choices(FeatureRequest("none", [1], {}), answers[0]) == [answers[0]]


def _meta(logprobs, tops):
    return {
        "output_token_logprobs": [[lp, t, None] for lp, t in logprobs],
        "output_top_logprobs": [[[lp, t, None] for lp, t in top] for top in tops],
    }


def test_logprob_differences():
    want = _meta([(-0.5, 1), (-1.0, 2)], [[(-0.5, 1), (-1.2, 3)], [(-1.0, 2), (-2.0, 4)]])
    close = _meta([(-0.5001, 1), (-1.0, 2)], [[(-0.5001, 1), (-1.2, 3)], [(-1.0, 2), (-2.0, 4)]])
    check = logprob_differences(want, close, 2)
    assert check["ok"] and check["max_abs_difference"] == pytest.approx(1e-4)
    far = _meta([(-0.51, 1), (-1.0, 2)], [[(-0.51, 1), (-1.2, 3)], [(-1.0, 2), (-2.0, 4)]])
    assert not logprob_differences(want, far, 2)["ok"]
    assert logprob_differences(want, far, 0)["ok"]
    # the last entries swapped at a near-tie: within the tolerance of the other list's last entry
    swapped = _meta([(-0.5, 1), (-1.0, 2)], [[(-0.5, 1), (-1.2001, 5)], [(-1.0, 2), (-2.0, 4)]])
    assert logprob_differences(want, swapped, 2)["ok"]
    other = _meta([(-0.5, 1), (-1.0, 2)], [[(-0.5, 1), (-1.1, 5)], [(-1.0, 2), (-2.0, 4)]])
    assert not logprob_differences(want, other, 2)["ok"]
    assert not logprob_differences(want, _meta([(-0.5, 1)], [[(-0.5, 1), (-1.2, 3)]]), 2)["ok"]


def test_grammar_holds():
    assert grammar_holds("regex", "12 ab c", True) and grammar_holds("regex", "12 ", False)
    assert not grammar_holds("regex", "12 ", True) and not grammar_holds("regex", "a1", False)
    assert grammar_holds("json_schema", '{"a": 3}', True) and grammar_holds("json_schema", '{"a', False)
    assert not grammar_holds("json_schema", '{"a": "3"}', True)
    assert grammar_holds("ebnf", "x12y", True) and grammar_holds("ebnf", "x1", False)
    assert not grammar_holds("ebnf", "x1", True) and not grammar_holds("ebnf", "y", False)
    assert grammar_holds("none", "anything", True)


def test_the_processor_string_is_sglangs():
    """The suite's processor string loads as SGLang's own class, as ``to_str()``'s would."""
    from sglang.srt.sampling.custom_logit_processor import (
        CustomLogitProcessor,
        DisallowedTokensLogitsProcessor,
    )

    assert isinstance(CustomLogitProcessor.from_str(DISALLOWED_TOKENS), DisallowedTokensLogitsProcessor)
