"""DDTree as readable reference code: no SGLang imports, runs on CPU.

This package is the specification: the CUDA kernels, the C++ builder and the
SGLang worker are all tested against these functions; ``round.py`` is one whole
round in a few lines.

Shapes, everywhere in the package:

* ``bs``     - requests in the batch;
* ``budget`` - tree nodes per request, the root excluded;
* ``width``  - verify slots per request, ``>= budget + 1`` (slot 0 is the root, the
  target's last token; slots past the tree are padding);
* ``depth``  - deepest tree level, one per masked drafter position (``block_size - 1``);
* ``k``      - candidates per depth from the drafter's top-k (``min(budget, vocab)``,
  capped by ``--speculative-ddtree-max-topk``);
* ``vocab``  - the target's vocabulary.

The draft top-k is ``[bs, depth, k]``; a tree layout (:class:`Trees`) is ``[bs, width]``
per field; an :class:`Acceptance` is ``[bs, width]`` (path, output tokens) and ``[bs]``
(accept lengths, bonus tokens).
"""

from .accept import accept_walk_ref, commit_sources_ref, target_probs_ref
from .build import (
    DraftTree,
    TopK,
    ancestor_visibility,
    build_tree_from_topk,
    build_tree_ref,
    max_tree_nodes,
    topk_log_probs,
)
from .layout import (
    TreeBatch,
    build_tree_batch_ref,
    flat_custom_mask,
    layout_trees,
    pack_mask_words,
    unpack_mask_words,
)
from .types import Acceptance, Trees

__all__ = [
    "Acceptance",
    "DraftTree",
    "TopK",
    "TreeBatch",
    "Trees",
    "accept_walk_ref",
    "ancestor_visibility",
    "build_tree_batch_ref",
    "build_tree_from_topk",
    "build_tree_ref",
    "commit_sources_ref",
    "flat_custom_mask",
    "layout_trees",
    "max_tree_nodes",
    "pack_mask_words",
    "target_probs_ref",
    "topk_log_probs",
    "unpack_mask_words",
]
