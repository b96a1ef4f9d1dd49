"""Where a round's accepted tokens end a request: exactly where one token a step would.

SGLang's own ``Req`` and stop checks on the tiny tokenizer, no server: a request is
fed its tokens one at a time (plain decoding) and, again, a round of several at once
through the plugin's hook (adapter/stops.py). Finish reason, ``finished_len`` and
what is kept must agree for stop strings that span token boundaries, several stop
strings in both orders, a stop regex, and a stop string beside a stop token id; the
same rounds through SGLang's unhooked check end late, which is what the hook is for.
"""

from __future__ import annotations

import inspect

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

from lab.models.tiny import build_tiny_models
from sglang_ddtree.adapter import stops

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(str(build_tiny_models().target))  # as the scheduler loads it


@pytest.fixture(autouse=True)
def serving_ddtree(monkeypatch):
    monkeypatch.setattr(stops, "_serving_ddtree", lambda: True)


def _req(tokenizer, **params) -> Req:
    sampling = SamplingParams(max_new_tokens=64, **params)
    sampling.normalize(tokenizer)
    req = Req("r", "", [1, 2, 3], sampling, vocab_size=len(tokenizer))
    req.tokenizer = tokenizer
    return req


def _finish(req: Req) -> tuple:
    reason = req.finished_reason.to_json() if req.finished_reason else None
    return reason, req.finished_len


def one_token_a_step(tokenizer, ids, **params) -> tuple:
    req = _req(tokenizer, **params)
    for token in ids:
        req.output_ids.append(token)
        sglang_check(req, 1)
        if req.finished():
            break
    return _finish(req)


def in_rounds(tokenizer, ids, first, round_len, check, **params) -> tuple:
    """A round of the first ``first`` tokens (none when 0), then rounds of ``round_len``."""
    rounds = [ids[:first]] if first else []
    rounds += [ids[i : i + round_len] for i in range(first, len(ids), round_len)]
    req = _req(tokenizer, **params)
    for accepted in rounds:
        req.output_ids.extend(accepted)
        check(req, len(accepted))
        assert (
            list(req.output_ids[-len(accepted) :]) == accepted
        )  # the hook leaves the round's tokens as they were
        if req.finished():
            break
    return _finish(req)


def sglang_check(req, n):
    """SGLang's own check, also where the plugin's hooks were applied in this process (read at
    each call: applying hooks rebinds every module global that holds the original function)."""
    return inspect.unwrap(Req.update_finish_state)(req, n)


def hooked(req, n):
    stops.update_finish_state_like_plain(sglang_check, req, n)


def unhooked(req, n):
    sglang_check(req, n)


def _cases(tokenizer, ids):
    """Stop settings whose matches lie a few tokens apart in TEXT: ":\n" spans the
    tokens "):" and "\n   ", " return" follows, then " +"."""
    pieces = [tokenizer.decode([t]) for t in ids]
    plus = ids[pieces.index(" +")]
    assert "".join(pieces[:8]).endswith(":\n   ") and pieces[8] == " return" and ids.count(plus) == 1
    return {
        "later string listed first": {"stop": ["return", ":\n"]},
        "earlier string listed first": {"stop": [":\n", "return"]},
        "regex after a string": {"stop": ["Point"], "stop_regex": [r"\(a, ?b\)"]},
        "string after a stop id": {"stop": ["Point"], "stop_token_ids": [plus]},
        "stop id after a string": {"stop": [" b"], "stop_token_ids": [ids[-2]]},
        "no match": {"stop": ["never seen"]},
    }


def test_a_round_ends_where_one_token_a_step_ends(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > 12
    for name, params in _cases(tokenizer, ids).items():
        plain = one_token_a_step(tokenizer, ids, **params)
        for round_len in (2, 3, 5, 8, len(ids)):
            for offset in range(round_len):  # rounds cut at every position (the bonus token included)
                got = in_rounds(tokenizer, ids, offset, round_len, hooked, **params)
                assert got == plain, (name, round_len, offset)


def test_sglangs_own_check_ends_such_rounds_late(tokenizer):
    """Without the hook a round holding a later-listed string's match and an earlier
    stop ends at the later one: the test above would fail on SGLang's check."""
    ids = tokenizer(TEXT)["input_ids"]
    late = []
    for name, params in _cases(tokenizer, ids).items():
        plain = one_token_a_step(tokenizer, ids, **params)
        if in_rounds(tokenizer, ids, 0, len(ids), unhooked, **params) != plain:
            late.append(name)
    assert {"later string listed first", "string after a stop id"} <= set(late), late


def test_requests_without_text_stops_keep_the_single_check(tokenizer):
    calls = []

    def original(req, n=1):
        calls.append(n)

    req = _req(tokenizer, stop_token_ids=[5])
    req.output_ids.extend([7, 8, 9])
    stops.update_finish_state_like_plain(original, req, 3)
    assert calls == [3]
