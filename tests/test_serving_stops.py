"""Stop strings, stop regexes and stop token ids under DDTREE, through the real server
(CPU mode, float32).

A DDTREE round accepts several tokens and SGLang 0.5.23 checks them in one call,
which ends a request at the first *listed* stop string in the round, not the earliest
in the text, and tries stop strings before stop regexes and stop token ids; the
plugin checks such a round as plain decoding checks one token a step
(sglang_ddtree/adapter/stops.py).

Every case is built from the plain reference's own greedy text so that two stop
conditions match a few tokens apart: a stop string spanning a token boundary; two
stop strings in both list orders (one such pair ending at every output position of a
range, so some end a round on its last, bonus, token); a stop regex beside a stop
string; a stop token id beside a stop string. The shared deterministic DDTREE server,
its drafter scripted so that rounds accept several tokens through non-argmax
siblings, must answer every case as the plain server does (output ids, text, finish
reason), with the stop trimmed and not, and streamed.

The same server runs with ``--enable-metrics``: ``/metrics`` answers with SGLang's
metrics.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import re
import urllib.request

import pytest
from serving import (
    SHARED_SERVERS,
    add_to_script,
    deterministic_tree_script,
    deterministic_tree_spec,
    reference_server,
    uses_reference,
)
from transformers import AutoTokenizer

from sglang_ddtree.launch import http_text

pytestmark = pytest.mark.server

MAX_NEW_TOKENS = 40
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
# The first prompt's stop pairs end at every position its text allows; the others
# carry the other kinds of case at spread positions.
SWEEP_PROMPT = "Stops: Speculative decoding drafts tokens"
PROMPTS = [
    SWEEP_PROMPT,
    "x = [i * i for i in range(10)]\n",
    "class Point:\n    x: int = 0\n",
    "import os\nimport sys\n",
    "if a < b:\n    print(a)\n",
]
GAPS = (2, 3, 4)  # tokens between the two matches of a case
# The rank of the right token at depths 1..7 in the drafter's proposals: behind a decoy
# at depths 2, 5 and 7. A chain accepts at most one draft a round, the tree all seven
# (more non-argmax acceptances than the shared script's ranks: the features module's
# share of them stays above its bound whichever module runs first).
STOP_RANKS = [0, 1, 0, 0, 1, 0, 1]


def _texts(tokenizer, ids: list[int]) -> list[str]:
    """``texts[k]``: the first ``k`` output tokens decoded."""
    return [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]


def _first_end(texts: list[str], matches) -> int | None:
    """The token whose decoding first makes ``matches(text)`` true, or None."""
    return next((k - 1 for k in range(1, len(texts)) if matches(texts[k])), None)


def _stop_string(texts: list[str], j: int) -> tuple[str, bool] | None:
    """A short stop string whose first match in the text ends in token ``j``, and whether
    it spans the boundary with token ``j - 1`` (preferred), or None where the text is
    not clean there (replacement characters, a multi-byte character cut by the token)."""
    full, before, through = texts[-1], texts[j], texts[j + 1]
    if not (full.startswith(before) and full.startswith(through)) or len(through) <= len(before):
        return None
    inside = None
    for length in range(1, 9):
        for end in range(len(before) + 1, len(through) + 1):
            start = end - length
            text = full[max(start, 0) : end]
            if start < 0 or "\ufffd" in text or text in before:
                continue
            if start < len(before):
                return text, True
            inside = inside or (text, False)
    return inside


def _stop_regex(texts: list[str], j: int) -> str | None:
    """A stop regex whose first match ends in token ``j``."""
    found = _stop_string(texts, j)
    if found is None or len(found[0]) < 2:
        return None
    text = found[0]
    for pattern in (re.escape(text[:-1]) + ".", re.escape(text[0]) + ".?" + re.escape(text[1:])):
        if _first_end(texts, lambda t, p=pattern: re.search(p, t) is not None) == j:
            return pattern
    return None


def _cases(index: int, ids: list[int], texts: list[str]) -> list[dict]:
    """Stop settings on the output ``ids`` of prompt ``index``; each case names where plain
    decoding must end (``end``: the last token kept with the stop untrimmed) and what
    it matches."""
    strings = {j: _stop_string(texts, j) for j in range(len(ids))}
    first_seen = {}
    for j, token in enumerate(ids):
        first_seen.setdefault(token, j)
    cases = []

    def add(kind: str, params: dict, end: int, matched) -> None:
        cases.append({"prompt": index, "kind": kind, "params": params, "end": end, "matched": matched})

    def later(j: int) -> str | None:
        """A stop string matching first a few tokens after ``j``."""
        return next((strings[j + g][0] for g in GAPS if strings.get(j + g)), None)

    last = len(ids) - max(GAPS) - 1
    if index == 0:
        for j in range(1, last):
            if strings[j] and later(j):
                add("later string listed first", {"stop": [later(j), strings[j][0]]}, j, strings[j][0])
        return cases
    # The other prompts: every kind at every third feasible position, from a different start.
    spread = {}
    for j in range(1, last):
        if strings[j] and strings[j][1]:
            spread.setdefault("string across tokens", []).append(
                (j, {"stop": [strings[j][0]]}, strings[j][0])
            )
        if strings[j] and later(j):
            params = {"stop": [strings[j][0], later(j)]}
            spread.setdefault("earlier string listed first", []).append((j, params, strings[j][0]))
            params = {"stop": [later(j), strings[j][0]]}
            spread.setdefault("later string listed first", []).append((j, params, strings[j][0]))
        regex = _stop_regex(texts, j)
        if regex and later(j):
            params = {"stop": [later(j)], "stop_regex": [regex]}
            spread.setdefault("regex before a string", []).append((j, params, regex))
        late_regex = next((r for g in GAPS if (r := _stop_regex(texts, j + g)) is not None), None)
        if strings[j] and late_regex:
            params = {"stop": [strings[j][0]], "stop_regex": [late_regex]}
            spread.setdefault("string before a regex", []).append((j, params, strings[j][0]))
        # A stop id counts only without ignore_eos.
        if first_seen[ids[j]] == j and later(j):
            params = {"stop": [later(j)], "stop_token_ids": [ids[j]], "ignore_eos": False}
            spread.setdefault("stop id before a string", []).append((j, params, ids[j]))
        late_id = next((ids[j + g] for g in GAPS if first_seen[ids[j + g]] == j + g), None)
        if strings[j] and late_id is not None:
            params = {"stop": [strings[j][0]], "stop_token_ids": [late_id], "ignore_eos": False}
            spread.setdefault("string before a stop id", []).append((j, params, strings[j][0]))
    for kind, placed in spread.items():
        for j, params, matched in placed[index % 3 :: 3]:
            add(kind, params, j, matched)
    return cases


def _requests(cases: list[dict], prompt_ids: list[list[int]]) -> list[dict]:
    """Each case, with the stop trimmed and kept."""
    requests = []
    for case in cases:
        for no_stop_trim in (False, True):
            params = {**GREEDY, **case["params"], "no_stop_trim": no_stop_trim}
            requests.append({"input_ids": prompt_ids[case["prompt"]], "sampling_params": params})
    return requests


def _send_all(server, requests: list[dict], send=None) -> list[dict]:
    """All requests in flight at once."""
    send = send or server.generate
    with concurrent.futures.ThreadPoolExecutor(min(len(requests), 64)) as pool:
        return list(pool.map(send, requests))


def _stream(server, payload: dict) -> dict:
    """``/generate`` with ``stream``: the server's events (``data: {...}`` lines up to
    ``data: [DONE]``) put together. Each event's text and output ids hold everything so
    far, or, with ``--incremental-streaming-output``, what is new."""
    incremental = bool(server.server_info().get("incremental_streaming_output"))
    request = urllib.request.Request(
        f"{server.url}/generate",
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events, done = [], False
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            body = line[len("data:") :].strip()
            if body == "[DONE]":
                done = True
                break
            events.append(json.loads(body))
    assert done and events, "the stream did not end with data: [DONE]"
    if incremental:
        texts = list(itertools.accumulate(e["text"] for e in events))
        ids = [t for e in events for t in e["output_ids"]]
    else:
        texts, ids = [e["text"] for e in events], events[-1]["output_ids"]
    return {"text": texts[-1], "output_ids": ids, "meta_info": events[-1]["meta_info"], "texts": texts}


def _answer(result: dict) -> dict:
    return {
        "output_ids": result["output_ids"],
        "text": result["text"],
        "finish_reason": result["meta_info"]["finish_reason"],
    }


def _streamed(cases: list[dict]) -> list[int]:
    """Indices (into the requests) of the streamed cases: the last three cases of each
    kind (they end after several rounds), trimmed, and the first of them untrimmed too."""
    by_kind = collections.defaultdict(list)
    for i, case in enumerate(cases):
        by_kind[case["kind"]].append(2 * i)
    picked = sorted(index for indices in by_kind.values() for index in indices[-3:])
    return [*picked, picked[0] + 1]


MODULE = "test_serving_stops.py::"
SHARED_SERVERS.plan(lambda: {"ddtree": deterministic_tree_spec()}, {"ddtree": MODULE})
uses_reference(MODULE)


@pytest.fixture(scope="module")
def reference(tiny, servers):
    """The plain server's greedy text for each prompt, the stop cases built from it, and
    the plain server's answers to them; the tree server's drafter script learns the
    greedy continuations."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    server = reference_server(servers, tiny)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    greedy = [
        r["output_ids"]
        for r in _send_all(server, [{"input_ids": ids, "sampling_params": GREEDY} for ids in prompt_ids])
    ]
    cases = []
    for index, ids in enumerate(greedy):
        cases += _cases(index, ids, _texts(tokenizer, ids))
    requests = _requests(cases, prompt_ids)
    results = _send_all(server, requests)
    streamed = _streamed(cases)
    streams = _send_all(server, [requests[i] for i in streamed], lambda r: _stream(server, r))
    # The tree server's drafter script: this module's continuations join the other modules'.
    overrides = {str(i): {"ranks": STOP_RANKS} for i in range(len(PROMPTS))}
    add_to_script(
        deterministic_tree_script(), "stops", [p + g for p, g in zip(prompt_ids, greedy)], overrides
    )
    return {
        "prompt_ids": prompt_ids,
        "greedy": greedy,
        "cases": cases,
        "requests": requests,
        "results": results,
        "streamed": streamed,
        "streams": streams,
    }


