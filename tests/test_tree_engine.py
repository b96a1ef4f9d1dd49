"""The worker's tree engine (``adapter/tree_builder.py``): every backend it can pick
gives the reference trees, masks and accepted paths on the worker's device, and the
draft head's top-k matches the reference. On CPU this checks the C++ and Python
backends; on a GPU (marked ``gpu``) the CUDA kernels, the flat custom mask and the
fused top-k the worker uses there."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import random_posterior, random_topk

from sglang_ddtree.kernels._cupy import cuda_available
from sglang_ddtree.tree import accept_walk_ref, build_tree_batch_ref, flat_custom_mask
from sglang_ddtree.tree.layout import pack_mask_words
from sglang_ddtree.tree.topk import full_vocab_topk


def _engine(backend: str, device: str):
    from sglang_ddtree.adapter.tree_builder import TreeEngine  # no SGLang import: runs on the GPU host

    return TreeEngine(torch.device(device), backend)


def _check_engine(backend: str, device: str, bs=5, depth=7, vocab=300, budget=24):
    rng = np.random.default_rng(11)
    log_probs, ids = random_topk(rng, bs, depth, vocab, min(budget, vocab), "dup")
    roots = rng.integers(0, vocab, size=bs)
    prefix = rng.integers(0, 50, size=bs)
    width = budget + 1
    ref = build_tree_batch_ref(log_probs, ids, roots, budget, width)
    engine = _engine(backend, device)
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
    mask = engine.flat_custom_mask(trees, torch.from_numpy(prefix).to(device), torch.from_numpy(prefix))
    expected = flat_custom_mask(torch.from_numpy(ref.visibility), prefix.tolist())
    assert torch.equal(mask.cpu(), expected)
    posterior = random_posterior(rng, ref.tokens, ref.parents, ref.tree_sizes, vocab)
    acc = engine.accept(trees, torch.from_numpy(posterior).to(device), depth)
    want = accept_walk_ref(ref.tokens, ref.parents, ref.tree_sizes, posterior)
    assert acc.path.cpu().tolist() == want.path.tolist()
    assert acc.accept_lens.cpu().tolist() == want.accept_lens.tolist()
    assert acc.out_tokens.cpu().tolist() == want.out_tokens.tolist()


@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_cpu_backends(backend):
    _check_engine(backend, "cpu")


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
