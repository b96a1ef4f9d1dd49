"""The CUDA kernels' logic on the CPU: cuda/*.cu compiled with g++ against a small
emulator of the CUDA subset they use (tests/cuda_emu/emu.h: every thread a cooperative
context, warp intrinsics and barriers exact), with the launchers' geometry and shared
memory, compared exactly with the reference. The GPU itself is tested by
test_kernels_gpu.py; this runs in CI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import (
    LANE_TIE_CASES,
    TIES,
    TOPK_MODES,
    assert_tree_equal,
    compile_emulator,
    lane_local_tie_pops,
    random_posterior,
    random_topk,
    reference_accept,
    reference_tree,
    topk_logits,
)

from sglang_ddtree.kernels import cpp
from sglang_ddtree.kernels.gpu import build_kernel_name, build_smem_bytes
from sglang_ddtree.kernels.topk import merge_geometry, split_plan
from sglang_ddtree.tree.accept import commit_sources_ref
from sglang_ddtree.tree.build import topk_log_probs
from sglang_ddtree.tree.layout import flat_custom_mask, unpack_mask_words

pytestmark = pytest.mark.skipif(not cpp.available(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def emu():
    return compile_emulator()


def _build(emu, lp, ids, roots, prefix, budget, width, block=256, heap_in_registers=True):
    smem, lp_in = build_smem_bytes(width, lp.shape[1], lp.shape[2])
    name = build_kernel_name(width, heap_in_registers and lp_in)
    slots = int(name.rsplit("_r", 1)[1]) if "_r" in name else 0
    keys = (
        "tokens",
        "depths",
        "parents",
        "tree_sizes",
        "positions",
        "mask_words",
    )
    return dict(
        zip(keys, emu.build_tree(lp, ids, roots, prefix, budget, width, int(lp_in), block, smem, slots))
    )


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize(
    "bs, depth, vocab, budget, extra",
    [
        (1, 7, 111, 1, 0),
        (2, 7, 111, 31, 0),  # width 32: the largest one-slot register heap
        (3, 7, 111, 31, 2),
        (3, 5, 3000, 32, 0),
        (5, 7, 3000, 33, 40),
        (2, 7, 3000, 140, 5),
        (2, 9, 3000, 159, 0),  # width 160: the largest register heap
        (2, 3, 3000, 300, 1),
    ],
)
@pytest.mark.parametrize("heap_in_registers", [True, False], ids=["registers", "shared"])
def test_build(emu, bs, depth, vocab, budget, extra, ties, heap_in_registers):
    rng = np.random.default_rng(budget * 31 + bs)
    lp, ids = random_topk(rng, bs, depth, vocab, budget, ties)
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    prefix = rng.integers(0, 9000, size=bs).astype(np.int64)
    width = budget + 1 + extra
    block = 128 if bs % 2 else 256
    got = _build(emu, lp, ids, roots, prefix, budget, width, block, heap_in_registers)
    assert_tree_equal(got, reference_tree(lp, ids, roots, budget, width, prefix), f"ties={ties}")


@pytest.mark.parametrize("ties, depth, budget, seed", LANE_TIE_CASES)
@pytest.mark.parametrize("heap_in_registers", [True, False], ids=["registers", "shared"])
def test_build_lane_local_ties(emu, ties, depth, budget, seed, heap_in_registers):
    """Exact ties between entries of one lane only: the rank tuples, not the node order, decide."""
    lp, ids = random_topk(np.random.default_rng(seed), 1, depth, 3000, budget, ties)
    assert lane_local_tie_pops(lp[0], budget) > 0  # the case still exercises the path
    roots, prefix = np.array([7], np.int64), np.array([100], np.int64)
    got = _build(emu, lp, ids, roots, prefix, budget, budget + 1, 256, heap_in_registers)
    assert_tree_equal(got, reference_tree(lp, ids, roots, budget, budget + 1, prefix))


def test_build_log_probs_outside_shared_memory(emu):
    """Large depth x k: the kernel reads the log-probs from global memory instead."""
    rng = np.random.default_rng(3)
    lp, ids = random_topk(rng, 2, 50, 5000, 1024, "dup")
    assert not build_smem_bytes(1025, 50, 1024)[1]
    roots = np.arange(2, dtype=np.int64)
    got = _build(emu, lp, ids, roots, None, 1024, 1025)
    ref = reference_tree(lp, ids, roots, 1024, 1025, np.zeros(2, np.int64))
    assert_tree_equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows, vocab, k",
    [(3, 111, 7), (2, 111, 111), (2, 4000, 64), (1, 3000, 1024), (2, 50, 1), (1, 20000, 33)],
)
def test_topk(emu, rows, vocab, k, dtype):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    paths = set()
    for mode in ("randn", "round", "few", "neginf"):
        x = topk_logits(mode, rows, vocab, gen).to(dtype)
        raw = x.numpy() if dtype == torch.float32 else x.view(torch.int16).numpy().view(np.uint16)
        code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
        lp, ids, path = emu.topk(np.ascontiguousarray(raw), code, k)
        paths.update(path.tolist())
        for r in range(rows):
            ref = topk_log_probs(x[r : r + 1], k)
            np.testing.assert_array_equal(ids[r], ref.token_ids[0], err_msg=f"{mode} row {r}")
            np.testing.assert_allclose(lp[r], ref.log_probs[0], rtol=1e-6, atol=2e-6, err_msg=mode)
    # the threshold path everywhere; the radix fallback when > 4096 keys tie at the bound
    assert 0 in paths
    if vocab >= 20000:
        assert 1 in paths


_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _raw(x: torch.Tensor) -> np.ndarray:
    """float32 values, or the 16-bit patterns of bfloat16 / float16, as the kernels read them."""
    return np.ascontiguousarray(x.numpy() if x.dtype == torch.float32 else x.view(torch.int16).numpy())


def _assert_topk_equal(x: torch.Tensor, k: int, lp, ids, what: str) -> None:
    for r in range(x.shape[0]):
        ref = topk_log_probs(x[r : r + 1], k)
        np.testing.assert_array_equal(ids[r], ref.token_ids[0], err_msg=f"{what} row {r}")
        np.testing.assert_allclose(lp[r], ref.log_probs[0], rtol=1e-6, atol=2e-6, err_msg=f"{what} row {r}")


# Kimi's vocabulary (163,840) is the emulation's slowest row: CI keeps one case of each path at
# it (one split, split and merged, overflow, register and sampled merges); the other geometries at
# that vocabulary run with `make test-slow` and, as real kernels, in the H200's kernel tests.
K26_VOCAB_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "vocab, k, splits, dtype",
    [
        (111, 7, None, torch.bfloat16),
        (111, 111, None, torch.float32),
        (111, 33, 4, torch.float16),  # slices of 32 < k: zero-padded lists
        (32000, 1, None, torch.bfloat16),
        (32000, 8, 7, torch.float32),
        (32000, 64, None, torch.bfloat16),
        (32000, 256, None, torch.float16),
        (163840, 1, None, torch.bfloat16),
        pytest.param(163840, 7, None, torch.float32, marks=K26_VOCAB_SLOW),
        pytest.param(163840, 33, 3, torch.bfloat16, marks=K26_VOCAB_SLOW),
        pytest.param(163840, 64, None, torch.bfloat16, marks=K26_VOCAB_SLOW),
        (163840, 64, 12, torch.float16),
    ],
)
def test_topk_split(emu, vocab, k, splits, dtype):
    """Every TOPK_MODES pattern as one row of a launch; exact ids, log-probs to rounding."""
    plan = split_plan(len(TOPK_MODES), vocab, k, splits=splits)
    assert plan is not None
    gen = torch.Generator().manual_seed(vocab * 7 + k)
    x = torch.cat([topk_logits(m, 1, vocab, gen, plan.slice_len) for m in TOPK_MODES]).to(dtype)
    lp, ids, counters = emu.topk_split(
        _raw(x), _DTYPE_CODE[dtype], k, plan.splits, plan.slice_len, plan.merge_chunk, plan.cap, 1
    )
    assert (counters == 0).all(), "the last block of a row must reset its counter"
    _assert_topk_equal(x, k, lp, ids, f"{plan}")


@pytest.mark.parametrize(
    "vocab, k, splits",
    [(20000, 16, 5), (4001, 7, 1), (163840, 64, 2), pytest.param(163840, 8, 9, marks=K26_VOCAB_SLOW)],
)
def test_topk_split_overflow_path(emu, vocab, k, splits):
    """A candidate list far below the slice's worst case (the smallest the merge allows): the
    blocks whose collection overflows take the k-th-candidate path and stay exact (a list
    clamped at its size would lose candidates)."""
    plan = split_plan(len(TOPK_MODES), vocab, k, splits=splits)
    merge_need = merge_geometry(plan.splits, k)[1] if plan.splits > 1 else k
    cap = 1 << (max(k, merge_need) - 1).bit_length()
    assert cap < plan.cap
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.cat([topk_logits(m, 1, vocab, gen, plan.slice_len) for m in TOPK_MODES]).to(torch.bfloat16)
    lp, ids, counters = emu.topk_split(
        _raw(x), _DTYPE_CODE[torch.bfloat16], k, plan.splits, plan.slice_len, plan.merge_chunk, cap, 1
    )
    assert (counters == 0).all()
    _assert_topk_equal(x, k, lp, ids, f"cap {cap}")


def _one_slice_row(vocab: int, k: int, slice_len: int, gen: torch.Generator) -> torch.Tensor:
    """A row whose top k all lie in one slice (the third, or the last): every other list of the
    merge ends below the whole of that one."""
    x = torch.randn(1, vocab, generator=gen)
    lo = min(2, (vocab - 1) // slice_len) * slice_len
    x[0, lo : lo + k] += 100.0
    return x


@pytest.mark.parametrize(
    "vocab, k, splits, dtype, registers",
    [
        (163840, 64, 16, torch.bfloat16, True),  # bs 1, k 64: lists of 16 threads, 3 levels across warps
        pytest.param(
            163840, 8, 32, torch.float32, True, marks=K26_VOCAB_SLOW
        ),  # bs 1, k 8: 64 threads, the last level across warps
        pytest.param(163840, 16, 16, torch.float16, True, marks=K26_VOCAB_SLOW),
        pytest.param(163840, 32, 16, torch.bfloat16, True, marks=K26_VOCAB_SLOW),
        (32000, 256, 4, torch.float32, True),  # lists of 64 threads: merge strides across warps
        (4096, 4, 2, torch.bfloat16, True),  # a thread per list, warp 0's other lanes idle
        (111, 64, 4, torch.float32, True),  # slices of 32 < k: zero-padded lists
        (120, 32, 8, torch.bfloat16, True),  # slices of 16 (the last 8): zero-padded lists
        (163840, 64, 9, torch.bfloat16, False),  # bs 8's 9 splits: the sampled merge
        pytest.param(163840, 8, 9, torch.float32, False, marks=K26_VOCAB_SLOW),
        (32000, 2, 16, torch.float32, False),  # k < 4
    ],
)
def test_topk_split_merges(emu, vocab, k, splits, dtype, registers):
    """Both stage-2 merges, exact (ties included), over every TOPK_MODES row and a row whose
    top k come from one slice."""
    plan = split_plan(len(TOPK_MODES) + 1, vocab, k, splits=splits)
    assert plan.splits == splits and (plan.merge_chunk == 0) == registers, plan
    gen = torch.Generator().manual_seed(vocab * 3 + k * splits)
    rows = [topk_logits(m, 1, vocab, gen, plan.slice_len) for m in TOPK_MODES]
    x = torch.cat([*rows, _one_slice_row(vocab, k, plan.slice_len, gen)]).to(dtype)
    lp, ids, counters = emu.topk_split(
        _raw(x), _DTYPE_CODE[dtype], k, plan.splits, plan.slice_len, plan.merge_chunk, plan.cap, 2
    )
    assert (counters == 0).all()
    _assert_topk_equal(x, k, lp, ids, f"{plan}")


def test_topk_split_workspace_reused(emu):
    """Two launches on one workspace (counters left by the first): the same exact result."""
    vocab, k = 20000, 16
    plan = split_plan(3, vocab, k, splits=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([topk_logits(m, 1, vocab, gen, plan.slice_len) for m in ("randn", "few", "boundary")])
    lp, ids, counters = emu.topk_split(
        _raw(x), 0, k, plan.splits, plan.slice_len, plan.merge_chunk, plan.cap, 2
    )
    assert (counters == 0).all()
    _assert_topk_equal(x, k, lp, ids, "second launch")


def _tree_and_posterior(rng, bs, budget, vocab=60, extra=0):
    lp, ids = random_topk(rng, bs, 6, vocab, budget, "dup")
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    tree = reference_tree(lp, ids, roots, budget, budget + 1 + extra, np.zeros(bs, np.int64))
    post = random_posterior(rng, tree["tokens"], tree["parents"], tree["tree_sizes"], vocab)
    return tree, post


@pytest.mark.parametrize("bs, budget, extra", [(1, 1, 0), (3, 31, 1), (7, 64, 0), (2, 200, 5)])
def test_accept(emu, bs, budget, extra):
    rng = np.random.default_rng(bs + budget)
    for _ in range(3):
        tree, post = _tree_and_posterior(rng, bs, budget, extra=extra)
        prefix = rng.integers(0, 100, size=bs).astype(np.int64)
        path, acc, bonus, out, new, sources, commit = emu.accept_walk(
            tree["tokens"], tree["parents"], tree["tree_sizes"], post, prefix
        )
        ref = reference_accept(tree["tokens"], tree["parents"], tree["tree_sizes"], post, prefix)
        got = {"path": path, "accept_lens": acc, "bonus": bonus, "out_tokens": out, "new_seq_lens": new}
        for key in ref:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        np.testing.assert_array_equal(sources, commit_sources_ref(ref["path"], ref["accept_lens"]))
        np.testing.assert_array_equal(commit, ref["accept_lens"] + 1)
        assert commit.dtype == np.int32


@pytest.mark.parametrize("bs, budget", [(1, 5), (4, 33), (3, 100)])
def test_flat_mask(emu, bs, budget):
    rng = np.random.default_rng(budget)
    tree, _ = _tree_and_posterior(rng, bs, budget, extra=2)
    width = budget + 3
    prefix = rng.integers(0, 70, size=bs).astype(np.int64)
    vis = torch.from_numpy(unpack_mask_words(tree["mask_words"], width))
    ref = flat_custom_mask(vis, prefix.tolist()).numpy().astype(np.uint8)
    for chunks in (1, 3):
        got = emu.flat_mask(tree["mask_words"], prefix, width, ref.size + 9, chunks, 64)
        np.testing.assert_array_equal(got[: ref.size], ref)
        assert (got[ref.size :] == 7).all(), "wrote past the mask"
    short = emu.flat_mask(tree["mask_words"], prefix, width, ref.size - 5, 2, 64)
    np.testing.assert_array_equal(short, ref[: ref.size - 5])
