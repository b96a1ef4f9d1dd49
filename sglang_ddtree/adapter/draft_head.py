"""Draft log-probs for the tree: the drafter's hidden states through the target's
LM head, reduced to per-depth top-k (merged over tensor-parallel vocab shards).

The full-vocabulary top-k is the tree backend's (``kernels/backend.py``: the fused CUDA
kernel or torch); the shard merge is torch on every backend."""

from __future__ import annotations

import torch

from ..tree.topk import full_vocab_topk, merge_shards, shard_topk


def _dense_head(lm_head) -> torch.Tensor:
    weight = getattr(lm_head, "weight", None)
    if weight is None or weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("DDTREE needs a dense (fp16/bf16/fp32) target lm_head for draft logits.")
    return weight


def draft_topk(
    hidden: torch.Tensor, lm_head, k: int, tp_group=None, topk=full_vocab_topk
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` ``[n, hidden]`` -> top-k log-probs ``[n, k]`` float32 and token ids
    ``[n, k]`` int64, identical on every tensor-parallel rank. ``topk(logits, k)`` is the
    tree backend's full-vocabulary top-k."""
    weight = _dense_head(lm_head)
    shard = getattr(lm_head, "shard_indices", None)
    tp_size = 1 if tp_group is None else int(tp_group.world_size)
    if shard is None or tp_size == 1:
        vocab = int(getattr(lm_head, "org_vocab_size", weight.shape[0]))
        logits = torch.matmul(hidden.to(weight.dtype), weight[:vocab].T)
        return topk(logits, k)
    num_org = int(shard.num_org_elements)
    logits = torch.matmul(hidden.to(weight.dtype), weight[:num_org].T)
    values, ids, lse = shard_topk(logits, k, int(shard.org_vocab_start_index))
    # Shards may hold fewer than k tokens; pad so every rank sends the same shape.
    pad = k - values.shape[-1]
    if pad > 0:
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
    gathered_values = _all_gather(tp_group, values)
    gathered_ids = _all_gather(tp_group, ids)
    gathered_lse = _all_gather(tp_group, lse)
    return merge_shards(gathered_values, gathered_ids, gathered_lse, k)


def _all_gather(group, tensor: torch.Tensor) -> torch.Tensor:
    """``[...]`` on each rank -> ``[ranks, ...]`` in rank order."""
    out = torch.empty(
        (int(group.world_size),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device
    )
    group.all_gather_into_tensor(out.view(-1), tensor.contiguous().view(-1))
    return out
