"""The drafter graph's top-k log-probs, kept for the online budget, and its prediction from them
as one CUDA graph replay.

Under CUDA graphs the drafter's graph builds the widest tree and copies its top-k log-probs into
a buffer sized for its largest batch (:class:`KeptLogProbs`). A predicting step (one drafted
step in 32, ``widths.py``) turns them into the batch's expected reach per width and depth
(``reach_totals_at_widths``): about 40 small device operations, each a launch the host pays
for, ~0.5 ms of host time a prediction. :class:`PredictionGraph` captures that computation once
over the whole buffer, the batch size an input of the graph, so a prediction costs the host a
fill and a replay.
"""

from __future__ import annotations

import torch

from ..tree.expected_accept import reach_totals_at_widths


class KeptLogProbs:
    """A buffer the drafter's graph writes the step's top-k log-probs into (``[max_bs * depth,
    k]``), for the width choice after a replay."""

    def __init__(self, max_bs: int, depth: int, k: int, device):
        self.depth = depth
        self.buffer = torch.zeros((max_bs * depth, k), dtype=torch.float32, device=device)

    def keeping(self, propose):
        """``propose`` that also copies its log-probs into the buffer (capturable)."""

        def kept(hidden, k):
            log_probs, token_ids = propose(hidden, k)
            self.buffer[: log_probs.shape[0]].copy_(log_probs)
            return log_probs, token_ids

        return kept

    def rows(self, bs: int) -> torch.Tensor:
        return self.buffer[: bs * self.depth]

    def holds(self, log_probs: torch.Tensor) -> bool:
        """Whether ``log_probs`` are this buffer's rows (the drafter's graph ran the step)."""
        return log_probs.data_ptr() == self.buffer.data_ptr()


class PredictionGraph:
    """``reach_totals_at_widths`` of the kept log-probs' first ``bs`` requests, captured once over
    the whole buffer (the rows past ``bs`` are masked inside: they hold an earlier batch's)."""

    def __init__(self, kept: KeptLogProbs, widths):
        buffer = kept.buffer
        log_probs = buffer.view(-1, kept.depth, buffer.shape[1])
        self._bs = torch.zeros((), dtype=torch.int64, device=buffer.device)
        # Eager runs first: they make the constants the function caches (a host-to-device copy,
        # which a capture may not hold) and warm the kernels, on a side stream as capture asks.
        side = torch.cuda.Stream(buffer.device)
        side.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                reach_totals_at_widths(log_probs, widths, rows=self._bs)
        torch.cuda.current_stream(buffer.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._totals = reach_totals_at_widths(log_probs, widths, rows=self._bs)

    def predict(self, bs: int) -> torch.Tensor:
        """``[n_widths, depth]`` float64 for the step whose drafter graph just ran (read it before
        the next prediction: the graph's output buffer)."""
        self._bs.fill_(bs)
        self._graph.replay()
        return self._totals
