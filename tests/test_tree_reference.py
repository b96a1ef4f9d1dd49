"""The reference tree builder and accept walk: hand-worked cases and properties."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ddtree.tree import (
    TopK,
    accept_walk_ref,
    ancestor_visibility,
    build_tree_from_topk,
    build_tree_ref,
    layout_trees,
    max_tree_nodes,
    topk_log_probs,
)


def _topk(probs_by_depth, ids_by_depth) -> TopK:
    return TopK(
        np.log(np.asarray(probs_by_depth, dtype=np.float32)), np.asarray(ids_by_depth, dtype=np.int64)
    )


def test_golden_tree_worked_by_hand():
    # depth 1: p = .7 .2 .1 on tokens 2 0 1; depth 2: p = .6 .3 .1 on tokens 1 2 0.
    # Pops: (0)=.7, (0,0)=.42, (0,1)=.21, (1)=.2 -> budget 4 stops there.
    tree = build_tree_from_topk(_topk([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]], [[2, 0, 1], [1, 2, 0]]), budget=4)
    assert tree.node_tokens.tolist() == [2, 1, 2, 0]
    assert tree.depths.tolist() == [1, 2, 2, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0]
    assert tree.ranks.tolist() == [0, 0, 1, 1]
    np.testing.assert_allclose(np.exp(tree.scores), [0.7, 0.42, 0.21, 0.2], rtol=1e-6)
    assert tree.visibility.astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ]


def test_build_tree_ref_from_logits_matches_topk_path():
    torch.manual_seed(0)
    logits = torch.randn(5, 40, dtype=torch.bfloat16)
    tree = build_tree_ref(logits, budget=12)
    expected = build_tree_from_topk(topk_log_probs(logits, 12), 12)
    assert tree.node_tokens.tolist() == expected.node_tokens.tolist()
    assert tree.parents.tolist() == expected.parents.tolist()
    assert tree.num_nodes == 12


def test_topk_ties_go_to_smaller_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    top = topk_log_probs(logits, 3)
    assert top.token_ids.tolist() == [[1, 2, 4]]


def test_budget_larger_than_possible_tree():
    tree = build_tree_ref(torch.randn(2, 3), budget=100)
    assert tree.num_nodes == max_tree_nodes(2, 3) == 12


def test_empty_budget():
    tree = build_tree_ref(torch.randn(3, 5), budget=0)
    assert tree.num_nodes == 0 and tree.parents.tolist() == [-1]


# --- properties -----------------------------------------------------------------------

logit_arrays = st.tuples(
    st.integers(1, 5),  # depth
    st.integers(1, 12),  # vocab
    st.integers(1, 40),  # budget
    st.integers(0, 2**31 - 1),  # seed
    st.booleans(),  # force ties (integer logits)
)


def _random_tree(depth, vocab, budget, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=gen) * 2
    if ties:
        logits = logits.round()
    return logits, build_tree_ref(logits, budget)


def _rank_path(tree, i):
    path = []
    while i > 0:
        path.append(int(tree.ranks[i - 1]))
        i = int(tree.parents[i])
    return tuple(reversed(path))


@settings(max_examples=200, deadline=None)
@given(logit_arrays)
def test_tree_structure_properties(case):
    depth, vocab, budget, seed, ties = case
    logits, tree = _random_tree(depth, vocab, budget, seed, ties)
    n = tree.num_nodes
    k = min(budget, vocab)
    assert n == min(budget, max_tree_nodes(depth, k))
    assert tree.parents[0] == -1
    node_depths = np.concatenate([[0], tree.depths])
    for i in range(1, n + 1):
        parent = tree.parents[i]
        assert 0 <= parent < i
        assert node_depths[i] == node_depths[parent] + 1
    assert (tree.visibility == ancestor_visibility(tree.parents)).all()
    # siblings carry distinct tokens
    for parent in set(tree.parents[1:].tolist()):
        children = [tree.node_tokens[i - 1] for i in range(1, n + 1) if tree.parents[i] == parent]
        assert len(children) == len(set(children))


@settings(max_examples=150, deadline=None)
@given(logit_arrays)
def test_tree_is_the_best_prefixes_in_key_order(case):
    """Pop order == sort by (-score, rank tuple) over *all* prefixes, first budget."""
    depth, vocab, budget, seed, ties = case
    if max_tree_nodes(depth, min(budget, vocab)) > 3000:
        return
    logits, tree = _random_tree(depth, vocab, budget, seed, ties)
    top = topk_log_probs(logits, min(budget, vocab))
    lp = top.log_probs.astype(np.float64)
    k = lp.shape[1]
    keys = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = 0.0
            for level, r in enumerate(ranks):
                score = score + lp[level, r]
            keys.append((-score, ranks))
    keys.sort()
    expected = [ranks for _, ranks in keys[: tree.num_nodes]]
    assert [_rank_path(tree, i) for i in range(1, tree.num_nodes + 1)] == expected
    expected_tokens = [int(top.token_ids[len(r) - 1, r[-1]]) for r in expected]
    assert tree.node_tokens.tolist() == expected_tokens


@settings(max_examples=150, deadline=None)
@given(logit_arrays, st.integers(0, 2**31 - 1))
def test_accepted_path_follows_tree_edges(case, walk_seed):
    depth, vocab, budget, seed, ties = case
    _, tree = _random_tree(depth, vocab, budget, seed, ties)
    batch = layout_trees([tree], [7], tree.num_nodes + 1)
    rng = np.random.default_rng(walk_seed)
    # a posterior that often matches a child: pick a random child's token or noise
    posterior = rng.integers(0, vocab, size=(1, batch.width))
    for i in range(batch.width):
        children = [c for c in range(1, batch.width) if batch.parents[0, c] == i]
        if children and rng.random() < 0.7:
            posterior[0, i] = batch.tokens[0, rng.choice(children)]
    result = accept_walk_ref(batch.tokens, batch.parents, batch.tree_sizes, posterior)
    length = int(result.accept_lens[0])
    path = result.path[0]
    assert path[0] == 0
    for d in range(1, length + 1):
        assert batch.parents[0, path[d]] == path[d - 1]
        assert batch.tokens[0, path[d]] == posterior[0, path[d - 1]]
        assert result.out_tokens[0, d - 1] == posterior[0, path[d - 1]]
    # the walk stopped because no child matches
    last = path[length]
    assert not any(
        batch.parents[0, c] == last and batch.tokens[0, c] == posterior[0, last]
        for c in range(1, batch.width)
    )
    assert result.bonus[0] == posterior[0, last] == result.out_tokens[0, length]
    assert (path[length + 1 :] == -1).all()


def test_padding_slots_are_never_accepted():
    tree = build_tree_from_topk(_topk([[0.9, 0.1]], [[5, 6]]), budget=2)
    batch = layout_trees([tree], [1], width=6)  # 3 real slots, 3 padding
    assert batch.tokens[0].tolist() == [1, 5, 6, 1, 1, 1]
    posterior = np.array([[1, 0, 0, 0, 0, 0]])  # root's posterior = padding's token
    result = accept_walk_ref(batch.tokens, batch.parents, batch.tree_sizes, posterior)
    assert result.accept_lens.tolist() == [0] and result.bonus.tolist() == [1]
    assert batch.visibility[0, 4].tolist() == [False, False, False, False, True, False]


def test_scores_are_monotone_along_successors():
    """Why a parallel builder may select instead of pop: no successor beats its
    predecessor, so the pop order is the key order."""
    torch.manual_seed(1)
    tree = build_tree_ref(torch.randn(6, 50) * 3, budget=300)
    assert all(tree.scores[i] >= tree.scores[i + 1] for i in range(len(tree.scores) - 1))
    assert not math.isnan(tree.scores.sum())
