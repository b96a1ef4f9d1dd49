"""Top-k draft log-probs when the vocabulary is split over tensor-parallel ranks.

Each rank holds the logits of one vocabulary shard. A tree needs, per depth, the
global top-k tokens and their log-probs under the *global* normaliser, and every
rank must end up with identical inputs so that every rank builds the same tree.
Each rank therefore contributes only its shard's top-k (values and global token
ids) and its shard's log-sum-exp; the merge is exact:

* global top-k = top-k of the union of shard top-k lists (any global top-k token
  is in its own shard's top-k);
* global log-normaliser = log-sum-exp of the shard log-sum-exps.

Order: value descending, ties to the smaller token id (as ``build.topk_log_probs``).
"""

from __future__ import annotations

import torch


def shard_topk(
    logits: torch.Tensor, k: int, id_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One shard's contribution: ``logits`` ``[n, shard_vocab]`` ->
    values ``[n, k]``, global ids ``[n, k]``, log-sum-exp ``[n]`` (float32)."""
    logits = logits.float()
    k = min(k, logits.shape[-1])
    values, ids = sorted_topk(logits, k)
    return values, ids + id_offset, torch.logsumexp(logits, dim=-1)


def sorted_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim by value descending, ties to the smaller index.

    ``torch.topk`` alone leaves the order of ties to the device; here it runs on an
    int64 key - the float32 value's bits made signed-orderable, then the inverted
    index - so every device returns the same indices as a stable descending sort,
    without sorting the whole row."""
    x = values.float()
    bits = (x + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0 ranks like +0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    index = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    key = ordered * (1 << 32) + (0xFFFFFFFF - index)
    top = torch.topk(key, k, dim=-1, sorted=True).values
    order = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return torch.gather(x, -1, order), order


def merge_shards(
    values: torch.Tensor,  # [ranks, n, k_shard]
    ids: torch.Tensor,  # [ranks, n, k_shard] global token ids
    lse: torch.Tensor,  # [ranks, n]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k log-probs ``[n, k]`` and token ids ``[n, k]`` from per-shard
    top-k lists (ranks in vocabulary order)."""
    ranks, n, k_shard = values.shape
    flat_values = values.permute(1, 0, 2).reshape(n, ranks * k_shard)
    flat_ids = ids.permute(1, 0, 2).reshape(n, ranks * k_shard)
    # Shards are in vocabulary order, so position breaks ties like the id does.
    top_values, order = sorted_topk(flat_values, min(k, ranks * k_shard))
    top_ids = torch.gather(flat_ids, -1, order)
    log_z = torch.logsumexp(lse, dim=0)  # [n]
    return top_values - log_z[:, None], top_ids


def full_vocab_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-rank top-k log-probs and ids of ``logits`` ``[n, vocab]``."""
    values, ids, lse = shard_topk(logits, k, 0)
    return values - lse[:, None], ids
