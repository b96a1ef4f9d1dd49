"""How many drafted tokens a best-first tree is expected to have accepted, for every budget
at once (reference and batched torch, CPU or GPU).

Under the builder's factorised surrogate (``build.py``) a node is accepted exactly when the
target agrees with every token on its path, which the drafter predicts with probability
``exp(score(node))``, the product of the per-depth draft probabilities along the path. A
request's expected accept length is therefore the sum of its tree's node probabilities, and
since the best-first tree of budget ``b`` is the first ``b`` pops of the tree of any larger
budget, one pass at the largest budget ``B`` gives the expectation for every ``b <= B``:

    E[accepted | b] = sum of the b largest path probabilities.

Split per depth, ``reach[b, d]`` is the expected number of requests whose accept length is at
least ``d`` (only depth-``d`` nodes can take a walk to depth ``d``, and at most one of them is
on the accepted path). ``budget/calibration.py`` corrects each depth against what the target
actually accepted; the per-depth split is what it needs.

Shapes: ``log_probs`` ``[bs, depth, k]`` per-depth top-k log-probs, descending (the builder's
input); results ``[bs, B + 1, depth]`` (row ``b`` = the tree of budget ``b``; row 0 is the empty
tree, i.e. no speculation).
"""

from __future__ import annotations

import numpy as np
import torch

from .build import TopK, build_tree_from_topk


def reach_by_depth_ref(log_probs: np.ndarray, max_budget: int) -> np.ndarray:
    """``[B + 1, depth]`` for one request (``log_probs`` ``[depth, k]``), from the reference
    builder's own pops: row ``b``, column ``d - 1`` sums the probabilities of the depth-``d``
    nodes among the first ``b`` pops."""
    depth, k = log_probs.shape
    ids = np.zeros((depth, k), dtype=np.int64)
    tree = build_tree_from_topk(TopK(np.asarray(log_probs, dtype=np.float32), ids), max_budget)
    reach = np.zeros((max_budget + 1, depth), dtype=np.float64)
    for b in range(1, max_budget + 1):
        reach[b] = reach[b - 1]
        if b <= tree.num_nodes:  # a tree smaller than B has every prefix already
            reach[b, tree.depths[b - 1] - 1] += np.exp(tree.scores[b - 1])
    return reach


def reach_by_depth(log_probs: torch.Tensor | np.ndarray, max_budget: int) -> torch.Tensor:
    """``[bs, B + 1, depth]`` float64 for a batch ``log_probs`` ``[bs, depth, k]``, without a
    heap: a fixed number of ``topk`` calls (one per depth, one for the union), no host
    synchronisation.

    The ``B`` most probable nodes are the ``B`` most probable among each depth's ``B`` most
    probable (a depth's best ``B`` extend the previous depth's best ``B``, because a child
    never outscores its parent). Sums of the largest values do not depend on how ties are
    broken; on ties between depths the shallower node counts first, as the heap pops it.
    """
    bs, depth, k = log_probs.shape
    lp = torch.as_tensor(log_probs).double()
    frontier = torch.zeros((bs, 1), dtype=torch.float64, device=lp.device)  # the root
    per_depth = []
    for d in range(depth):
        candidates = (frontier[:, :, None] + lp[:, d, None, :]).reshape(bs, -1)
        frontier = torch.topk(candidates, min(max_budget, candidates.shape[1]), dim=1).values
        per_depth.append(_pad_to(frontier, max_budget))
    scores = torch.cat(per_depth, dim=1)  # [bs, depth * B], depth-major
    node_depths = torch.arange(depth, device=lp.device).repeat_interleave(max_budget)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :max_budget]
    probs = scores.gather(1, order).exp()  # exp(-inf) = 0 where a level ran out of nodes
    # one_hot() checks its classes on the host (a synchronisation) on some devices; this does not
    one_hot = (node_depths[order][..., None] == torch.arange(depth, device=lp.device)).to(torch.float64)
    reach = torch.cumsum(probs[:, :, None] * one_hot, dim=1)  # [bs, B, depth]
    return torch.cat([torch.zeros_like(reach[:, :1]), reach], dim=1)


def expected_accepted(reach: torch.Tensor | np.ndarray, scale=None):
    """Expected accepted drafts per budget: ``reach`` summed over depths (last axis), each
    depth weighted by ``scale[d]`` (a calibration) when given."""
    if scale is not None:
        reach = reach * (torch.as_tensor(scale, dtype=reach.dtype) if torch.is_tensor(reach) else scale)
    return reach.sum(-1)


def reach_at_widths(reach: torch.Tensor, widths) -> torch.Tensor:
    """``[n_widths, depth]``: the batch's total ``reach`` at the trees of the given verify
    widths (``width = budget + 1``; width 1 is no speculation)."""
    total = reach.sum(0)
    # Row views stacked: an index tensor made from a host list would be a copy from pageable
    # memory, which synchronises with the device every step.
    return torch.stack([total[int(w) - 1] for w in widths])


def _pad_to(scores: torch.Tensor, size: int) -> torch.Tensor:
    missing = size - scores.shape[1]
    if missing <= 0:
        return scores
    return torch.nn.functional.pad(scores, (0, missing), value=float("-inf"))