@pytest.fixture(scope="module")
def tree(servers, reference):
    """The tree server's answers: the prompts at full length, every case, the streams."""
    server = servers.get(deterministic_tree_spec())
    full = _send_all(
        server, [{"input_ids": ids, "sampling_params": GREEDY} for ids in reference["prompt_ids"]]
    )
    results = _send_all(server, reference["requests"])
    requests = reference["requests"]
    streams = _send_all(server, [requests[i] for i in reference["streamed"]], lambda r: _stream(server, r))
    return {"server": server, "full": full, "results": results, "streams": streams}


def _describe(case: dict, no_stop_trim: bool) -> str:
    where = f"prompt {case['prompt']} {case['kind']} ending at {case['end']}"
    return f"{where} {case['params']} no_stop_trim={no_stop_trim}"


def test_cases_end_where_they_were_placed(reference):
    """The plain server ends each case at the match placed first in the text: the cases
    test what they name (and the sweep covers every position of its range)."""
    cases, results = reference["cases"], reference["results"]
    kinds = {case["kind"] for case in cases}
    assert kinds == {
        "string across tokens",
        "earlier string listed first",
        "later string listed first",
        "regex before a string",
        "string before a regex",
        "stop id before a string",
        "string before a stop id",
    }, kinds
    sweep = sorted(case["end"] for case in cases if case["prompt"] == 0)
    assert len(sweep) >= 20 and sweep[-1] - sweep[0] + 1 - len(sweep) <= 4, sweep
    for i, case in enumerate(cases):
        untrimmed = results[2 * i + 1]
        reason = untrimmed["meta_info"]["finish_reason"]
        assert reason.get("matched") == case["matched"], (_describe(case, True), reason)
        assert len(untrimmed["output_ids"]) == case["end"] + 1, (
            _describe(case, True),
            untrimmed["output_ids"],
        )


