"""Batched torch accept walk and commit plan == the reference, exactly."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ddtree.tree import accept_walk_ref, build_tree_batch_ref, commit_sources_ref
from sglang_ddtree.tree.batched import accept_walk, commit_sources, non_argmax_accepted
from sglang_ddtree.tree.build import topk_log_probs


def _batch(seed: int, bs: int, depth: int, vocab: int, budget: int, ties: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=gen) * 2
    if ties:
        logits = logits.round()
    k = min(budget, vocab)
    tops = [topk_log_probs(row, k) for row in logits]
    log_probs = np.stack([t.log_probs for t in tops])
    ids = np.stack([t.token_ids for t in tops])
    roots = np.arange(bs) % vocab
    width = budget + 1
    return build_tree_batch_ref(log_probs, ids, roots, budget, width), ids


def _posterior(batch, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    posterior = rng.integers(0, vocab, size=batch.tokens.shape)
    for b in range(batch.tokens.shape[0]):
        for i in range(batch.width):
            children = [c for c in range(1, int(batch.tree_sizes[b])) if batch.parents[b, c] == i]
            if children and rng.random() < 0.8:
                posterior[b, i] = batch.tokens[b, rng.choice(children)]
    return posterior


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(1, 6),
    st.integers(1, 6),
    st.integers(1, 30),
    st.integers(1, 24),
    st.booleans(),
)
def test_batched_accept_matches_reference(seed, bs, depth, vocab, budget, ties):
    batch, _ = _batch(seed, bs, depth, vocab, budget, ties)
    posterior = _posterior(batch, seed + 1, vocab)
    ref = accept_walk_ref(batch.tokens, batch.parents, batch.tree_sizes, posterior)
    got = accept_walk(
        torch.from_numpy(batch.tokens),
        torch.from_numpy(batch.parents),
        torch.from_numpy(batch.tree_sizes),
        torch.from_numpy(posterior),
        max_depth=depth,
    )
    assert got.path.tolist() == ref.path.tolist()
    assert got.accept_lens.tolist() == ref.accept_lens.tolist()
    assert got.bonus.tolist() == ref.bonus.tolist()
    assert got.out_tokens.tolist() == ref.out_tokens.tolist()

    sources = commit_sources(got.path, got.accept_lens)
    assert sources.tolist() == commit_sources_ref(ref.path.numpy(), ref.accept_lens.numpy()).tolist()
    # copying in position order is safe: a source is never a slot an earlier copy wrote
    depth = torch.arange(batch.width)[None, :]
    assert bool((sources >= depth).all())


def test_non_argmax_count():
    # one request; path root -> slot 1 (rank 0 token) -> slot 3 (rank 1 token)
    tokens = torch.tensor([[9, 4, 5, 6]])
    depths = torch.tensor([[0, 1, 2, 2]])
    path = torch.tensor([[0, 1, 3, -1]])
    top1 = torch.tensor([[4, 5]])  # depth-1 argmax 4, depth-2 argmax 5
    assert non_argmax_accepted(path, torch.tensor([2]), tokens, depths, top1).tolist() == [1]
    assert non_argmax_accepted(path, torch.tensor([1]), tokens, depths, top1).tolist() == [0]
