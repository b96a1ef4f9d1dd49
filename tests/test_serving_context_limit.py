"""Requests that end at the context limit, through the real server (CPU mode).

The scheduler reserves two verify windows past each request's committed length
every round (patches/0004-req-to-token-row-width.md). A request ending within one
verify width of the context length used to push that reservation past its
``req_to_token`` row and kill the scheduler. Here such requests run alone and
batched with short ones; greedy output must equal the plain server's.
"""

from __future__ import annotations

import pytest
from serving import (
    GREEDY,
    PROMPTS,
    ServerSpec,
    ddtree_args,
    next_to_run,
    output_ids,
    plain_args,
    server_spec,
)
from transformers import AutoTokenizer

pytestmark = pytest.mark.server

CONTEXT = 160
BUDGET = 16
NEW_TOKENS = 48
# prompt + max_new_tokens: exactly the context length, one below, one budget below
ENDS = [CONTEXT, CONTEXT - 1, CONTEXT - BUDGET]
LIMIT_ARGS = ["--context-length", str(CONTEXT)]


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
    batched = output_ids(server.generate(_one_batch(requests)))
    return alone, batched


def _one_batch(requests: list[dict]) -> dict:
    """One ``/generate`` call carrying every request (the scheduler runs them together)."""
    return {
        "input_ids": [r["input_ids"] for r in requests],
        "sampling_params": [r["sampling_params"] for r in requests],
    }


@pytest.fixture(scope="module")
def workload(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    return _near_limit_requests(tokenizer) + _short_requests(tokenizer)


@pytest.fixture(scope="module")
def plain(tiny, servers, arm_servers, workload):
    # The same limit as the DDTREE servers: it decides how many tokens a request may get.
    spec = server_spec(plain_args(tiny, LIMIT_ARGS), name="plain")
    with servers.take(spec, next_to_run(arm_servers, None, TEST_OF)) as server:
        alone, batched = _answers(server, workload)
    assert alone == batched, "the plain server itself is not batch-invariant"
    assert all(len(out) > 0 for out in alone)
    return alone


ARMS = {"overlap-page1": [], "sync-page16": ["--disable-overlap-schedule", "--page-size", "16"]}
TEST_OF = {arm: f"test_requests_ending_at_the_context_limit_match_plain[{arm}]" for arm in ARMS}


@pytest.fixture(scope="module")
def arm_servers(tiny) -> dict[str, ServerSpec]:
    return {
        arm: server_spec(ddtree_args(tiny, budget=BUDGET, extra=[*LIMIT_ARGS, *extra]), name=f"ddtree-{arm}")
        for arm, extra in ARMS.items()
    }


@pytest.mark.parametrize("arm", list(ARMS))
def test_requests_ending_at_the_context_limit_match_plain(servers, arm_servers, workload, plain, arm):
    with servers.take(arm_servers[arm], next_to_run(arm_servers, arm, TEST_OF)) as server:
        alone, batched = _answers(server, workload)
        assert alone == plain
        assert batched == plain
        # the server is still up and serving
        assert server.generate(workload[-1])["output_ids"] == plain[-1]
