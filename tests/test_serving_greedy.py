"""DDTREE through the real SGLang server (CPU mode): greedy output must be
token-identical to the same server without speculation."""

from __future__ import annotations

import pytest
from serving import GREEDY, PROMPTS, ddtree_args, generate_batch, generate_sequential, plain_args, run_server

from sglang_ddtree.launch import ServerProcess

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


def test_tp_tree_check_runs_every_round(tiny, tmp_path):
    """The TP agreement check wired into the worker: at TP-1 its group is one rank, and it
    still runs the fingerprint, the all-reduce and the host read of every round (the
    output's identity with plain decoding is the other tests' job: the check only reads)."""
    args = ddtree_args(tiny, budget=16, extra=["--log-level", "info"])
    server = ServerProcess(
        args,
        env={"SGLANG_DDTREE_CHECK_TP_TREES": "1"},
        log_path=tmp_path / "ddtree-tp-check.log",
        start_timeout=900.0,  # a loaded 2-core machine
        name="ddtree-tp-check",
    )
    with server:
        outputs = generate_batch(server)
    assert [len(o) for o in outputs] == [GREEDY["max_new_tokens"]] * len(PROMPTS)
    log = (tmp_path / "ddtree-tp-check.log").read_text()
    assert "TP tree check: 1 rounds, trees and accepted paths agree across 1 ranks" in log
    assert "ranks diverged" not in log
