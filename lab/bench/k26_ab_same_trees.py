"""Two servers that built the same trees: a call's own measure of how far two server starts
of the K2.6 rank differ (an A/A).

Every arm of ``k26_ab`` is its own server, started after the one before it has stopped (the
rank fills the GPU), so no two arms are measured at the same time. Where a profile's top-1 is
confident (dflash-k25-code), DDTREE at the drafter's depth (budget 7) builds the chain the
chain arm builds: the same verify width and the same accepted tokens, round for round (the
replay drafter draws its ranks from the request and position alone). The two arms' tok/s
should then be equal, and what separates them is the servers and the minutes they ran in. On
the H200 that A/A moved from 0.79x in one call to 1.15-1.34x in the next at 4096-token prompts,
all of it in the eager, host-bound prefill (TTFT) while the decode pace at c=1 stayed 1.00x
(bench_results/k26_rank_ab_k25_4k_h200_e5be95d.md at the tag bench-results-archive,
results/k26-rank_h200_ab_k25_profile.md). A
margin between arms no larger than the call's A/A spread is not settled by that call. An arm
named again with :data:`AGAIN` is the same trees by construction, at any profile.
"""

from __future__ import annotations

import math

from lab.bench import _stamp
from lab.bench.k26_arms import verify_width

# Arm suffix (``k26_ab --arms chain,ddtree@7,chain+again``): the same arm once more, in a server
# of its own started later in the call, so that any call can measure its own A/A.
AGAIN = "+again"


def _fixed_tree(arm: str) -> bool:
    """A speculative arm whose trees have one size (not plain, not the online budget, no
    ``+suffix`` variant but a repeat)."""
    arm = arm.removesuffix(AGAIN)
    return arm == "chain" or (arm.startswith("ddtree@") and arm[7:].isdigit())


def same_tree_pairs(cells: dict) -> list[tuple[str, str]]:
    """Pairs of arms that served the same trees in two servers (``cells``: ``{(len, profile,
    c): {arm: cell}}``, at least one cell shared): an arm and its repeat (:data:`AGAIN`, the
    same flags, the online budget's arms included), and fixed-tree arms of one verify width
    whose accept length is the same in every cell both served."""
    arms = sorted({a for by_arm in cells.values() for a in by_arm})
    pairs = []
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            shared = [by_arm for by_arm in cells.values() if a in by_arm and b in by_arm]
            if shared and (
                AGAIN in (b.removeprefix(a), a.removeprefix(b)) or _same_fixed_trees(a, b, shared)
            ):
                pairs.append((a, b))
    return pairs


def _same_fixed_trees(a: str, b: str, shared: list[dict]) -> bool:
    return (
        _fixed_tree(a)
        and _fixed_tree(b)
        and verify_width(a) == verify_width(b)
        and all(math.isclose(c[a]["accept_length"], c[b]["accept_length"], rel_tol=1e-9) for c in shared)
    )


def aa_spread(cells: dict) -> float:
    """The largest tok/s ratio (the faster over the slower) between two servers that built the
    same trees, over every cell; 1.0 where the call has no such pair."""
    spread = 1.0
    for a, b in same_tree_pairs(cells):
        for by_arm in cells.values():
            if a in by_arm and b in by_arm:
                ratio = by_arm[a]["tok_per_s"] / by_arm[b]["tok_per_s"]
                spread = max(spread, ratio, 1.0 / ratio)
    return spread


def same_trees_section(cells: dict) -> list[str]:
    """The report's section on the call's A/A pairs (none: no section)."""
    pairs = same_tree_pairs(cells)
    if not pairs:
        return []
    rows = []
    for a, b in pairs:
        for (length, profile, c), by_arm in sorted(cells.items()):
            if a in by_arm and b in by_arm:
                x, y = by_arm[a], by_arm[b]
                rows.append(
                    [f"{a} / {b}", length, profile, c, x["accept_length"], x["tok_per_s"] / y["tok_per_s"]]
                    + [time_ratio(x, y, "itl_ms"), x.get("ttft_ms"), y.get("ttft_ms")]
                )
    header = ["arms", "prompt len", "profile", "conc", "accept len", "tok/s ratio", "decode ratio (ITL)"]
    return [
        "",
        "## Two servers, the same trees (an A/A)",
        "",
        "These arms served the same trees (an arm and its repeat, or one verify width with equal accept "
        "length in every cell), each "
        "in its own server started after the last one stopped: their ratio is how far two server "
        "starts of this call differ, and a margin no larger than it is not settled by the call.",
        "",
        _stamp.md_table(header + ["TTFT ms (first arm)", "TTFT ms (second arm)"], rows),
    ]


def time_ratio(x: dict, y: dict, key: str) -> float | None:
    """``y[key] / x[key]`` (a time: above 1 when ``x`` is faster), or None where one is missing."""
    mine, theirs = x.get(key), y.get(key)
    if not mine or not theirs or math.isnan(mine) or math.isnan(theirs):
        return None
    return theirs / mine
