"""The tree step folded into the drafter's CUDA graph (``adapter/draft_head.py``), on CPU:
the capture hook must leave, for every batch size, exactly the trees the eager step
builds, in the rows the worker reads after a replay."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_ddtree.adapter.draft_head import DraftTreeHead
from sglang_ddtree.kernels.backend import get_tree_backend
from sglang_ddtree.tree.topk import full_vocab_topk

BLOCK, HIDDEN, VOCAB, BUDGET, WIDTH, K = 5, 16, 50, 9, 12, 6


def _head(last_position: int = 10_000) -> DraftTreeHead:
    return DraftTreeHead(
        trees_backend=get_tree_backend("python"),
        budget=BUDGET,
        width=WIDTH,
        block=BLOCK,
        k=K,
        last_position=last_position,
    )


def _propose(weight):
    return lambda hidden, k: full_vocab_topk(hidden @ weight.T, k)


def _inputs(bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bs * BLOCK, HIDDEN, generator=g)
    roots = torch.randint(0, VOCAB, (bs,), generator=g)
    input_ids = torch.full((bs, BLOCK), VOCAB - 1)
    input_ids[:, 0] = roots
    prefix_lens = torch.randint(3, 40, (bs,), generator=g, dtype=torch.int32)
    return hidden, roots, input_ids.flatten(), prefix_lens


def test_capture_hook_writes_the_eager_trees_per_batch_size():
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    head, runner = _head(), SimpleNamespace(capture_tail_hooks=[])
    seen = []

    def proposal(roots, prefix_lens, req_pool_indices):  # the batch's rows, not the padding
        seen.append((roots.clone(), prefix_lens.clone(), req_pool_indices.clone()))
        return _propose(weight)

    head.fold_into_graph(runner, proposal, max_bs=8, device="cpu")
    assert head.in_graph and len(runner.capture_tail_hooks) == 1
    hook = runner.capture_tail_hooks[0]
    for bs, seed in ((8, 1), (5, 2), (1, 3)):  # captured largest first, as SGLang does
        hidden, roots, input_ids, prefix_lens = _inputs(bs, seed)
        # the graph's static buffers are longer than the batch: padded rows past bs
        padded_ids = torch.cat([input_ids, torch.zeros(3 * BLOCK, dtype=input_ids.dtype)])
        pool_rows = torch.arange(bs + 3) + 100
        batch = SimpleNamespace(
            input_ids=padded_ids,
            seq_lens=torch.cat([prefix_lens, torch.ones(3, dtype=torch.int32)]),
            req_pool_indices=pool_rows,
        )
        hook(None, SimpleNamespace(hidden_states=hidden), batch, bs * BLOCK)
        got_roots, got_lens, got_rows = seen.pop()
        assert torch.equal(got_roots, roots) and torch.equal(got_lens, prefix_lens)
        assert torch.equal(got_rows, pool_rows[:bs])
        replayed, top1 = head.replayed(bs, WIDTH)
        for width in (1, 4, WIDTH - 1):  # a narrower step's cut (the online budget's)
            narrowed, _ = head.replayed(bs, width)
            for field in ("tokens", "depths", "parents", "positions", "tree_sizes", "mask_words"):
                assert torch.equal(getattr(narrowed, field), getattr(replayed.narrowed(width), field))
        eager, eager_top1 = head.run(hidden, roots, prefix_lens.to(torch.int64), _propose(weight))
        for field in ("tokens", "depths", "parents", "positions", "tree_sizes", "mask_words"):
            assert torch.equal(getattr(replayed, field), getattr(eager, field)), (bs, field)
        assert torch.equal(top1, eager_top1)
        assert torch.equal(replayed.tokens[:, 0], roots)  # slot 0 is the request's root
        assert (replayed.tree_sizes == BUDGET + 1).all()


def test_eager_step_uses_the_given_proposals():
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(4))
    hidden, roots, _, prefix_lens = _inputs(3, 5)
    trees, top1 = _head().run(hidden, roots, prefix_lens, _propose(weight))
    drafted = hidden.view(3, BLOCK, HIDDEN)[:, 1:, :] @ weight.T  # masked positions only
    assert torch.equal(top1, drafted.argmax(-1))
    assert not _head().in_graph


def test_positions_stay_inside_the_context():
    """Slots past a request's context are never emitted; their positions are clamped so they
    cannot index past the RoPE tables."""
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(6))
    hidden, roots, _, _ = _inputs(2, 7)
    prefix_lens = torch.tensor([95, 10])
    trees, _ = _head(last_position=97).run(hidden, roots, prefix_lens, _propose(weight))
    want = (prefix_lens[:, None] + trees.depths).clamp(max=97)
    assert torch.equal(trees.positions, want)
    assert trees.positions[0].max() == 97 and trees.depths[0].max() > 2  # clamped where it had to be
