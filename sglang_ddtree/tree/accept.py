"""Accepting a verified tree, and the plan to commit its KV (reference, CPU).

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

Commit plan: the accepted path ``0 = p_0 < p_1 < ... < p_k`` sits in verify slots
``prefix + p_d`` and must end at positions ``prefix + d``. ``p_d >= d`` always (a
node's ancestors precede it), so copying in position order never reads a slot an
earlier copy wrote (the worker hands the plan to SGLang's ``move_kv_cache``).
"""

from __future__ import annotations

import numpy as np
import torch

from .types import Acceptance


def accept_walk_ref(
    tokens: np.ndarray, parents: np.ndarray, tree_sizes: np.ndarray, posterior: np.ndarray
) -> Acceptance:
    """Walk each tree along the target's ``posterior`` (``[bs, width]``); numpy arrays in,
    CPU tensors out."""
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
    return Acceptance(*(torch.from_numpy(a) for a in (path, accept_lens, bonus, out_tokens)))


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


def commit_sources_ref(path: np.ndarray, accept_lens: np.ndarray) -> np.ndarray:
    """The commit plan, ``[bs, width]``: for each final position ``d`` the verify slot
    whose KV it must hold - ``path[d]`` for ``d <= accept_len``, ``d`` itself beyond."""
    path, accept_lens = np.asarray(path), np.asarray(accept_lens)
    bs, width = path.shape
    sources = np.tile(np.arange(width, dtype=np.int64), (bs, 1))
    for b in range(bs):
        for d in range(int(accept_lens[b]) + 1):
            sources[b, d] = path[b, d]
    return sources
