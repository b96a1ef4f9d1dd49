"""DDTREE through the real SGLang server (CPU mode): greedy output must be
token-identical to the same server without speculation."""

from __future__ import annotations

import pytest
from serving import PROMPTS, ddtree_args, generate_batch, generate_sequential, reference_server, run_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def baseline(tiny, servers):
    server = reference_server(servers, tiny)
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
def test_greedy_identical_to_plain(tiny, baseline, overlap, page_size, chunked, tmp_path):
    extra = ["--page-size", str(page_size), "--log-level", "info"]
    if not overlap:
        extra.append("--disable-overlap-schedule")
    if chunked:
        extra += ["--chunked-prefill-size", "16"]
    # The TP agreement check rides along on one arm: at TP-1 its group is one rank, and it
    # still runs the fingerprint, the all-reduce and the host read of every round, which
    # must not change the output.
    check = not overlap and page_size == 1
    env = {"SGLANG_DDTREE_CHECK_TP_TREES": "1"} if check else None
    with run_server(
        ddtree_args(tiny, budget=16, extra=extra), env=env, name="ddtree", tmp=tmp_path
    ) as server:
        assert generate_sequential(server) == baseline  # batch size 1
        assert generate_batch(server) == baseline  # batch size 8, prefixes now cached
    if check:
        log = (tmp_path / "ddtree.log").read_text()
        assert "TP tree check: 1 rounds, trees and accepted paths agree across 1 ranks" in log
        assert "ranks diverged" not in log
