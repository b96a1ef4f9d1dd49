"""DDTREE through the real SGLang server (CPU mode): greedy output must be
token-identical to the same server without speculation."""

from __future__ import annotations

import pytest
from serving import PROMPTS, ddtree_args, generate_batch, generate_sequential, plain_args, run_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def baseline(tiny):
    with run_server(plain_args(tiny), name="plain") as server:
        sequential = generate_sequential(server)
        batched = generate_batch(server)
    assert sequential == batched, "the plain server itself is not batch-invariant"
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    return sequential


@pytest.mark.parametrize(
    "overlap, page_size, chunked",
    [(True, 1, False), (False, 1, False), (True, 16, True), (False, 16, False)],
    ids=["overlap-page1", "sync-page1", "overlap-page16-chunked", "sync-page16"],
)
def test_greedy_identical_to_plain(tiny, baseline, overlap, page_size, chunked):
    extra = ["--page-size", str(page_size)]
    if not overlap:
        extra.append("--disable-overlap-schedule")
    if chunked:
        extra += ["--chunked-prefill-size", "16"]
    with run_server(ddtree_args(tiny, budget=16, extra=extra), name="ddtree") as server:
        assert generate_sequential(server) == baseline  # batch size 1
        assert generate_batch(server) == baseline  # batch size 8, prefixes now cached
