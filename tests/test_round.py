"""The reference round (``tree/round.py``) is the specification of the worker's round: the
pieces the worker chains (draft head top-k, backend build, mask, accept, commit plan) give
exactly its results on every CPU backend; and its greedy replay accepts what a plain walk
down the tree along a known output accepts (``bench/pair_eval_replay.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lab.bench.pair_eval_replay import greedy_posterior
from sglang_ddtree.adapter.draft_head import draft_topk
from sglang_ddtree.kernels import backend
from sglang_ddtree.tree.build import build_tree_from_topk, topk_log_probs
from sglang_ddtree.tree.layout import flat_custom_mask
from sglang_ddtree.tree.round import draft_k, reference_round


def _following_posterior(seed: int, vocab: int):
    """A target that often picks one of the slot's children (so rounds accept deep)."""
    rng = np.random.default_rng(seed)

    def posterior(layout, positions):
        post = rng.integers(0, vocab, size=layout.tokens.shape)
        for b in range(layout.tokens.shape[0]):
            for c in range(1, int(layout.tree_sizes[b])):
                if rng.random() < 0.7:
                    post[b, layout.parents[b, c]] = layout.tokens[b, c]
        return post

    return posterior


@pytest.mark.parametrize("name", ["python", "cpp"])
@pytest.mark.parametrize("budget, max_topk", [(12, None), (20, 3), (6, 1)])
def test_worker_pieces_match_reference_round(name, budget, max_topk):
    bs, depth, hidden_size, vocab = 4, 5, 24, 40
    gen = torch.Generator().manual_seed(budget)
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    lm_head.weight.data = torch.randn(vocab, hidden_size, generator=gen)
    hidden = torch.randn(bs * depth, hidden_size, generator=gen)
    roots = np.array([3, 1, 4, 1])
    prefix = np.array([10, 0, 7, 99])
    draft_logits = (hidden @ lm_head.weight.T).view(bs, depth, vocab)
    want = reference_round(
        draft_logits, roots, prefix, _following_posterior(1, vocab), budget, max_topk=max_topk
    )

    # the worker's order: draft head -> build -> mask -> (target) -> accept -> commit plan
    engine = backend.get_tree_backend(name)
    k = draft_k(budget, vocab, max_topk)
    log_probs, token_ids = draft_topk(hidden, lm_head, k, None, topk=engine.topk)
    prefix_t = torch.from_numpy(prefix)
    trees = engine.build(
        log_probs.view(bs, depth, k),
        token_ids.view(bs, depth, k),
        torch.from_numpy(roots),
        prefix_t,
        budget,
        budget + 1,
    )
    assert trees.tokens.tolist() == want.layout.tokens.tolist()
    assert trees.parents.tolist() == want.layout.parents.tolist()
    assert trees.positions.tolist() == want.positions.tolist()
    assert trees.mask_words.tolist() == want.mask_words.tolist()
    mask = engine.flat_mask(trees, prefix_t, prefix_t)
    assert torch.equal(mask, flat_custom_mask(torch.from_numpy(want.layout.visibility), prefix.tolist()))
    posterior = _following_posterior(1, vocab)(want.layout, want.positions)
    acc = engine.accept(trees, torch.from_numpy(posterior), prefix_t, depth)
    for field in ("path", "accept_lens", "bonus", "out_tokens", "new_seq_lens"):
        assert getattr(acc, field).tolist() == getattr(want.acceptance, field).tolist(), field
    assert acc.sources.tolist() == want.commit_sources.tolist()
    assert acc.emitted.tolist() == (want.acceptance.accept_lens + 1).tolist()
    assert int(acc.accept_lens.sum()) > 0


def _walk_along(tree, tokens: np.ndarray, a: int, block: int) -> int:
    """Accepted drafts when the target's output after position ``a`` is ``tokens[a+1:]``:
    down the tree while a child carries the next output token."""
    node, accepted = 0, 0
    for depth in range(1, block):
        if a + depth >= len(tokens):
            break
        children = [i + 1 for i in range(tree.num_nodes) if tree.parents[i + 1] == node]
        match = [c for c in children if tree.node_tokens[c - 1] == tokens[a + depth]]
        if not match:
            break
        node, accepted = match[0], accepted + 1
    return accepted


@pytest.mark.parametrize("seed", range(4))
def test_greedy_replay_accepts_the_plain_walk(seed):
    block, vocab, budget = 6, 12, 10
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (30,), generator=gen).numpy()
    total = 0
    for a in (0, 7, 26, 28):  # near the end too: the walk stops with the output
        logits = torch.randn(block - 1, vocab, generator=gen) * 2
        # make the drafter right along the output for a while
        for d in range(min(block - 1, len(tokens) - a - 1)):
            if d < seed + 1:
                logits[d, tokens[a + d + 1]] += 6.0
        result = reference_round(
            logits[None],
            tokens[a : a + 1],
            np.array([a]),
            lambda layout, positions: greedy_posterior(tokens, positions),
            budget,
        )
        tree = build_tree_from_topk(topk_log_probs(logits, min(budget, vocab)), budget)
        accepted = int(result.acceptance.accept_lens[0])
        assert accepted == _walk_along(tree, tokens, a, block)
        total += accepted
    assert total > 0
