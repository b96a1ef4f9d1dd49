"""The C++ CPU builder gives exactly the reference's trees and layouts; the backend choice
never fails for a missing CuPy or compiler."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    TIES,
    assert_tree_equal,
    random_topk,
    reference_tree,
)

from sglang_ddtree.config import ENV_TREE_BACKEND
from sglang_ddtree.kernels import backend, cpp
from sglang_ddtree.tree.build import build_tree_from_topk, topk_log_probs

pytestmark = pytest.mark.skipif(not cpp.available(), reason="no C++ compiler for the C++ builder")


def _run_batch(seed, bs, depth, vocab, budget, ties, extra_width=0):
    rng = np.random.default_rng(seed)
    lp, ids = random_topk(rng, bs, depth, vocab, budget, ties)
    width = budget + 1 + extra_width
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    prefix = rng.integers(0, 5000, size=bs).astype(np.int64)
    got = cpp.build_tree_batch(lp, ids, roots, budget, width, prefix, want_visibility=True)
    ref = reference_tree(lp, ids, roots, budget, width, prefix)
    assert_tree_equal(got, ref, f"seed={seed} bs={bs} budget={budget} ties={ties}")
    return got


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize(
    "bs, depth, vocab, budget",
    [
        (1, 7, 111, 1),
        (3, 7, 111, 31),
        (3, 7, 3000, 32),
        (99, 7, 111, 33),
        (99, 15, 3000, 32),
        (3, 3, 3000, 1024),
        (1, 4, 111, 1024),  # k = 111 < budget
        (3, 1, 111, 1024),  # one depth: fewer prefixes than the budget
    ],
)
def test_batch_matches_reference(bs, depth, vocab, budget, ties):
    _run_batch(
        zlib.crc32(repr((bs, depth, vocab, budget, ties)).encode()),
        bs,
        depth,
        vocab,
        budget,
        ties,
        extra_width=3,
    )


@pytest.mark.parametrize("vocab", [111, 3000])
@pytest.mark.parametrize("budget", [1, 31, 32, 33, 200])
def test_from_logits_matches_reference(vocab, budget):
    """Real top-k inputs (rounded logits: duplicated log-probs), single-request API, scores
    bit for bit."""
    gen = torch.Generator().manual_seed(vocab * 1000 + budget)
    for rounded in (False, True):
        logits = torch.randn(6, vocab, generator=gen) * 3
        if rounded:
            logits = logits.round()
        topk = topk_log_probs(logits, min(budget, vocab))
        ref = build_tree_from_topk(topk, budget)
        got = cpp.build_tree_from_topk(topk.log_probs, topk.token_ids, budget)
        for field in ("node_tokens", "depths", "parents", "ranks", "visibility"):
            np.testing.assert_array_equal(getattr(got, field), getattr(ref, field), err_msg=field)
        np.testing.assert_array_equal(got.scores.view(np.int64), ref.scores.view(np.int64))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    bs=st.integers(1, 4),
    depth=st.integers(1, 8),
    vocab=st.integers(1, 50),
    budget=st.integers(0, 90),
    extra=st.integers(0, 40),
    ties=st.sampled_from(TIES),
)
def test_batch_property(seed, bs, depth, vocab, budget, extra, ties):
    _run_batch(seed, bs, depth, vocab, budget, ties, extra_width=extra)


def test_rejects_float64_log_probs():
    with pytest.raises(TypeError, match="float32"):
        cpp.build_tree_batch(np.zeros((1, 2, 3)), np.zeros((1, 2, 3), np.int64), np.zeros(1, np.int64), 3, 4)


def test_width_too_small():
    lp, ids = random_topk(np.random.default_rng(0), 1, 3, 10, 8)
    with pytest.raises(ValueError, match="budget"):
        cpp.build_tree_batch(lp, ids, np.zeros(1, np.int64), 8, 8)


def test_missing_compiler_message(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(cpp.shutil, "which", lambda name: None)
    monkeypatch.setenv("SGLANG_DDTREE_CACHE_DIR", str(tmp_path))
    with pytest.raises(cpp.CompilerMissingError, match="C\\+\\+17 compiler"):
        cpp.compile_extension("_never_built", [cpp.CSRC_DIR / "ddtree_cpu.cpp"])


def test_backend_choice_without_cupy(monkeypatch):
    """Here (no GPU in CI) auto picks C++; a forced but absent backend raises; bad names raise."""
    monkeypatch.delenv(ENV_TREE_BACKEND, raising=False)
    if not torch.cuda.is_available():
        assert backend.select_backend() == "cpp"
        with pytest.raises(RuntimeError, match="not available"):
            backend.select_backend("cuda")
    assert backend.select_backend("python") == "python"
    monkeypatch.setenv(ENV_TREE_BACKEND, "cpp")
    assert backend.get_tree_backend().name == "cpp"
    monkeypatch.setenv(ENV_TREE_BACKEND, "fast")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_TREE_BACKEND"):
        backend.select_backend()


def test_backends_agree():
    rng = np.random.default_rng(5)
    lp, ids = random_topk(rng, 4, 5, 60, 40, "dup")
    roots = torch.from_numpy(rng.integers(0, 60, size=4))
    prefix = torch.from_numpy(rng.integers(0, 100, size=4))
    lp_t, ids_t = torch.from_numpy(lp), torch.from_numpy(ids)
    a = backend.get_tree_backend("python").build(lp_t, ids_t, roots, prefix, 40, 45)
    b = backend.get_tree_backend("cpp").build(lp_t, ids_t, roots, prefix, 40, 45)
    for key in ("tokens", "depths", "parents", "positions", "tree_sizes", "mask_words"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


def test_gpu_launchers_import_without_cupy():
    """The launcher modules import on a machine without CuPy or CUDA."""
    from sglang_ddtree.kernels import _cupy, gpu  # noqa: F401

    if not torch.cuda.is_available():
        assert not _cupy.cuda_available()
        with pytest.raises(RuntimeError, match="CuPy"):
            _cupy.require_cupy()
