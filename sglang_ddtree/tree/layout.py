"""Batch layout of draft trees for one verify forward (reference, CPU).

Every request gets a fixed verify width ``width`` (>= budget + 1) so that CUDA graphs
can capture one shape: slot 0 is the root (the token the target emitted last
round), slots ``1..n`` the tree nodes in pop order, and slots ``n+1..width-1``
padding. Padding rows attend only to themselves within the tree block and are
never accepted (their parent is -1 and they are no node's child).

Arrays, all ``[bs, width]`` unless noted:

* ``tokens``     int64 - verify input ids (padding repeats the root token);
* ``depths``     int64 - 0 for the root and for padding;
* ``parents``    int64 - -1 for the root and for padding;
* ``tree_sizes`` int64 ``[bs]`` - ``n + 1`` (root included);
* ``visibility`` bool ``[bs, width, width]`` - row i: ancestors of i and i itself;
* ``positions``  int64 - ``prefix_len + depth``;
* ``mask_words`` int32 ``[bs, width, ceil(width / 32)]`` - ``visibility`` bit-packed,
  bit ``j % 32`` of word ``j // 32`` (the form the GPU builder writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .build import DraftTree, TopK, build_tree_from_topk


@dataclass(frozen=True)
class TreeBatch:
    tokens: np.ndarray  # [bs, width] int64
    depths: np.ndarray  # [bs, width] int64
    parents: np.ndarray  # [bs, width] int64
    tree_sizes: np.ndarray  # [bs] int64
    visibility: np.ndarray  # [bs, width, width] bool

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def positions(self, prefix_lens: Sequence[int]) -> np.ndarray:
        return np.asarray(prefix_lens, dtype=np.int64)[:, None] + self.depths


def layout_trees(trees: Sequence[DraftTree], root_tokens: Sequence[int], width: int) -> TreeBatch:
    """Pad a batch of single-request trees to one verify width."""
    bs = len(trees)
    tokens = np.zeros((bs, width), dtype=np.int64)
    depths = np.zeros((bs, width), dtype=np.int64)
    parents = np.full((bs, width), -1, dtype=np.int64)
    sizes = np.zeros(bs, dtype=np.int64)
    visibility = np.zeros((bs, width, width), dtype=bool)
    for b, (tree, root) in enumerate(zip(trees, root_tokens)):
        size = tree.num_nodes + 1
        if size > width:
            raise ValueError(f"tree of {size} slots does not fit verify width {width}")
        sizes[b] = size
        tokens[b, :] = root
        tokens[b, 1:size] = tree.node_tokens
        depths[b, 1:size] = tree.depths
        parents[b, :size] = tree.parents
        visibility[b, :size, :size] = tree.visibility
        visibility[b, np.arange(size, width), np.arange(size, width)] = True
    return TreeBatch(tokens, depths, parents, sizes, visibility)


def build_tree_batch_ref(
    log_probs: np.ndarray,
    token_ids: np.ndarray,
    root_tokens: Sequence[int],
    budget: int,
    width: int,
) -> TreeBatch:
    """Reference for the batched builders: ``log_probs``/``token_ids`` are
    ``[bs, depth, k]`` top-k per request (descending), as the GPU builder takes them."""
    trees = [build_tree_from_topk(TopK(lp, ids), budget) for lp, ids in zip(log_probs, token_ids)]
    return layout_trees(trees, root_tokens, width)


def pack_mask_words(visibility: np.ndarray) -> np.ndarray:
    """``[..., width, width]`` bool -> ``[..., width, ceil(width/32)]`` int32 bit words."""
    width = visibility.shape[-1]
    n_words = (width + 31) // 32
    padded = np.zeros(visibility.shape[:-1] + (n_words * 32,), dtype=np.uint64)
    padded[..., :width] = visibility
    bits = padded.reshape(visibility.shape[:-1] + (n_words, 32)) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=-1).astype(np.uint32).view(np.int32)


def unpack_mask_words(words: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`pack_mask_words`."""
    as_u32 = words.view(np.uint32).astype(np.uint64)
    bits = (as_u32[..., None] >> np.arange(32, dtype=np.uint64)) & 1
    return bits.reshape(words.shape[:-1] + (-1,))[..., :width].astype(bool)


def flat_custom_mask(visibility: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """SGLang's flat verify ``custom_mask``: per request, row-major
    ``[width, prefix_len + width]`` (whole prefix visible, tree block by visibility),
    concatenated over the batch. True means the (query, key) pair may attend."""
    rows = []
    for b, prefix_len in enumerate(prefix_lens):
        width = visibility.shape[-1]
        prefix = torch.ones((width, int(prefix_len)), dtype=torch.bool, device=visibility.device)
        rows.append(torch.cat([prefix, visibility[b]], dim=1).reshape(-1))
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.bool)


def flat_custom_mask_torch(visibility: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """Device version of :func:`flat_custom_mask`; ``prefix_lens`` ``[bs]`` tensor.
    Reads the lengths on the host once (the mask's size depends on them)."""
    return flat_custom_mask(visibility, prefix_lens.tolist()).to(visibility.device)
