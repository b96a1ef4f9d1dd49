"""Tree build, tree masks and accept walk where the worker runs, on the fastest
implementation available (``kernels/backend.py``): the CUDA kernels (CUDA + CuPy),
else the C++ builder, else the Python reference - identical trees in every case.

The accept walk runs as the CUDA kernel on the CUDA backend and as the batched
torch walk otherwise (``tree/batched.py``: no host synchronisation on any device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.backend import get_tree_backend
from ..tree.batched import BatchedAcceptance, accept_walk

logger = logging.getLogger("sglang_ddtree")


@dataclass
class DeviceTrees:
    """One round's trees on the worker's device; every array ``[bs, width]``."""

    tokens: torch.Tensor  # int64, slot 0 = root
    depths: torch.Tensor  # int64
    parents: torch.Tensor  # int64, -1 for root and padding
    positions: torch.Tensor  # int64, prefix_len + depth
    tree_sizes: torch.Tensor  # [bs] int64
    mask_words: torch.Tensor  # [bs, width, ceil(width / 32)] int32, ancestors + self

    def visibility(self) -> torch.Tensor:
        """``[bs, width, width]`` bool, unpacked from ``mask_words``."""
        width = self.tokens.shape[1]
        bits = torch.arange(32, device=self.mask_words.device, dtype=torch.int32)
        unpacked = (self.mask_words[..., None] >> bits) & 1
        return unpacked.reshape(*self.mask_words.shape[:2], -1)[..., :width].bool()


class TreeEngine:
    def __init__(self, device: torch.device, preference: str | None = None):
        self.backend = get_tree_backend(preference)
        self.name = self.backend.name
        self.device = device

    def build(self, log_probs, token_ids, root_tokens, prefix_lens, budget: int, width: int) -> DeviceTrees:
        out = self.backend.build(
            log_probs.float().contiguous(),
            token_ids.to(torch.int64).contiguous(),
            root_tokens.to(torch.int64).contiguous(),
            budget,
            width,
            prefix_lens.to(torch.int64).contiguous(),
        )
        return DeviceTrees(
            tokens=out["tokens"],
            depths=out["depths"],
            parents=out["parents"],
            positions=out["positions"],
            tree_sizes=out["tree_sizes"],
            mask_words=out["mask_words"],
        )

    def accept(self, trees: DeviceTrees, posterior: torch.Tensor, max_depth: int) -> BatchedAcceptance:
        if self.name == "cuda":
            out = self.backend.accept(trees.tokens, trees.parents, trees.tree_sizes, posterior)
            return BatchedAcceptance(out["path"], out["accept_lens"], out["bonus"], out["out_tokens"])
        return accept_walk(trees.tokens, trees.parents, trees.tree_sizes, posterior, max_depth)

    def flat_custom_mask(
        self, trees: DeviceTrees, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SGLang's flat verify mask for the GPU attention backends. Its size depends
        on the prefix lengths: taken from the scheduler's host copy when it keeps one
        (no synchronisation), read back from the device otherwise."""
        if self.name == "cuda":
            from ..kernels import gpu

            width = trees.tokens.shape[1]
            host_lens = prefix_lens_cpu if prefix_lens_cpu is not None else prefix_lens
            numel = gpu.flat_mask_numel(host_lens.tolist(), width)
            out = torch.empty(numel, dtype=torch.bool, device=trees.mask_words.device)
            return gpu.flat_custom_mask(trees.mask_words, prefix_lens.to(torch.int64), out)
        from ..tree.layout import flat_custom_mask_torch

        return flat_custom_mask_torch(trees.visibility(), prefix_lens)
