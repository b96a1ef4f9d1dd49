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

The online budget predicts on one drafted step in 32 (``adapter/widths.py``), on the device,
where each operation is a kernel launch the host pays for: :func:`reach_totals_at_widths` gives
the batch's totals at its widths in a fixed number of operations (about 40 at depth 7), whatever
the batch size and the number of widths, and nothing in it waits for the device. Under CUDA
graphs those operations are one graph replay (``adapter/kept_prediction.py``).
"""

from __future__ import annotations

import functools

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
    probable (:func:`_best_by_depth`); on ties between depths the shallower node counts first,
    as the heap pops it.
    """
    bs, depth, k = log_probs.shape
    lp = torch.as_tensor(log_probs).double()
    scores = _best_by_depth(lp, max_budget)  # [bs, depth * B], depth-major
    node_depths = torch.arange(depth, device=lp.device).repeat_interleave(max_budget)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :max_budget]
    probs = scores.gather(1, order).exp()  # exp(-inf) = 0 where a level ran out of nodes
    # one_hot() checks its classes on the host (a synchronisation) on some devices; this does not
    one_hot = (node_depths[order][..., None] == torch.arange(depth, device=lp.device)).to(torch.float64)
    reach = torch.cumsum(probs[:, :, None] * one_hot, dim=1)  # [bs, B, depth]
    return torch.cat([torch.zeros_like(reach[:, :1]), reach], dim=1)


def reach_totals_at_widths(log_probs: torch.Tensor, widths, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[n_widths, depth]`` float64: ``reach_at_widths(reach_by_depth(log_probs, B), widths)``
    with ``B = widths[-1] - 1``, in a fixed number of device operations (the per-step
    prediction): the batch is summed per rank before the budgets are, and each width's budget
    is a row of a 0/1 matrix made once, so neither the batch nor the widths add an operation.
    The sums are the same up to the order of floating-point additions.

    ``rows`` (a 0-d int64 tensor on the device): only the first ``rows`` requests count, and the
    rest of ``log_probs`` may hold anything (a buffer sized for the largest batch, which one CUDA
    graph serves at every batch size: ``adapter/kept_prediction.py``)."""
    lp = torch.as_tensor(log_probs).double()
    depth, max_budget = lp.shape[1], int(widths[-1]) - 1
    scores = _best_by_depth(lp, max_budget)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :max_budget]
    probs = scores.gather(1, order).exp()
    if rows is not None:  # where(), not a product: a stale row's nan or inf adds nothing either
        counted = torch.arange(lp.shape[0], device=lp.device)[:, None] < rows
        probs = torch.where(counted, probs, 0.0)
    levels, below = _rank_constants(depth, max_budget, tuple(int(w) for w in widths), lp.device)
    at_depth = (order // max_budget)[..., None] == levels  # [bs, B, depth]: scores are depth-major
    by_rank = (probs[..., None] * at_depth).sum(0)  # [B, depth]: the batch's mass at each rank
    return below @ by_rank  # below[w, r] = 1 for the ranks r < width - 1 the tree of width w holds


def _best_by_depth(lp: torch.Tensor, max_budget: int) -> torch.Tensor:
    """``[bs, depth * B]``: per depth, the ``B`` largest path log-probs of its nodes, descending
    (``-inf`` where a depth has fewer), depth-major. No host synchronisation.

    The ``B`` most probable nodes are the ``B`` most probable among each depth's ``B`` most
    probable (a depth's best ``B`` extend the previous depth's best ``B``, because a child
    never outscores its parent). Sums of the largest values do not depend on how ties are
    broken. Depth 1's are the root's children, already in order (the input is descending);
    deeper, a child of the parent ranked ``i`` through the token ranked ``j`` (both from 0) is
    outscored by the ``(i + 1)(j + 1) - 1`` others whose ranks are no larger, so only the pairs
    with ``(i + 1)(j + 1) <= B`` can be among the best ``B`` (:func:`_candidate_pairs`): the same
    values from ~``B ln B`` candidates instead of ``B k``."""
    bs, depth, k = lp.shape
    frontier = lp[:, 0, :max_budget]
    per_depth = [_pad_to(frontier, max_budget)]
    for d in range(1, depth):
        parents, tokens = _candidate_pairs(frontier.shape[1], k, max_budget, lp.device)
        candidates = frontier.index_select(1, parents) + lp[:, d].index_select(1, tokens)
        frontier = torch.topk(candidates, min(max_budget, frontier.shape[1] * k), dim=1).values
        per_depth.append(_pad_to(frontier, max_budget))
    return torch.cat(per_depth, dim=1)


@functools.lru_cache(maxsize=32)
def _candidate_pairs(parents: int, k: int, budget: int, device: torch.device):
    """(parent rank, token rank) of every child that can be among the ``budget`` best, made once
    per shape (a host list copied to the device: it synchronises, once)."""
    pairs = [(i, j) for i in range(parents) for j in range(min(k, budget // (i + 1)))]
    ranks = torch.tensor(pairs, dtype=torch.int64).T.contiguous()
    return ranks[0].to(device), ranks[1].to(device)


@functools.lru_cache(maxsize=32)
def _rank_constants(depth: int, max_budget: int, widths: tuple[int, ...], device: torch.device):
    """``([depth] depths, [n_widths, B] float64 0/1 ranks held by each width's tree)``, made once."""
    levels = torch.arange(depth)
    below = (torch.arange(max_budget)[None, :] < torch.tensor(widths)[:, None] - 1).to(torch.float64)
    return levels.to(device), below.to(device)


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
