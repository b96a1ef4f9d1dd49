"""DDTREE through the real SGLang server (CPU mode), one server per scheduler arm
(overlap or not, page size, chunked prefill), each checked against the plain server:

* greedy output token-identical to the same server without speculation, at batch
  size 1 and 8 (every arm);
* requests that end at the context limit (two arms): the scheduler reserves two verify
  windows past each request's committed length every round
  (patches/0004-req-to-token-row-width.md). A request ending within one verify width of
  the context length used to push that reservation past its ``req_to_token`` row and
  kill the scheduler. Here such requests run alone and batched with short ones; greedy
  output must equal the plain server's;
* the same at width 1 (one arm: ``--speculative-ddtree-budget auto`` with injected costs that
  make width 1 win at every batch size, so nearly every step is a decoding step,
  ``adapter/decode_step.py``; the server ``serving.width1_spec`` shared with two other modules):
  greedy identity, and the requests that end at the context limit;
* the KV pool after a burst in which half of the requests are aborted mid-decode (one
  arm, after its other checks): SGLang's strict idle invariant check (a leak kills the
  scheduler) must stay quiet.

Every arm runs with the same context limit as the shared plain reference: the limit
decides how many tokens a near-limit request gets, and the other requests fit well below
it. An arm's checks run on one server, which stops before the next arm's checks.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import urllib.error
import urllib.request

import pytest
from serving import (
    GREEDY,
    PROMPTS,
    REFERENCE_CONTEXT,
    SHARED_SERVERS,
    ServerSpec,
    check_width1_drafts_only_to_predict,
    ddtree_args,
    generate_batch,
    generate_sequential,
    last_tree_stats,
    one_batch,
    output_ids,
    reference_server,
    server_spec,
    uses_reference,
    width1_spec,
)
from transformers import AutoTokenizer

from lab.models.tiny import build_tiny_models
from sglang_ddtree.launch import http_json

pytestmark = pytest.mark.server

MODULE = "test_serving_greedy.py::"
CONTEXT = REFERENCE_CONTEXT
BUDGET = 16
NEW_TOKENS = 48
# prompt + max_new_tokens: exactly the context length, one below, one budget below
ENDS = [CONTEXT, CONTEXT - 1, CONTEXT - BUDGET]
# The burst's requests: long enough that the aborts land while they decode.
BURST_TOKENS = 300
assert max(len(p) for p in PROMPTS) + BURST_TOKENS < CONTEXT  # characters bound tokens

# arm -> (overlap, page size, chunked prefill)
ARMS = {
    "overlap-page1": (True, 1, False),
    "sync-page1": (False, 1, False),
    "overlap-page16-chunked": (True, 16, True),
    "sync-page16": (False, 16, False),
    "overlap-page16-width1": (True, 16, False),
}
CONTEXT_LIMIT_ARMS = ["overlap-page1", "sync-page16", "overlap-page16-width1"]
WIDTH1_ARM = "overlap-page16-width1"
BURST_ARM = "overlap-page1"
# The TP agreement check rides along on one arm: at TP-1 its group is one rank, and it
# still runs the fingerprint, the all-reduce and the host read of every round, which
# must not change the output.
TP_CHECK_ARM = "sync-page1"
# The tests of each arm (its server is launched ahead of the first one that will run).
TEST_OF = {arm: (f"{MODULE}test_greedy_identical_to_plain[{arm}]",) for arm in ARMS}
for _arm in CONTEXT_LIMIT_ARMS:
    TEST_OF[_arm] += (f"{MODULE}test_requests_ending_at_the_context_limit_match_plain[{_arm}]",)
TEST_OF[BURST_ARM] += (f"{MODULE}test_no_kv_leak_after_burst_with_aborts[{BURST_ARM}]",)


@functools.cache
def arm_specs() -> dict[str, ServerSpec]:
    tiny, logs = build_tiny_models(), SHARED_SERVERS.folder("greedy")
    specs = {}
    for arm, (overlap, page_size, chunked) in ARMS.items():
        if arm == WIDTH1_ARM:
            continue
        extra = ["--context-length", str(CONTEXT), "--page-size", str(page_size), "--log-level", "info"]
        if not overlap:
            extra.append("--disable-overlap-schedule")
        if chunked:
            extra += ["--chunked-prefill-size", "16"]
        env = None
        if arm == TP_CHECK_ARM:
            env = {"SGLANG_DDTREE_CHECK_TP_TREES": "1"}
        if arm == BURST_ARM:
            extra += ["--max-running-requests", "8"]
            env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
        specs[arm] = server_spec(ddtree_args(tiny, budget=BUDGET, extra=extra), env, f"ddtree-{arm}", logs)
    specs[WIDTH1_ARM] = width1_spec()  # shared with two other modules
    return specs


SHARED_SERVERS.plan(arm_specs, TEST_OF)
uses_reference(MODULE)


@pytest.fixture(scope="module")
def arm_server(request, servers):
    """The arm's server, for all of the arm's tests (pytest runs them together)."""
    if request.param == WIDTH1_ARM:  # shared: it stops once its last planned test has run
        yield servers.get(width1_spec())
        return
    with servers.take(arm_specs()[request.param]) as server:
        yield server


def _arms(names):
    return pytest.mark.parametrize("arm_server", names, indirect=True)


# --------------------------------------------------------------------------- greedy


@pytest.fixture(scope="module")
def baseline(tiny, servers):
    server = reference_server(servers, tiny)
    sequential = generate_sequential(server)
    batched = generate_batch(server)
    assert sequential == batched, "the plain server itself is not batch-invariant"
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    return sequential


@_arms(list(ARMS))
def test_greedy_identical_to_plain(arm_server, baseline, request):
    assert generate_sequential(arm_server) == baseline  # batch size 1
    assert generate_batch(arm_server) == baseline  # batch size 8, prefixes now cached
    if request.node.callspec.params["arm_server"] == TP_CHECK_ARM:
        log = arm_server.log_path.read_text()
        assert "TP tree check: 1 rounds, trees and accepted paths agree across 1 ranks" in log
        assert "ranks diverged" not in log
    if request.node.callspec.params["arm_server"] == WIDTH1_ARM:
        check_width1_drafts_only_to_predict(arm_server.log_path, last_tree_stats(arm_server.log_path))


# --------------------------------------------------------------------------- context limit


def _near_limit_requests(tokenizer) -> list[dict]:
    text = " ".join(PROMPTS) * 8
    ids = tokenizer(text)["input_ids"]
    requests = []
    for i, end in enumerate(ENDS):
        prompt = ids[i : i + end - NEW_TOKENS]
        assert len(prompt) == end - NEW_TOKENS
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        requests.append({"input_ids": prompt, "sampling_params": params})
    return requests


def _short_requests(tokenizer) -> list[dict]:
    return [{"input_ids": tokenizer(p)["input_ids"], "sampling_params": GREEDY} for p in PROMPTS[:3]]


def _answers(server, requests):
    """Each request alone, then all of them in one batch."""
    alone = output_ids([server.generate(r) for r in requests])
    batched = output_ids(server.generate(one_batch(requests)))
    return alone, batched


@pytest.fixture(scope="module")
def workload(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    return _near_limit_requests(tokenizer) + _short_requests(tokenizer)


@pytest.fixture(scope="module")
def near_limit_plain(tiny, servers, workload):
    alone, batched = _answers(reference_server(servers, tiny), workload)
    assert alone == batched, "the plain server itself is not batch-invariant"
    assert all(len(out) > 0 for out in alone)
    return alone


@_arms(CONTEXT_LIMIT_ARMS)
def test_requests_ending_at_the_context_limit_match_plain(arm_server, workload, near_limit_plain):
    assert arm_server.server_info()["context_length"] == CONTEXT
    alone, batched = _answers(arm_server, workload)
    assert alone == near_limit_plain
    assert batched == near_limit_plain
    # the server is still up and serving
    assert arm_server.generate(workload[-1])["output_ids"] == near_limit_plain[-1]


# --------------------------------------------------------------------------- aborts


@_arms([BURST_ARM])
def test_no_kv_leak_after_burst_with_aborts(arm_server):
    """SGLang's idle invariant check (strict: a leak kills the scheduler) must stay
    quiet after a burst in which half of the requests are aborted mid-decode."""
    server = arm_server
    long = {"max_new_tokens": BURST_TOKENS, "temperature": 0.0, "ignore_eos": True}

    def request(i):
        payload = {"text": PROMPTS[i % len(PROMPTS)], "sampling_params": long, "rid": f"burst-{i}"}
        try:
            return server.generate(payload)["meta_info"]["finish_reason"]["type"]
        except urllib.error.HTTPError as error:
            return f"http-{error.code}"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(request, i) for i in range(12)]
        # abort the even requests while they run or wait (repeated: a request may
        # reach the scheduler after the first abort)
        for _ in range(6):
            time.sleep(0.5)
            for i in range(0, 12, 2):
                http_json(f"{server.url}/abort_request", {"rid": f"burst-{i}"})
        reasons = [f.result() for f in futures]
    assert reasons.count("length") >= 5, reasons
    assert any(r != "length" for r in reasons), reasons  # some aborts landed
    time.sleep(4.0)  # idle: the scheduler runs its pool invariant checks
    with urllib.request.urlopen(f"{server.url}/health_generate", timeout=60) as response:
        assert response.status == 200
    after = server.generate({"text": PROMPTS[2], "sampling_params": GREEDY})
    assert len(after["output_ids"]) == GREEDY["max_new_tokens"]
    assert server.process.poll() is None
    log = server.log_path.read_text()
    assert "memory leak" not in log and "double free" not in log
