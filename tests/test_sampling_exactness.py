"""Sample-and-walk keeps the target distribution exactly (accept-function level).

A toy target over 4 tokens has a different conditional distribution after every
prefix. Each trial samples one target token per tree node (given the node's
ancestors), walks the tree, and keeps the first two emitted tokens (drawing the
second from the target directly when only the bonus was emitted, exactly as the
next round would). Their joint frequency must match P(t1) P(t2 | t1) by a
chi-square test; a walk that sometimes emits the rejected draft token must fail it.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_ddtree.tree import accept_walk_ref, build_tree_ref, layout_trees, target_probs_ref

VOCAB = 4
CHI2_CRIT_DF15_P001 = 37.70  # chi-square critical value, 15 degrees of freedom, p = 0.001


def _conditional(prefix: tuple) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(prefix)) % (2**32))
    p = rng.dirichlet(np.ones(VOCAB) * 0.7)
    return p


def _trial_tokens(tree_batch, rng, trials: int, draft_on_match: bool = False):
    tokens, parents, sizes = tree_batch.tokens, tree_batch.parents, tree_batch.tree_sizes
    width = tree_batch.width
    # the ancestor token path of every slot (root token excluded: it is the context)
    paths = []
    for i in range(width):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[0, j]))
            j = int(parents[0, j])
        paths.append(tuple(reversed(path)))
    cond = np.stack([_conditional(p) for p in paths])  # [width, vocab]
    cum = np.cumsum(cond, axis=1)
    joint = np.zeros((VOCAB, VOCAB))
    for _ in range(trials):
        u = rng.random(width)
        posterior = np.minimum((u[:, None] > cum).sum(axis=1), VOCAB - 1)[None, :]
        result = accept_walk_ref(tokens, parents, sizes, posterior)
        emitted = result.out_tokens[0, : int(result.accept_lens[0]) + 1].tolist()
        if draft_on_match and rng.random() < 0.3:
            # a rejected draft token leaks into the output in place of the bonus
            last = int(result.path[0, int(result.accept_lens[0])])
            children = [c for c in range(1, width) if parents[0, c] == last]
            if children:
                emitted[-1] = int(tokens[0, children[-1]])
        if len(emitted) < 2:
            p2 = _conditional((emitted[0],))
            emitted.append(int(rng.choice(VOCAB, p=p2)))
        joint[emitted[0], emitted[1]] += 1
    return joint


def _chi_square(joint: np.ndarray) -> float:
    n = joint.sum()
    p1 = _conditional(())
    expected = np.stack([p1[a] * _conditional((a,)) for a in range(VOCAB)]) * n
    return float(((joint - expected) ** 2 / expected).sum())


def _tree():
    gen = torch.Generator().manual_seed(3)
    draft_logits = torch.randn(3, VOCAB, generator=gen)
    return layout_trees([build_tree_ref(draft_logits, budget=9)], [0], width=10)


def test_sample_and_walk_matches_target_joint_distribution():
    joint = _trial_tokens(_tree(), np.random.default_rng(0), trials=6000)
    assert _chi_square(joint) < CHI2_CRIT_DF15_P001


def test_chi_square_detects_a_biased_walk():
    joint = _trial_tokens(_tree(), np.random.default_rng(0), trials=6000, draft_on_match=True)
    # emitting the rejected draft token 30% of the time distorts P(t1)
    assert _chi_square(joint) > CHI2_CRIT_DF15_P001


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    one = torch.ones(1)
    probs = target_probs_ref(logits, one, torch.tensor([2]), one, torch.zeros(1))
    assert (probs[0, 2:] == 0).all() and abs(float(probs.sum()) - 1) < 1e-6
    probs = target_probs_ref(logits, one, torch.tensor([4]), torch.tensor([0.5]), torch.zeros(1))
    assert probs[0, 0] == 1.0  # top-p 0.5 keeps only the most likely token (p = 0.61)
