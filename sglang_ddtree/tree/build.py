"""Reference DDTree builder: the specification every fast builder is tested against.

The tree holds the ``budget`` most probable draft prefixes under the factorised
surrogate ``score(prefix) = sum_d logp_d(token_d)``, found by a best-first heap over
prefixes exactly as the DDTree paper's reference code does:

* per depth ``d`` take the top-k log-probs (``k = min(budget, vocab)``);
* start from ``(depth 1, rank 0)``; every pop emits a node and pushes
  (a) its next sibling (same parent, ``rank + 1``) and (b) its first child
  (``depth + 1``, rank 0);
* the heap key is ``(-score, ranks)``: ties go to the lexicographically smaller
  rank tuple.

Two details are pinned down here so that GPU and C++ builders can match bit for bit:

* **top-k order** - by logit, descending, ties to the smaller token id
  (``torch.sort(stable=True)``), so duplicated log-probs give one answer on every
  device;
* **score arithmetic** - ``score(node) = score(parent) + logp[depth-1, rank]`` in
  float64. The paper's code updates a sibling as ``score - lp[r] + lp[r+1]``, which
  can round one ulp above its predecessor; the parent-plus-edge form never does, so
  pops come out in exactly the order of the key (see
  ``tests/test_tree_reference.py::test_scores_are_monotone_along_successors``), and a
  parallel builder may select instead of pop.

Shapes: ``depth`` = block size - 1 draft positions, ``vocab``, ``n`` = nodes
(root excluded), ``budget`` >= ``n``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TopK:
    """Per-depth top-k of the draft distribution."""

    log_probs: np.ndarray  # [depth, k] float32, descending per row
    token_ids: np.ndarray  # [depth, k] int64


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree, nodes in pop order (index 0 is the root)."""

    node_tokens: np.ndarray  # [n] int64, token of node i+1
    depths: np.ndarray  # [n] int64, depth of node i+1 (root has depth 0)
    parents: np.ndarray  # [n+1] int64, parents[0] = -1 (root), parents[i] < i
    visibility: np.ndarray  # [n+1, n+1] bool, row i = ancestors of i and i itself
    ranks: np.ndarray  # [n] int64, rank of node i+1 among its siblings
    scores: np.ndarray  # [n] float64, score of node i+1

    @property
    def num_nodes(self) -> int:
        return int(self.node_tokens.shape[0])


def topk_log_probs(draft_logits: torch.Tensor, k: int) -> TopK:
    """Top-k log-probs per depth, ties to the smaller token id.

    ``draft_logits`` is ``[depth, vocab]`` in any float dtype; maths is float32.
    """
    logits = draft_logits.detach().float()
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    values, token_ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    log_probs = values[:, :k] - log_z
    return TopK(
        log_probs=log_probs.cpu().numpy().astype(np.float32),
        token_ids=token_ids[:, :k].cpu().numpy().astype(np.int64),
    )


def build_tree_from_topk(topk: TopK, budget: int) -> DraftTree:
    """Best-first heap over prefixes (the paper's algorithm) on precomputed top-k."""
    depth_limit, k = topk.log_probs.shape
    lp = topk.log_probs.astype(np.float64)
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    ranks: list[int] = []
    scores: list[float] = []
    if budget <= 0 or depth_limit == 0 or k == 0:
        return _finish(tokens, depths, parents, ranks, scores)

    # entry: (-score, rank path, parent index, depth, rank, parent score)
    heap = [(-lp[0, 0], (0,), 0, 1, 0, 0.0)]
    while heap and len(tokens) < budget:
        neg_score, path, parent, depth, rank, parent_score = heapq.heappop(heap)
        score = -neg_score
        tokens.append(int(topk.token_ids[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        ranks.append(rank)
        scores.append(score)
        node = len(tokens)
        if rank + 1 < k:
            sibling = parent_score + lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-sibling, path[:-1] + (rank + 1,), parent, depth, rank + 1, parent_score))
        if depth < depth_limit:
            child = score + lp[depth, 0]
            heapq.heappush(heap, (-child, path + (0,), node, depth + 1, 0, score))
    return _finish(tokens, depths, parents, ranks, scores)


def build_tree_ref(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """Build one request's tree from draft logits ``[depth, vocab]``.

    Returns a :class:`DraftTree`; its first three fields are node token ids, depths
    and parents (``parents[0] = -1`` is the root, nodes in pop order).
    """
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [depth, vocab], got {tuple(draft_logits.shape)}")
    k = max(0, min(budget, draft_logits.shape[-1]))
    return build_tree_from_topk(topk_log_probs(draft_logits, k), budget)


def ancestor_visibility(parents: np.ndarray) -> np.ndarray:
    """Row i is True at i's ancestors (root included) and at i itself."""
    n1 = len(parents)
    visibility = np.zeros((n1, n1), dtype=bool)
    for i in range(n1):
        if parents[i] >= 0:
            visibility[i] = visibility[parents[i]]
        visibility[i, i] = True
    return visibility


def max_tree_nodes(depth: int, k: int) -> int:
    """Number of distinct prefixes with at most ``depth`` tokens from ``k`` choices each."""
    return sum(k**d for d in range(1, depth + 1))


def _finish(tokens, depths, parents, ranks, scores) -> DraftTree:
    parents_arr = np.asarray(parents, dtype=np.int64)
    return DraftTree(
        node_tokens=np.asarray(tokens, dtype=np.int64),
        depths=np.asarray(depths, dtype=np.int64),
        parents=parents_arr,
        visibility=ancestor_visibility(parents_arr),
        ranks=np.asarray(ranks, dtype=np.int64),
        scores=np.asarray(scores, dtype=np.float64),
    )
