"""Draft log-probs for the tree: the drafter's hidden states through the target's
LM head, reduced to per-depth top-k (merged over tensor-parallel vocab shards).

The full-vocabulary top-k is the tree backend's (``kernels/backend.py``: the fused CUDA
kernel or torch); the shard merge is torch on every backend."""

from __future__ import annotations

import logging

import torch

from ..tree.topk import full_vocab_topk, merge_shards, shard_topk
from ..tree.types import Trees, TreeSlots

logger = logging.getLogger("sglang_ddtree")


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


class DraftTreeHead:
    """The round's tree step: the drafter's hidden states -> LM head -> per-depth top-k ->
    best-first tree in its verify layout.

    Where decode CUDA graphs are captured, the step is folded into the drafter's graph (a
    capture tail hook, as stock DFLASH folds its greedy head): a replay leaves the round's
    trees in buffers allocated once for the largest captured batch, with no host work and
    no kernel launches of its own. Batches the graphs do not cover, CPU servers and scripted
    test drafters (which override the worker's ``_propose``) run the same step eagerly.
    """

    def __init__(self, *, trees_backend, budget: int, width: int, block: int, k: int, last_position: int):
        self.backend = trees_backend
        self.last_position = last_position  # positions past it are clamped (never-emitted slots)
        self.budget, self.width, self.block, self.k = budget, width, block, k
        self._static: Trees | None = None
        self._static_top1: torch.Tensor | None = None

    def run(self, hidden, roots, prefix_lens, propose, out: Trees | None = None):
        """``hidden`` ``[bs * block, hidden]`` (the whole block) -> (:class:`Trees`, the
        drafter's top-1 id per depth ``[bs, depth]``). ``propose(hidden [n, hidden], k)`` ->
        top-k log-probs and ids ``[n, k]``; ``out`` receives the trees (else allocated)."""
        bs, depth = int(roots.shape[0]), self.block - 1
        hidden = hidden.view(bs, self.block, -1)[:, 1:, :].reshape(bs * depth, -1)
        log_probs, token_ids = propose(hidden, self.k)
        log_probs, token_ids = log_probs.view(bs, depth, -1), token_ids.view(bs, depth, -1)
        trees = self.backend.build(log_probs, token_ids, roots, prefix_lens, self.budget, self.width, out=out)
        trees.positions.clamp_(max=self.last_position)
        return trees, token_ids[:, :, 0]

    # --- in the drafter's CUDA graph ----------------------------------------------------

    @property
    def in_graph(self) -> bool:
        return self._static is not None

    def fold_into_graph(self, draft_model_runner, proposal, max_bs: int, device) -> None:
        """Capture the step in every decode graph of ``draft_model_runner`` (call before the
        capture). ``proposal(roots, prefix_lens, req_pool_indices)`` gives the captured batch's
        ``propose(hidden, k)`` from its graph buffers; it must be capturable: device work only,
        no host reads."""
        self._static = TreeSlots(max_bs, self.width, device)
        self._static_top1 = torch.empty((max_bs, self.block - 1), dtype=torch.int64, device=device)

        def capture_tail(runner, out, forward_batch, num_tokens):
            bs = int(num_tokens) // self.block
            if bs > max_bs:
                raise RuntimeError(
                    f"DDTREE: the drafter captures batch size {bs}, above the {max_bs} sized for"
                )
            roots = forward_batch.input_ids[: bs * self.block].view(bs, self.block)[:, 0]
            prefix_lens = forward_batch.seq_lens[:bs]
            propose = proposal(roots, prefix_lens, forward_batch.req_pool_indices[:bs])
            _, top1 = self.run(out.hidden_states, roots, prefix_lens, propose, out=self._static.rows(bs))
            self._static_top1[:bs].copy_(top1)

        draft_model_runner.capture_tail_hooks.append(capture_tail)
        logger.info("DDTREE tree step folded into the drafter's CUDA graphs (batch sizes up to %d)", max_bs)

    def replayed(self, bs: int, width: int):
        """The trees and top-1 ids the last graph replay wrote for the first ``bs`` requests,
        the trees cut to a step's ``width`` (exact: ``Trees.narrowed``)."""
        return self._static.narrowed(bs, width), self._static_top1[:bs]
