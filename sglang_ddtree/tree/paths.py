"""What each tree slot's own path holds: token counts along it and the tree's
first-child / next-sibling links.

A slot's logits predict the token after its path (root ... slot). Sampling
features that look at the text so far (penalties, grammar) must see exactly that
path, not the whole tree and not the round's start: these helpers give the
per-path view in fixed shapes (``[bs, width, width]``), without host
synchronisation.
"""

from __future__ import annotations

import torch


def path_token_counts(visibility: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[bs, width, width]`` float32: ``out[b, i, j]`` is how often ``tokens[b, j]``
    occurs on slot ``i``'s path (its ancestors, root included, and itself).

    ``visibility[b, i, k]`` is True for the slots on ``i``'s path. Column ``j``
    names a token, not a slot: two slots with the same token give the same count,
    so writes keyed by ``(i, tokens[j])`` never disagree.
    """
    same_token = (tokens[:, :, None] == tokens[:, None, :]).to(torch.float32)  # [b, j, k]
    return torch.bmm(visibility.to(torch.float32), same_token.transpose(1, 2))


def first_child_next_sibling(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's tree links (``retrieve_next_token`` / ``retrieve_next_sibling``,
    ``-1`` for none) from a parent array ``[bs, width]`` (``-1`` for the root and
    padding). Children are listed in slot order."""
    bs, width = parents.shape
    device = parents.device
    slots = torch.arange(width, device=device).expand(bs, width)
    has_parent = parents >= 0
    # Sort each row's children by (parent, slot); non-children go last.
    key = torch.where(has_parent, parents * width + slots, width * width + slots)
    order = key.argsort(dim=1)
    sorted_parents = torch.where(has_parent, parents, -1).gather(1, order)
    next_in_order = torch.cat([order[:, 1:], torch.full_like(order[:, :1], -1)], dim=1)
    same_parent_next = torch.cat(
        [sorted_parents[:, 1:] == sorted_parents[:, :-1], torch.zeros_like(order[:, :1], dtype=torch.bool)],
        dim=1,
    ) & (sorted_parents >= 0)
    next_sibling = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order, torch.where(same_parent_next, next_in_order, -1))
    # A parent's first child: the first entry of its run in sorted order.
    run_start = torch.cat(
        [sorted_parents[:, :1] >= 0, sorted_parents[:, 1:] != sorted_parents[:, :-1]], dim=1
    ) & (sorted_parents >= 0)
    first_child = torch.full((bs, width + 1), -1, dtype=torch.int64, device=device)
    target = torch.where(run_start, sorted_parents, width)  # width: a discard column
    first_child.scatter_(1, target, torch.where(run_start, order, -1))
    return first_child[:, :width], next_sibling
