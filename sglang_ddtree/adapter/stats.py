"""What the tree buys, per round and per server: accepted tokens, tree sizes, and
how many accepted tokens came from non-argmax branches (tokens a chain of the
drafter's top-1 picks would not have proposed at that depth).

Counters stay on the device and are read on the host only every
``--speculative-ddtree-stats-interval`` rounds, so the decode loop keeps running without
host synchronisation. At 0 (the default) nothing is counted: a round pays nothing for them. SGLang's own ``avg_spec_accept_length``
(``/server_info``) counts the same accepted tokens.
"""

from __future__ import annotations

import logging

import torch

from ..config import DDTreeConfig

logger = logging.getLogger("sglang_ddtree")


class TreeStats:
    def __init__(self, config: DDTreeConfig, interval: int, is_logging_rank: bool):
        self.config = config
        self.is_logging_rank = is_logging_rank
        self.interval = interval  # rounds between log lines (0: never)
        self.rounds = 0
        self._totals: torch.Tensor | None = None  # [requests, accepted, non_argmax, tree_nodes]
        self.extra = dict  # more entries for the log line (the online budget's widths)
        self.decode_steps = 0  # steps run as decoding steps (width 1 without the drafter)
        self._decode_requests = 0  # their requests, counted while the stats are on

    def record(self, acceptance, trees, draft_top1, non_argmax_accepted) -> None:
        """Add one round. Off (interval 0) this costs nothing: the counters are only
        computed for a log line somebody asked for."""
        if not self.interval:
            return
        accept_lens = acceptance.accept_lens
        non_argmax = non_argmax_accepted(acceptance, trees, draft_top1)
        if self._totals is None:
            self._totals = torch.zeros(4, dtype=torch.int64, device=accept_lens.device)
        self._totals[0] += accept_lens.numel()
        self._totals[1:].add_(
            torch.stack([accept_lens.sum(), non_argmax.sum(), (trees.tree_sizes - 1).sum()]).to(torch.int64)
        )
        self._count_round()

    def record_decode_step(self, bs: int) -> None:
        """A decoding step (width 1 without the drafter): ``bs`` requests, the root alone,
        nothing drafted; counted on the host."""
        self.decode_steps += 1
        if self.interval:
            self._decode_requests += bs
            self._count_round()

    def _count_round(self) -> None:
        self.rounds += 1
        if self.is_logging_rank and self.rounds % self.interval == 0:
            logger.info("DDTREE stats: %s", self.summary())

    def summary(self) -> dict:
        if not self.rounds:
            return {"rounds": 0}
        totals = [0, 0, 0, 0] if self._totals is None else [int(x) for x in self._totals.tolist()]
        requests, accepted, non_argmax, nodes = totals
        requests += self._decode_requests
        return {
            "rounds": self.rounds,
            "decode_steps": self.decode_steps,
            "request_rounds": requests,
            "accepted_drafts_per_round": accepted / max(requests, 1),
            "tokens_per_round": (accepted + requests) / max(requests, 1),
            "non_argmax_share": non_argmax / max(accepted, 1),
            "mean_tree_nodes": nodes / max(requests, 1),
            **self.extra(),
        }
