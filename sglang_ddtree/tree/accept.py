"""Accepting a verified tree, and committing its KV (reference, CPU).

Greedy and sampled acceptance are one walk: the target gives one ``posterior``
token per tree slot - its argmax at temperature 0, or one sample from its
(temperature / top-k / top-p / min-p adjusted) distribution otherwise. From the
root, while ``posterior[cur]`` is the token of a child of ``cur``, move to that
child; the last ``posterior[cur]`` is the bonus token.

Why sampling stays exact: every emitted token is ``posterior[cur]`` for the node
``cur`` it follows, drawn from the target's conditional given that node's
ancestors and independent of the tree, whether it then matches a child (accepted
draft) or not (bonus). With one-hot drafts this accepts exactly as often as tree
rejection sampling does.

KV commit: the accepted path ``0 = p_0 < p_1 < ... < p_k`` sits in verify slots
``prefix + p_d`` and must end at positions ``prefix + d``. ``p_d >= d`` always (a
node's ancestors precede it), so the moves never read a slot an earlier move wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Acceptance:
    path: np.ndarray  # [bs, width] int64, accepted slots root first, -1 padded
    accept_lens: np.ndarray  # [bs] int64, accepted draft nodes (root excluded)
    bonus: np.ndarray  # [bs] int64
    out_tokens: np.ndarray  # [bs, width] int64, accepted drafts then bonus, 0 padded

    @property
    def commit_lens(self) -> np.ndarray:
        """Tokens emitted this round (accepted drafts + bonus), as SGLang counts them."""
        return self.accept_lens + 1


def accept_walk_ref(
    tokens: np.ndarray, parents: np.ndarray, tree_sizes: np.ndarray, posterior: np.ndarray
) -> Acceptance:
    """Walk each tree along the target's ``posterior`` (``[bs, width]``)."""
    bs, width = tokens.shape
    path = np.full((bs, width), -1, dtype=np.int64)
    accept_lens = np.zeros(bs, dtype=np.int64)
    bonus = np.zeros(bs, dtype=np.int64)
    out_tokens = np.zeros((bs, width), dtype=np.int64)
    for b in range(bs):
        cur, depth = 0, 0
        path[b, 0] = 0
        while True:
            want = posterior[b, cur]
            child = _find_child(tokens[b], parents[b], int(tree_sizes[b]), cur, want)
            if child < 0:
                break
            out_tokens[b, depth] = want
            depth += 1
            path[b, depth] = child
            cur = child
        accept_lens[b] = depth
        bonus[b] = posterior[b, cur]
        out_tokens[b, depth] = bonus[b]
    return Acceptance(path, accept_lens, bonus, out_tokens)


def _find_child(tokens, parents, size, node, token) -> int:
    for c in range(node + 1, size):
        if parents[c] == node and tokens[c] == token:
            return c
    return -1


def target_probs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution SGLang samples from: ``logits`` ``[rows, vocab]``, one
    parameter per row. Temperature, softmax, then top-k, top-p and min-p filters,
    renormalised (same order and tie rules as SGLang's torch sampler)."""
    probs = torch.softmax(logits.float() / temperature[:, None].float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (cum - sorted_probs) > top_p[:, None].float()
    drop |= rank >= top_k[:, None]
    drop |= sorted_probs < (sorted_probs[:, :1] * min_p[:, None].float())
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_posterior_ref(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One independent target sample per tree slot: ``probs`` ``[rows, vocab]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def commit_moves_ref(path: np.ndarray, accept_lens: np.ndarray, prefix_lens: np.ndarray):
    """``(request, src_position, dst_position)`` for every accepted node off its
    final place, in the order they must run."""
    moves = []
    for b in range(path.shape[0]):
        for d in range(1, int(accept_lens[b]) + 1):
            if path[b, d] != d:
                moves.append((b, int(prefix_lens[b] + path[b, d]), int(prefix_lens[b] + d)))
    return moves


def rewrite_req_to_token_ref(req_to_token, req_pool_indices, prefix_lens, path, accept_lens):
    """Page size 1: swap table entries so position ``prefix + d`` names the slot the
    accepted node was verified in. The request keeps owning the same set of slots."""
    table = req_to_token.clone()
    for b, src, dst in commit_moves_ref(path, accept_lens, prefix_lens):
        row = int(req_pool_indices[b])
        table[row, src], table[row, dst] = table[row, dst].clone(), table[row, src].clone()
    return table


def move_kv_ref(kv: torch.Tensor, req_to_token, req_pool_indices, prefix_lens, path, accept_lens):
    """Page size > 1: copy each accepted node's KV (``kv`` ``[slots, ...]``, one
    layer) from its verify slot to the slot of its final position."""
    out = kv.clone()
    for b, src, dst in commit_moves_ref(path, accept_lens, prefix_lens):
        row = int(req_pool_indices[b])
        out[req_to_token[row, dst]] = out[req_to_token[row, src]]
    return out
