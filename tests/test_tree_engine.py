"""The worker's tree backends (``kernels/backend.py``): every backend it can pick gives
the reference trees, masks, accepted paths and commit plans on the worker's device, and
the draft head's top-k matches the reference. On CPU this checks the C++ and Python
backends; on a GPU (marked ``gpu``) the CUDA kernels, the flat custom mask and the fused
top-k the worker uses there. With the Python (or C++) backend chosen, no CUDA code runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import random_posterior, random_topk

from sglang_ddtree.kernels import _cupy, backend, gpu
from sglang_ddtree.kernels._cupy import cuda_available
from sglang_ddtree.tree import accept_walk_ref, build_tree_batch_ref, commit_sources_ref, flat_custom_mask
from sglang_ddtree.tree.layout import pack_mask_words
from sglang_ddtree.tree.topk import full_vocab_topk


def _check_engine(name: str, device: str, bs=5, depth=7, vocab=300, budget=24):
    rng = np.random.default_rng(11)
    log_probs, ids = random_topk(rng, bs, depth, vocab, min(budget, vocab), "dup")
    roots = rng.integers(0, vocab, size=bs)
    prefix = rng.integers(0, 50, size=bs)
    width = budget + 1
    ref = build_tree_batch_ref(log_probs, ids, roots, budget, width)
    engine = backend.get_tree_backend(name)
    assert engine.name == name
    trees = engine.build(
        torch.from_numpy(log_probs).to(device),
        torch.from_numpy(ids).to(device),
        torch.from_numpy(roots).to(device),
        torch.from_numpy(prefix).to(device),
        budget,
        width,
    )
    assert trees.tokens.device.type == torch.device(device).type
    assert trees.tokens.cpu().tolist() == ref.tokens.tolist()
    assert trees.parents.cpu().tolist() == ref.parents.tolist()
    assert trees.positions.cpu().tolist() == ref.positions(prefix).tolist()
    assert trees.mask_words.cpu().numpy().tolist() == pack_mask_words(ref.visibility).tolist()
    assert torch.equal(trees.visibility().cpu(), torch.from_numpy(ref.visibility))
    mask = engine.flat_mask(trees, torch.from_numpy(prefix).to(device), torch.from_numpy(prefix))
    expected = flat_custom_mask(torch.from_numpy(ref.visibility), prefix.tolist())
    assert torch.equal(mask.cpu(), expected)
    posterior = random_posterior(rng, ref.tokens, ref.parents, ref.tree_sizes, vocab)
    acc = engine.accept(
        trees, torch.from_numpy(posterior).to(device), torch.from_numpy(prefix).to(device), depth
    )
    want = accept_walk_ref(ref.tokens, ref.parents, ref.tree_sizes, posterior)
    assert acc.path.cpu().tolist() == want.path.tolist()
    assert acc.accept_lens.cpu().tolist() == want.accept_lens.tolist()
    assert acc.bonus.cpu().tolist() == want.bonus.tolist()
    assert acc.out_tokens.cpu().tolist() == want.out_tokens.tolist()
    assert acc.new_seq_lens.cpu().tolist() == (prefix + want.accept_lens.numpy() + 1).tolist()
    assert (
        acc.sources.cpu().tolist() == commit_sources_ref(want.path.numpy(), want.accept_lens.numpy()).tolist()
    )
    assert acc.emitted.dtype == torch.int32
    assert acc.emitted.cpu().tolist() == (want.accept_lens.numpy() + 1).tolist()
    top1 = torch.from_numpy(ids[:, :, 0]).to(device)
    assert engine.non_argmax_accepted(acc, trees, top1).shape == (bs,)
    lp, top_ids = engine.topk(torch.from_numpy(log_probs[:, 0, :]).to(device), 3)
    want_lp, want_ids = full_vocab_topk(torch.from_numpy(log_probs[:, 0, :]), 3)
    assert top_ids.cpu().tolist() == want_ids.tolist()
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["python", "cpp"])
def test_cpu_backends(name):
    _check_engine(name, "cpu")


class _LooksCuda(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` with True (and passes that on through torch
    ops), so code that would take a CUDA path for a CUDA tensor is tempted to here."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize("name", ["python", "cpp"])
def test_cpu_backend_runs_no_cuda_code(name, monkeypatch):
    """With a CPU backend chosen, a whole round's steps - the draft head's top-k included -
    launch no CUDA kernel and call no CUDA launcher, even when a CUDA device is present
    and the tensors claim to live on it."""
    from sglang_ddtree.adapter.draft_head import draft_topk

    calls = []

    def forbidden(what):
        def fail(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"CUDA code ran with the {name} backend: {what}")

        return fail

    monkeypatch.setattr(_cupy, "cuda_available", lambda: True)
    monkeypatch.setattr(_cupy, "kernel", forbidden("_cupy.kernel"))
    for launcher in ("topk_log_probs", "build_tree_batch", "flat_custom_mask", "accept_walk"):
        monkeypatch.setattr(gpu, launcher, forbidden(f"gpu.{launcher}"))

    engine = backend.get_tree_backend(name)
    gen = torch.Generator().manual_seed(4)
    bs, depth, hidden_size, vocab, budget = 3, 4, 16, 50, 12
    weight = torch.randn(vocab, hidden_size, generator=gen)
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    lm_head.weight.data = weight.as_subclass(_LooksCuda)
    hidden = torch.randn(bs * depth, hidden_size, generator=gen).as_subclass(_LooksCuda)
    log_probs, token_ids = draft_topk(hidden, lm_head, budget, None, topk=engine.topk)
    log_probs, token_ids = log_probs.view(bs, depth, -1), token_ids.view(bs, depth, -1)
    prefix = torch.tensor([5, 0, 17])
    roots = torch.tensor([1, 2, 3])
    trees = engine.build(log_probs, token_ids, roots, prefix, budget, budget + 1)
    engine.flat_mask(trees, prefix, prefix)
    acc = engine.accept(trees, trees.tokens.roll(-1, dims=1), prefix, depth)
    engine.non_argmax_accepted(acc, trees, token_ids[:, :, 0])
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy")
def test_cuda_backend_and_fused_draft_topk():
    _check_engine("cuda", "cuda")
    from sglang_ddtree.kernels import gpu

    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(2, 7, 163840, device="cuda", generator=gen) * 4).round().to(torch.bfloat16)
    log_probs, ids = gpu.topk_log_probs(logits, 32)
    ref_lp, ref_ids = full_vocab_topk(logits.view(-1, 163840).float(), 32)
    assert torch.equal(ids.view(-1, 32), ref_ids)
    torch.testing.assert_close(log_probs.view(-1, 32), ref_lp, rtol=0, atol=1e-4)
