"""DDTREE through the real SGLang server (CPU mode): greedy output must be
token-identical to the same server without speculation."""

from __future__ import annotations

import pytest
from serving import (
    PROMPTS,
    ServerSpec,
    ddtree_args,
    generate_batch,
    generate_sequential,
    next_to_run,
    reference_server,
    server_spec,
)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def baseline(tiny, servers):
    server = reference_server(servers, tiny)
    sequential = generate_sequential(server)
    batched = generate_batch(server)
    assert sequential == batched, "the plain server itself is not batch-invariant"
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    return sequential


# arm -> (overlap, page size, chunked prefill)
ARMS = {
    "overlap-page1": (True, 1, False),
    "sync-page1": (False, 1, False),
    "overlap-page16-chunked": (True, 16, True),
    "sync-page16": (False, 16, False),
}
TEST_OF = {arm: f"test_greedy_identical_to_plain[{arm}]" for arm in ARMS}
# The TP agreement check rides along on one arm: at TP-1 its group is one rank, and it
# still runs the fingerprint, the all-reduce and the host read of every round, which
# must not change the output.
TP_CHECK_ARM = "sync-page1"


@pytest.fixture(scope="module")
def arm_servers(tiny, tmp_path_factory) -> dict[str, ServerSpec]:
    logs = tmp_path_factory.mktemp("greedy")
    specs = {}
    for arm, (overlap, page_size, chunked) in ARMS.items():
        extra = ["--page-size", str(page_size), "--log-level", "info"]
        if not overlap:
            extra.append("--disable-overlap-schedule")
        if chunked:
            extra += ["--chunked-prefill-size", "16"]
        env = {"SGLANG_DDTREE_CHECK_TP_TREES": "1"} if arm == TP_CHECK_ARM else None
        specs[arm] = server_spec(ddtree_args(tiny, budget=16, extra=extra), env, f"ddtree-{arm}", logs)
    return specs


@pytest.mark.parametrize("arm", list(ARMS))
def test_greedy_identical_to_plain(servers, arm_servers, baseline, arm):
    ahead = next_to_run(arm_servers, arm, TEST_OF)
    with servers.take(arm_servers[arm], ahead) as server:
        assert generate_sequential(server) == baseline  # batch size 1
        assert generate_batch(server) == baseline  # batch size 8, prefixes now cached
    if arm == TP_CHECK_ARM:
        log = server.log_path.read_text()
        assert "TP tree check: 1 rounds, trees and accepted paths agree across 1 ranks" in log
        assert "ranks diverged" not in log
