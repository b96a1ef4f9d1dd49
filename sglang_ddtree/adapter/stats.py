"""What the tree buys, per round and per server: accepted tokens, tree sizes, and
how many accepted tokens came from non-argmax branches (tokens a chain of the
drafter's top-1 picks would not have proposed at that depth).

Counters stay on the device and are read on the host only every
``--speculative-ddtree-stats-interval`` rounds (0 = never), so the decode loop keeps
running without host synchronisation. SGLang's own ``avg_spec_accept_length``
(``/server_info``) counts the same accepted tokens.
"""

from __future__ import annotations

import logging

import torch

from ..config import DDTreeConfig, stats_log_interval

logger = logging.getLogger("sglang_ddtree")


class TreeStats:
    def __init__(self, config: DDTreeConfig, is_logging_rank: bool):
        self.config = config
        self.is_logging_rank = is_logging_rank
        self.interval = stats_log_interval()
        self.rounds = 0
        self._totals: torch.Tensor | None = None  # [requests, accepted, non_argmax, tree_nodes]

    def record(self, accept_lens: torch.Tensor, tree_sizes: torch.Tensor, non_argmax: torch.Tensor) -> None:
        step = torch.stack(
            [
                torch.tensor(accept_lens.numel(), device=accept_lens.device),
                accept_lens.sum(),
                non_argmax.sum(),
                (tree_sizes - 1).sum(),
            ]
        ).to(torch.int64)
        self._totals = step if self._totals is None else self._totals + step
        self.rounds += 1
        if self.interval and self.is_logging_rank and self.rounds % self.interval == 0:
            logger.info("DDTREE stats: %s", self.summary())

    def summary(self) -> dict:
        if self._totals is None:
            return {"rounds": 0}
        requests, accepted, non_argmax, nodes = (int(x) for x in self._totals.tolist())
        return {
            "rounds": self.rounds,
            "request_rounds": requests,
            "accepted_drafts_per_round": accepted / max(requests, 1),
            "tokens_per_round": (accepted + requests) / max(requests, 1),
            "non_argmax_share": non_argmax / max(accepted, 1),
            "mean_tree_nodes": nodes / max(requests, 1),
        }
