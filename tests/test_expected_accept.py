"""Expected accept length of best-first trees, every budget at once (CPU only)."""

import itertools
import math

import numpy as np
import pytest
import torch

from sglang_ddtree.tree import build_tree_ref, topk_log_probs
from sglang_ddtree.tree.batched import accept_walk
from sglang_ddtree.tree.expected_accept import (
    expected_accepted,
    reach_at_widths,
    reach_by_depth,
    reach_by_depth_ref,
)
from sglang_ddtree.tree.layout import build_tree_batch_ref


def random_log_probs(generator, bs, depth, vocab, k, temperature=1.0):
    logits = torch.randn((bs, depth, vocab), generator=generator, dtype=torch.float64) / temperature
    return torch.log_softmax(logits, dim=-1).sort(dim=-1, descending=True).values[..., :k]


@pytest.mark.parametrize(
    "bs, depth, vocab, k, budget",
    [(1, 1, 5, 5, 3), (3, 4, 9, 6, 16), (2, 7, 50, 8, 40), (4, 3, 4, 2, 20), (5, 15, 300, 32, 64)],
)
def test_batched_reach_matches_the_reference_builder(bs, depth, vocab, k, budget):
    generator = torch.Generator().manual_seed(bs * 100 + depth)
    log_probs = random_log_probs(generator, bs, depth, vocab, k, temperature=0.7)
    batched = reach_by_depth(log_probs, budget).numpy()
    assert batched.shape == (bs, budget + 1, depth)
    for b in range(bs):
        reference = reach_by_depth_ref(log_probs[b].float().numpy(), budget)
        np.testing.assert_allclose(batched[b], reference, rtol=1e-6, atol=1e-9)


def test_expected_accept_is_the_sum_of_the_largest_path_probabilities():
    # Brute force: every path of up to `depth` tokens, probabilities multiplied along it.
    generator = torch.Generator().manual_seed(7)
    depth, k, budget = 3, 3, 39
    log_probs = random_log_probs(generator, 1, depth, 3, k)[0]
    paths = [
        math.exp(sum(float(log_probs[d, r]) for d, r in enumerate(ranks)))
        for length in range(1, depth + 1)
        for ranks in itertools.product(range(k), repeat=length)
    ]
    largest = np.cumsum([0.0] + sorted(paths, reverse=True))
    expected = expected_accepted(reach_by_depth(log_probs[None], budget))[0].numpy()
    np.testing.assert_allclose(expected, largest[: budget + 1], rtol=1e-12)
    assert expected[-1] == pytest.approx(expected[len(paths)])  # past every node: flat


def test_reach_is_monotone_in_the_budget_and_bounded_by_one_request_per_depth():
    generator = torch.Generator().manual_seed(3)
    reach = reach_by_depth(random_log_probs(generator, 6, 5, 40, 16, temperature=0.3), 48)
    assert torch.all(reach[:, 1:] >= reach[:, :-1] - 1e-12)
    assert torch.all(reach <= 1.0 + 1e-9)  # at most one node per depth is on the accepted path
    assert torch.all(reach[:, 0] == 0)


def test_reach_at_widths_sums_the_batch_at_each_width():
    generator = torch.Generator().manual_seed(5)
    reach = reach_by_depth(random_log_probs(generator, 3, 4, 20, 8), 15)
    totals = reach_at_widths(reach, [1, 2, 9, 16])
    assert totals.shape == (4, 4)
    assert torch.all(totals[0] == 0)  # width 1: no tree, no speculation
    torch.testing.assert_close(totals[2], reach[:, 8].sum(0))


@pytest.mark.parametrize("budget", [1, 4, 12])
def test_expected_accept_matches_walks_of_a_target_that_samples_the_drafter(budget):
    """When the target's next token at every depth is drawn from the drafter's own
    distribution, the mean accept length of real walks is the prediction."""
    depth, vocab, trials = 3, 6, 6000
    generator = torch.Generator().manual_seed(budget)
    draft_logits = torch.randn((depth, vocab), generator=generator, dtype=torch.float64)
    tree = build_tree_ref(draft_logits, budget)
    layout = build_tree_batch_ref(
        topk_log_probs(draft_logits, min(budget, vocab)).log_probs[None],
        topk_log_probs(draft_logits, min(budget, vocab)).token_ids[None],
        np.array([0]),
        budget,
        budget + 1,
    )
    assert layout.tree_sizes[0] == tree.num_nodes + 1
    # A node at depth d is followed by a sample of depth d+1's distribution (depth + 1: any).
    probs = torch.softmax(torch.cat([draft_logits, torch.zeros((1, vocab))]), dim=-1)
    slot_depths = torch.from_numpy(layout.depths[0])
    samples = torch.multinomial(probs, trials, replacement=True, generator=generator)  # [depth+1, trials]
    posterior = samples[slot_depths].T  # [trials, width]
    walk = accept_walk(
        torch.from_numpy(layout.tokens).expand(trials, -1),
        torch.from_numpy(layout.parents).expand(trials, -1),
        torch.from_numpy(layout.tree_sizes).expand(trials),
        posterior,
        depth,
    )
    k = min(budget, vocab)
    predicted = expected_accepted(reach_by_depth(topk_log_probs(draft_logits, k).log_probs[None], budget))
    mean = walk.accept_lens.double().mean().item()
    stderr = walk.accept_lens.double().std().item() / math.sqrt(trials)
    assert abs(mean - predicted[0, budget].item()) < 4 * stderr + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_reach_on_the_gpu_matches_the_cpu():
    generator = torch.Generator().manual_seed(17)
    log_probs = random_log_probs(generator, 16, 15, 500, 64, temperature=0.5)
    torch.testing.assert_close(reach_by_depth(log_probs.cuda(), 63).cpu(), reach_by_depth(log_probs, 63))
