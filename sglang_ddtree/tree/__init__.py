"""DDTree as readable reference code: no SGLang imports, runs on CPU.

This package is the specification: the CUDA kernels, the C++ builder and the
SGLang worker are all tested against these functions.
"""

from .accept import (
    Acceptance,
    accept_walk_ref,
    commit_moves_ref,
    move_kv_ref,
    rewrite_req_to_token_ref,
    sample_posterior_ref,
    target_probs_ref,
)
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

__all__ = [
    "Acceptance",
    "DraftTree",
    "TopK",
    "TreeBatch",
    "accept_walk_ref",
    "ancestor_visibility",
    "build_tree_batch_ref",
    "build_tree_from_topk",
    "build_tree_ref",
    "commit_moves_ref",
    "flat_custom_mask",
    "layout_trees",
    "max_tree_nodes",
    "move_kv_ref",
    "pack_mask_words",
    "rewrite_req_to_token_ref",
    "sample_posterior_ref",
    "target_probs_ref",
    "topk_log_probs",
    "unpack_mask_words",
]
