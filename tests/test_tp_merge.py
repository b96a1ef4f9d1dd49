"""Tensor-parallel draft head: per-rank vocabulary shards merged into the global
top-k and log-normaliser, the same tree built on every rank, the same path accepted.

SGLang's CPU mode cannot run TP > 1 (its TP groups create NCCL communicators), so
this runs the plugin's merge (``adapter/draft_head.py``) and the tree/accept code in
real ``torch.distributed`` gloo processes, outside the server.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_ddtree.adapter.draft_head import draft_topk
from sglang_ddtree.tree.batched import accept_walk
from sglang_ddtree.tree.layout import build_tree_batch_ref
from sglang_ddtree.tree.topk import full_vocab_topk, merge_shards, shard_topk

VOCAB, HIDDEN, ROWS, K, BUDGET = 1003, 16, 7, 12, 20


def _shard_bounds(vocab: int, ranks: int) -> list[tuple[int, int]]:
    per = -(-vocab // ranks)  # SGLang pads every shard to the same size; the last one is short
    return [(r * per, min(vocab, (r + 1) * per)) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_merge_equals_full_vocabulary(ranks):
    gen = torch.Generator().manual_seed(ranks)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 3).round()  # many exact ties
    parts = [shard_topk(logits[:, lo:hi], K, lo) for lo, hi in _shard_bounds(VOCAB, ranks)]
    values = torch.stack([p[0] for p in parts])
    ids = torch.stack([p[1] for p in parts])
    lse = torch.stack([p[2] for p in parts])
    merged_lp, merged_ids = merge_shards(values, ids, lse, K)
    full_lp, full_ids = full_vocab_topk(logits, K)
    assert torch.equal(merged_ids, full_ids)
    torch.testing.assert_close(merged_lp, full_lp, rtol=0, atol=2e-6)


class _GlooGroup:
    """What the draft head needs of SGLang's GroupCoordinator, over gloo."""

    def __init__(self):
        self.world_size = dist.get_world_size()

    def all_gather_into_tensor(self, out: torch.Tensor, local: torch.Tensor) -> None:
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        out.copy_(torch.cat(parts))


def _lm_head_shard(weight: torch.Tensor, rank: int, ranks: int):
    lo, hi = _shard_bounds(weight.shape[0], ranks)[rank]
    per = -(-weight.shape[0] // ranks)
    padded = torch.zeros(per, weight.shape[1])
    padded[: hi - lo] = weight[lo:hi]
    shard = SimpleNamespace(num_org_elements=hi - lo, org_vocab_start_index=lo)
    return SimpleNamespace(weight=padded, shard_indices=shard)


def _rank_main(rank: int, ranks: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        gen = torch.Generator().manual_seed(0)  # every rank holds the same full weights
        weight = torch.randn(VOCAB, HIDDEN, generator=gen)
        hidden = torch.randn(2 * (ROWS - 1), HIDDEN, generator=gen)  # bs 2, depth 6
        log_probs, ids = draft_topk(hidden, _lm_head_shard(weight, rank, ranks), K, _GlooGroup())
        trees = build_tree_batch_ref(
            log_probs.view(2, ROWS - 1, K).numpy(),
            ids.view(2, ROWS - 1, K).numpy(),
            [5, 9],
            BUDGET,
            BUDGET + 1,
        )
        # ranks sample independently; rank 0's posterior is broadcast (as the worker syncs it)
        posterior = torch.randint(
            0, VOCAB, (2, BUDGET + 1), generator=torch.Generator().manual_seed(100 + rank)
        )
        posterior[:, 0] = torch.from_numpy(trees.tokens[:, 1])  # make the walk go somewhere
        dist.broadcast(posterior, src=0)
        acceptance = accept_walk(
            torch.from_numpy(trees.tokens),
            torch.from_numpy(trees.parents),
            torch.from_numpy(trees.tree_sizes),
            posterior,
            ROWS - 1,
        )
        results[rank] = {
            "ids": ids.tolist(),
            "log_probs": log_probs.tolist(),
            "tokens": trees.tokens.tolist(),
            "parents": trees.parents.tolist(),
            "path": acceptance.path.tolist(),
        }
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_builds_the_same_tree_and_accepts_the_same_path(ranks):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(ranks, _free_port(), results), nprocs=ranks, join=True)
        results = dict(results)
    reference = results[0]
    for rank in range(1, ranks):
        assert results[rank] == reference
    # and the merged top-k is the single-rank top-k of the full vocabulary
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    hidden = torch.randn(2 * (ROWS - 1), HIDDEN, generator=gen)
    full_lp, full_ids = full_vocab_topk(hidden @ weight.T, K)
    assert reference["ids"] == full_ids.tolist()
    torch.testing.assert_close(torch.tensor(reference["log_probs"]), full_lp, rtol=0, atol=1e-5)
    assert any(length > 0 for length in [sum(p >= 0 for p in row) - 1 for row in reference["path"]])


def test_sorted_topk_equals_a_stable_descending_sort():
    from sglang_ddtree.tree.topk import sorted_topk

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(50, 300, generator=gen) * 2).round()  # ties everywhere
    x[:, ::17] = -0.0
    x[:, ::23] = float("-inf")
    values, index = sorted_topk(x, 40)
    ref = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(index, ref.indices[:, :40])
    assert torch.equal(values, ref.values[:, :40])
