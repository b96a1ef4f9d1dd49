"""Per-depth calibration of the drafter's predicted acceptance against the target's.

The drafter's path probabilities (``tree/expected_accept.py``) assume the target agrees with
the drafter's own distribution, depth by depth and independently; real targets agree more or
less often, and less so deeper in the block. For every depth ``d`` this keeps a running ratio

    scale[d] = measured[d] / predicted[d]

where ``measured[d]`` counts the requests whose walk reached depth ``d`` (accept length >= d)
and ``predicted[d]`` is the tree's expected count (its ``reach`` at depth ``d``, summed over the
batch). Numerator and denominator are exponentially weighted sums, so the ratio follows a
changing workload and a ratio of sums weighs each step by how much it predicted (a step that
predicted nothing at a depth teaches nothing about it and leaves that depth untouched).
Both start from ``prior_weight`` pseudo-requests of ratio 1 (trust the drafter until shown
otherwise), and the ratio is clamped to ``bounds`` so one odd batch cannot swing the choice.

The ratio is kept per depth, not per width: it is applied to the trees of every width,
including widths not run lately (their deep nodes share the same depths).
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def reach_counts(accept_lens: torch.Tensor, depth: int) -> torch.Tensor:
    """``[depth]``: requests whose accept length is at least ``d`` for ``d = 1..depth``
    (on the device of ``accept_lens`` ``[bs]``, no host synchronisation)."""
    return (accept_lens[:, None] >= _levels(depth, accept_lens.device)).sum(0)


@functools.lru_cache(maxsize=8)
def _levels(depth: int, device: torch.device) -> torch.Tensor:
    """``1..depth`` on ``device``, made once (the prediction runs every few steps)."""
    return torch.arange(1, depth + 1, device=device)


class DepthCalibration:
    def __init__(
        self,
        depth: int,
        decay: float = 0.05,
        bounds: tuple[float, float] = (0.2, 2.0),
        prior_weight: float = 1.0,
        min_predicted: float = 1e-6,
    ):
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must lie in (0, 1]")
        low, high = bounds
        if not 0.0 < low <= 1.0 <= high:
            raise ValueError("bounds must satisfy 0 < low <= 1 <= high")
        if prior_weight <= 0.0:
            raise ValueError("prior_weight must be > 0")
        self.depth = depth
        self.decay = decay
        self.bounds = (float(low), float(high))
        self.min_predicted = min_predicted
        self._measured = np.full(depth, float(prior_weight))
        self._predicted = np.full(depth, float(prior_weight))
        self._scale = self._ratio()

    def update(self, measured, predicted) -> None:
        """One step: ``measured`` and ``predicted`` are ``[depth]`` batch totals (numbers of
        requests reaching each depth, actual and expected) for the tree that ran."""
        measured = _host(measured)
        predicted = _host(predicted)
        if measured.shape != (self.depth,) or predicted.shape != (self.depth,):
            raise ValueError(f"expected [{self.depth}] per-depth totals")
        seen = predicted > self.min_predicted
        keep = 1.0 - self.decay
        self._measured = np.where(seen, keep * self._measured + self.decay * measured, self._measured)
        self._predicted = np.where(seen, keep * self._predicted + self.decay * predicted, self._predicted)
        self._scale = self._ratio()

    @property
    def scale(self) -> np.ndarray:
        """``[depth]`` measured / predicted, clamped to ``bounds`` (read only: kept from the last
        update, since every step's choice reads it)."""
        return self._scale

    def _ratio(self) -> np.ndarray:
        low, high = self.bounds
        scale = np.minimum(
            np.maximum(self._measured / self._predicted, low), high
        )  # np.clip, without its wrapper
        scale.flags.writeable = False
        return scale

    def calibrated(self, reach) -> np.ndarray:
        """``reach`` ``[..., depth]`` times the per-depth scale, summed over depths: the
        calibrated expected accepted drafts."""
        return np.add.reduce(_host(reach) * self._scale, axis=-1)  # .sum(-1), without its wrapper


def _host(values) -> np.ndarray:
    if torch.is_tensor(values):
        values = values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)