def test_every_stop_case_ends_as_on_the_plain_server(reference, tree):
    differ, kinds = [], collections.Counter()
    for i, (want, got) in enumerate(zip(reference["results"], tree["results"])):
        if _answer(got) != _answer(want):
            case = reference["cases"][i // 2]
            kinds[case["kind"]] += 1
            differ.append((_describe(case, bool(i % 2)), _answer(want), _answer(got)))
    summary = f"{len(differ)} of {len(reference['results'])} requests differ ({dict(kinds)})"
    assert not differ, summary + ":\n" + "\n".join(map(str, differ))


def test_streamed_stops_end_as_on_the_plain_server(reference, tree):
    """Streamed, a case ends as on the plain server and as answered whole, and its text
    only grows from event to event (no text past the stop is shown, then taken back)."""
    for index, want, got in zip(reference["streamed"], reference["streams"], tree["streams"]):
        case = _describe(reference["cases"][index // 2], bool(index % 2))
        assert _answer(got) == _answer(want), case
        assert _answer(want) == _answer(reference["results"][index]), case
        for stream in (want, got):
            texts = stream["texts"]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), (case, texts)
    # The tree server streamed round by round, not only the final answer.
    assert max(len(stream["texts"]) for stream in tree["streams"]) > 1


def test_rounds_accept_several_tokens(tree):
    """Without multi-token rounds the cases would prove nothing. Under this script a chain
    accepts at most one draft and the bonus a round; the tree accepts more, for the
    full-length requests and for every case that ran a while."""
    for result in tree["full"]:
        assert result["meta_info"]["spec_accept_length"] > 4.0, result["meta_info"]
    ran = [r["meta_info"] for r in tree["results"] if r["meta_info"]["completion_tokens"] >= 12]
    assert len(ran) > len(tree["results"]) / 3
    for meta in ran:
        assert meta["spec_accept_length"] > 3.0, meta


def test_metrics_endpoint(tree):
    """The tree server runs with --enable-metrics: /metrics answers SGLang's metrics."""
    body = http_text(f"{tree['server'].url}/metrics", timeout=60)
    assert any(line.startswith("sglang:") for line in body.splitlines()), body[:2000]
