"""Opt-in check that every tensor-parallel rank built the same trees and accepted the
same paths (``SGLANG_DDTREE_CHECK_TP_TREES=1``, read in ``config.py``).

Ranks that disagree corrupt the KV cache silently: each commits its own path. With the
check on, every round reduces the round's fingerprint (``tree/fingerprint.py``) with MAX
and MIN over the group - one all-reduce of ``[fingerprint, -fingerprint]`` - reads the
result on the host and raises :class:`TpTreeDivergence` on every rank at once if any part
differs. Off (the default), :func:`tp_tree_check` returns a no-op: no collective, no sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config import ENV_CHECK_TP_TREES, tp_tree_check_requested
from ..tree.fingerprint import PARTS, round_fingerprint
from ..tree.types import Acceptance, Trees

logger = logging.getLogger("sglang_ddtree")

RoundCheck = Callable[[Trees, Acceptance], None]
# Rank 0 says so at the first round and then every this many rounds: the log shows the
# check ran (a job that relies on it greps for "TP tree check").
LOG_EVERY_ROUNDS = 1000


class TpTreeDivergence(RuntimeError):
    """Tensor-parallel ranks built different trees or accepted different paths."""


def _no_check(trees: Trees, acceptance: Acceptance) -> None:
    return None


class TpTreeCheck:
    """Compares each round's fingerprint across ``group`` (a torch process group; None: the
    default group)."""

    def __init__(self, group, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.rounds = 0

    def __call__(self, trees: Trees, acceptance: Acceptance) -> None:
        local = round_fingerprint(trees, acceptance)
        both = torch.cat([local, -local])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        reduced = both.tolist()
        high, negated_low = reduced[: len(PARTS)], reduced[len(PARTS) :]
        self.rounds += 1
        differing = [part for part, hi, neg in zip(PARTS, high, negated_low) if hi != -neg]
        if differing:
            self._fail(differing, local.tolist())
        if self.rank == 0 and (self.rounds == 1 or self.rounds % LOG_EVERY_ROUNDS == 0):
            # Warning level: a check run for debugging must show in a --log-level warning log.
            logger.warning(
                "TP tree check: %d rounds, trees and accepted paths agree across %d ranks",
                self.rounds,
                self.world_size,
            )

    def _fail(self, differing: list[str], local: list[int]) -> None:
        mine = ", ".join(f"{part}={value}" for part, value in zip(PARTS, local))
        message = (
            f"TP tree check: ranks diverged at round {self.rounds} in {', '.join(differing)} "
            f"(rank {self.rank} of {self.world_size}: {mine}); every rank must build the same "
            f"tree and accept the same path ({ENV_CHECK_TP_TREES})."
        )
        logger.error(message)
        raise TpTreeDivergence(message)


def tp_tree_check(group_coordinator) -> RoundCheck:
    """The round check for SGLang's ``group_coordinator`` (the ranks that serve one batch:
    ``get_dp_tp_group()``) when the environment asks for it, otherwise a no-op."""
    if not tp_tree_check_requested():
        return _no_check
    return TpTreeCheck(
        group_coordinator.device_group,
        rank=int(group_coordinator.rank_in_group),
        world_size=int(group_coordinator.world_size),
    )
