"""The K2.6 A/B's arms (:mod:`.k26_ab`): what one round of each verifies."""

from __future__ import annotations

# The chain arm: DDTREE with one candidate per depth over the drafter's block of 8 (the
# DFlash chain's 7 drafts), the same flags for the server, its verify width and its profile.
CHAIN_BUDGET = 7


def verify_width(arm: str) -> int:
    """Tokens per request in the target forward of one round: 1 (plain), 8 (the chain's
    budget 7 + the root), ``B + 1`` (``ddtree@B``); a ``+suffix`` changes no width."""
    arm = arm.partition("+")[0]
    if arm == "plain":
        return 1
    if arm == "chain":
        return CHAIN_BUDGET + 1
    budget = arm.partition("@")[2]
    return int(budget.removeprefix("auto")) + 1  # the online budget: its largest width (an upper bound)
