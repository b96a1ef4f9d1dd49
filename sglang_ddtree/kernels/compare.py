"""How far a fast path's output is from its reference, as every check and benchmark reports it."""

from __future__ import annotations

import torch


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, in float32)."""
    return float((got.float() - want.float()).norm() / want.float().norm())
