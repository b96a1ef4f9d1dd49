"""Batched torch versions of the accept walk and the KV commit plan.

They run on any device with a fixed number of kernel launches (one step per tree
depth, no data-dependent shapes, no host synchronisation), so they are the
portable path of the worker and CUDA-graph capturable. They mirror
``accept.accept_walk_ref`` and ``accept.commit_sources_ref`` exactly
(``tests/test_tree_batched.py``).
"""

from __future__ import annotations

import torch

from .types import Acceptance


def accept_walk(
    tokens: torch.Tensor,  # [bs, width]
    parents: torch.Tensor,  # [bs, width]
    tree_sizes: torch.Tensor,  # [bs]
    posterior: torch.Tensor,  # [bs, width]
    max_depth: int,
    prefix_lens: torch.Tensor | None = None,  # [bs]
) -> Acceptance:
    """Walk every tree along ``posterior`` for at most ``max_depth`` steps; with
    ``prefix_lens`` also ``new_seq_lens = prefix + accept_len + 1``."""
    bs, width = tokens.shape
    device = tokens.device
    slots = torch.arange(width, device=device)[None, :]
    in_tree = (slots > 0) & (slots < tree_sizes[:, None])
    cur = torch.zeros(bs, dtype=torch.int64, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    path = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    for step in range(min(max_depth, width - 1)):
        want = posterior.gather(1, cur[:, None])
        match = in_tree & (parents == cur[:, None]) & (tokens == want)
        found = match.any(dim=1) & alive
        child = match.to(torch.int8).argmax(dim=1)  # first (smallest) matching slot
        cur = torch.where(found, child, cur)
        path[:, step + 1] = torch.where(found, child, -1)
        alive = found
    accept_lens = (path[:, 1:] >= 0).sum(dim=1)
    bonus = posterior.gather(1, cur[:, None]).squeeze(1)
    depth_index = slots[:, : width - 1]
    accepted_tokens = tokens.gather(1, path[:, 1:].clamp(min=0))
    out_tokens = torch.zeros((bs, width), dtype=torch.int64, device=device)
    out_tokens[:, : width - 1] = torch.where(depth_index < accept_lens[:, None], accepted_tokens, 0)
    out_tokens.scatter_(1, accept_lens[:, None], bonus[:, None])
    new_seq_lens = None if prefix_lens is None else prefix_lens.to(torch.int64) + accept_lens + 1
    return Acceptance(path, accept_lens, bonus, out_tokens, new_seq_lens)


def commit_sources(path: torch.Tensor, accept_lens: torch.Tensor) -> torch.Tensor:
    """``[bs, width]``: for each final position ``d`` the verify slot whose KV it
    must hold - ``path[d]`` for ``d <= accept_len``, ``d`` itself (no move) beyond."""
    width = path.shape[1]
    depth = torch.arange(width, device=path.device)[None, :]
    return torch.where(depth <= accept_lens[:, None], path.clamp(min=0), depth)


def non_argmax_accepted(
    path: torch.Tensor,  # [bs, width]
    accept_lens: torch.Tensor,  # [bs]
    tokens: torch.Tensor,  # [bs, width]
    depths: torch.Tensor,  # [bs, width]
    top1_ids: torch.Tensor,  # [bs, depth] draft argmax per depth
) -> torch.Tensor:
    """``[bs]``: accepted nodes whose token was not the drafter's top-1 at its depth
    (tokens a chain could not have proposed)."""
    width = path.shape[1]
    nodes = path[:, 1:].clamp(min=0)
    node_tokens = tokens.gather(1, nodes)
    node_depths = depths.gather(1, nodes).clamp(min=1)
    top1 = top1_ids.gather(1, node_depths - 1)
    accepted = torch.arange(width - 1, device=path.device)[None, :] < accept_lens[:, None]
    return (accepted & (node_tokens != top1)).sum(dim=1)
