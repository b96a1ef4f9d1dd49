"""The two values a round passes between its steps, whatever implementation made them.

Every tree backend (``kernels/backend.py``: CUDA, C++, Python) returns a :class:`Trees`
from ``build`` and an :class:`Acceptance` from ``accept``, as torch tensors on the
worker's device; the references in this package return the same types on the CPU.
Shapes follow the glossary in ``tree/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trees:
    """One round's draft trees in their verify layout; every array ``[bs, width]``."""

    tokens: torch.Tensor  # int64, slot 0 = root, padding repeats the root
    depths: torch.Tensor  # int64, 0 for root and padding
    parents: torch.Tensor  # int64, -1 for root and padding
    positions: torch.Tensor  # int64, prefix_len + depth
    tree_sizes: torch.Tensor  # [bs] int64, nodes + 1
    mask_words: torch.Tensor  # [bs, width, ceil(width / 32)] int32, ancestors + self, bit-packed

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def allocate(cls, bs: int, width: int, device) -> Trees:
        def rows() -> torch.Tensor:
            return torch.empty((bs, width), dtype=torch.int64, device=device)

        return cls(
            tokens=rows(),
            depths=rows(),
            parents=rows(),
            positions=rows(),
            tree_sizes=torch.empty(bs, dtype=torch.int64, device=device),
            mask_words=torch.empty((bs, width, (width + 31) // 32), dtype=torch.int32, device=device),
        )

    def rows(self, n: int) -> Trees:
        """The first ``n`` requests' trees (views: writes reach this batch)."""
        return Trees(
            tokens=self.tokens[:n],
            depths=self.depths[:n],
            parents=self.parents[:n],
            positions=self.positions[:n],
            tree_sizes=self.tree_sizes[:n],
            mask_words=self.mask_words[:n],
        )

    @classmethod
    def root_only(cls, roots: torch.Tensor, prefix_lens: torch.Tensor) -> Trees:
        """Width 1: every request's tree is its root alone (the token the target emitted
        last round, at position ``prefix_len``), what a build at budget 0 gives, made without
        any draft (device ops only, no host sync; copies, never views of the inputs)."""
        roots = roots.reshape(-1, 1).to(torch.int64, copy=True)
        bs = roots.shape[0]
        return cls(
            tokens=roots,
            depths=torch.zeros_like(roots),
            parents=torch.full_like(roots, -1),
            positions=prefix_lens.reshape(bs, 1).to(torch.int64, copy=True),
            tree_sizes=torch.ones(bs, dtype=torch.int64, device=roots.device),
            mask_words=torch.ones((bs, 1, 1), dtype=torch.int32, device=roots.device),  # sees itself
        )

    def narrowed(self, width: int) -> Trees:
        """The tree of ``width - 1`` nodes that a build at ``width`` would give, from this
        wider one (contiguous copies). Exact because the builders emit nodes in best-first
        pop order with a budget-independent order of ties: a budget-``b`` tree is the first
        ``b`` pops of any larger one (``tests/test_width_graphs.py`` checks every builder).
        A node's ancestors come before it, so its mask bits all lie in the first ``width``
        columns; padding slots repeat the root either way. The readable form of the cut the
        drafter graph's :class:`TreeSlots` makes in fewer copies (tested against it)."""
        if not 1 <= width <= self.width:
            raise ValueError(f"cannot narrow trees of width {self.width} to {width}")
        if width == self.width:
            return self
        words = (width + 31) // 32
        return Trees(
            tokens=self.tokens[:, :width].contiguous(),
            depths=self.depths[:, :width].contiguous(),
            parents=self.parents[:, :width].contiguous(),
            positions=self.positions[:, :width].contiguous(),
            tree_sizes=self.tree_sizes.clamp(max=width),
            mask_words=self.mask_words[:, :width, :words].contiguous(),
        )

    def visibility(self) -> torch.Tensor:
        """``[bs, width, width]`` bool, unpacked from ``mask_words``."""
        bits = torch.arange(32, device=self.mask_words.device, dtype=torch.int32)
        unpacked = (self.mask_words[..., None] >> bits) & 1
        return unpacked.reshape(*self.mask_words.shape[:2], -1)[..., : self.width].bool()


class TreeSlots:
    """Trees of up to ``max_bs`` requests at ``width``, written in place (the drafter graph's
    output). The four per-slot arrays share one buffer, so a step at a narrower width copies
    their first columns out in one operation: with the masks and the sizes, three launches a
    step where :meth:`Trees.narrowed` of separate arrays makes six (the online budget's graph
    steps run below the widest width most of the time, and each launch is host time)."""

    def __init__(self, max_bs: int, width: int, device):
        self.width = width
        self._slots = torch.empty((4, max_bs, width), dtype=torch.int64, device=device)  # tokens..positions
        self.tree_sizes = torch.empty(max_bs, dtype=torch.int64, device=device)
        self.mask_words = torch.empty((max_bs, width, (width + 31) // 32), dtype=torch.int32, device=device)

    def rows(self, bs: int) -> Trees:
        """The first ``bs`` requests' trees (views: writes reach the slots)."""
        return self._trees(self._slots[:, :bs], self.tree_sizes[:bs], self.mask_words[:bs])

    def narrowed(self, bs: int, width: int) -> Trees:
        """``self.rows(bs).narrowed(width)``, copied out in three operations (two for one
        request, whose first columns are contiguous rows as they are)."""
        if width == self.width:
            return self.rows(bs)
        if not 1 <= width < self.width:
            raise ValueError(f"cannot narrow trees of width {self.width} to {width}")
        slots = self._slots[:, :bs, :width]
        return self._trees(
            slots if bs == 1 else slots.contiguous(),
            self.tree_sizes[:bs].clamp(max=width),
            self.mask_words[:bs, :width, : (width + 31) // 32].contiguous(),
        )

    @staticmethod
    def _trees(slots: torch.Tensor, tree_sizes: torch.Tensor, mask_words: torch.Tensor) -> Trees:
        tokens, depths, parents, positions = slots.unbind(0)
        return Trees(tokens, depths, parents, positions, tree_sizes, mask_words)


@dataclass
class Acceptance:
    """The walk of every tree along the target's posterior."""

    path: torch.Tensor  # [bs, width] int64, accepted slots root first, -1 padded
    accept_lens: torch.Tensor  # [bs] int64, accepted draft nodes (root excluded)
    bonus: torch.Tensor  # [bs] int64
    out_tokens: torch.Tensor  # [bs, width] int64, accepted drafts then bonus, 0 padded
    new_seq_lens: torch.Tensor | None = None  # [bs] int64, prefix + accept_len + 1 (when known)
    # The commit plan (from the backends' ``accept``; None from the bare references):
    sources: torch.Tensor | None = None  # [bs, width] int64, verify slot whose KV each final position keeps
    emitted: torch.Tensor | None = None  # [bs] int32, accept_len + 1: SGLang's per-request accept length

    @property
    def commit_lens(self) -> torch.Tensor:
        """Tokens emitted this round (accepted drafts + bonus), as SGLang counts them."""
        return self.accept_lens + 1
