"""CUDA kernels on a GPU == the reference, exactly (integers) - skipped without CUDA + CuPy.

Run on the GPU machine:  python -m pytest -q -m gpu tests/test_kernels_gpu.py
Every output is poisoned before each launch, so an element a kernel fails to write shows
up as a difference.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from kernel_cases import (
    LANE_TIE_CASES,
    TIES,
    TOPK_MODES,
    assert_tree_equal,
    lane_local_tie_pops,
    random_posterior,
    random_topk,
    reference_accept,
    reference_tree,
    topk_logits,
)

from sglang_ddtree.kernels._cupy import cuda_available
from sglang_ddtree.tree.accept import commit_sources_ref
from sglang_ddtree.tree.build import topk_log_probs
from sglang_ddtree.tree.layout import flat_custom_mask, unpack_mask_words
from sglang_ddtree.tree.types import Trees

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy"),
]

DEV = "cuda"
POISON = -0x5A5A5A5A5A5A5A5


def _gpu():
    from sglang_ddtree.kernels import gpu

    return gpu


def _poison(*tensors):
    for t in tensors:
        if t is None:
            continue
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
        elif t.dtype in (torch.bool, torch.uint8):
            t.fill_(1 if t.dtype == torch.bool else 7)
        else:
            t.fill_(POISON if t.dtype == torch.int64 else -0x5A5A5A5)


def _tree_on_gpu(lp, ids, roots, budget, width, prefix, heap_in_registers=True):
    gpu = _gpu()
    bs = lp.shape[0]
    out = Trees.allocate(bs, width, DEV)
    _poison(*vars(out).values())
    gpu.build_tree_batch(
        torch.from_numpy(lp).to(DEV),
        torch.from_numpy(ids).to(DEV),
        torch.from_numpy(roots).to(DEV),
        budget,
        width,
        torch.from_numpy(prefix).to(DEV),
        out=out,
        heap_in_registers=heap_in_registers,
    )
    torch.cuda.synchronize()
    return out


def _tree_dict(out):
    return {
        k: getattr(out, k).cpu().numpy()
        for k in ("tokens", "depths", "parents", "tree_sizes", "positions", "mask_words")
    }


# --------------------------------------------------------------------------- tree build


@pytest.mark.parametrize("heap_in_registers", [True, False], ids=["registers", "shared"])
@pytest.mark.parametrize("budget", [1, 31, 32, 33, 64, 95, 159, 1024])
@pytest.mark.parametrize("bs", [1, 3, 99, 257])
def test_build_matches_reference(bs, budget, heap_in_registers):
    for vocab in (111, 163840):
        for ties in TIES:
            rng = np.random.default_rng(zlib.crc32(repr((bs, budget, vocab, ties)).encode()))
            depth = 15 if budget <= 64 else 7
            lp, ids = random_topk(rng, bs, depth, vocab, budget, ties)
            roots = rng.integers(0, vocab, size=bs).astype(np.int64)
            prefix = rng.integers(0, 20000, size=bs).astype(np.int64)
            # bs 3 and 99 verify at width budget + 1: budgets 31, 95 and 159 then sit exactly
            # on the register heaps' limits (widths 32, 96, 160)
            width = budget + 1 + (bs % 3)
            out = _tree_on_gpu(lp, ids, roots, budget, width, prefix, heap_in_registers=heap_in_registers)
            ref = reference_tree(lp, ids, roots, budget, width, prefix)
            assert_tree_equal(_tree_dict(out), ref, f"bs={bs} budget={budget} vocab={vocab} ties={ties}")


@pytest.mark.parametrize("ties, depth, budget, seed", LANE_TIE_CASES)
@pytest.mark.parametrize("heap_in_registers", [True, False], ids=["registers", "shared"])
def test_build_lane_local_ties(ties, depth, budget, seed, heap_in_registers):
    """Exact ties between entries of one lane only: the rank tuples, not the node order, decide."""
    lp, ids = random_topk(np.random.default_rng(seed), 1, depth, 3000, budget, ties)
    assert lane_local_tie_pops(lp[0], budget) > 0
    roots, prefix = np.array([7], np.int64), np.array([100], np.int64)
    out = _tree_on_gpu(lp, ids, roots, budget, budget + 1, prefix, heap_in_registers=heap_in_registers)
    assert_tree_equal(_tree_dict(out), reference_tree(lp, ids, roots, budget, budget + 1, prefix))


def test_build_log_probs_from_global_memory():
    """depth x k too large to stage in shared memory: the global-memory path."""
    gpu = _gpu()
    assert not gpu.build_smem_bytes(1025, 64, 1024)[1]
    rng = np.random.default_rng(1)
    lp, ids = random_topk(rng, 5, 64, 163840, 1024, "dup")
    roots = np.arange(5, dtype=np.int64)
    prefix = np.zeros(5, np.int64)
    out = _tree_on_gpu(lp, ids, roots, 1024, 1025, prefix)
    assert_tree_equal(_tree_dict(out), reference_tree(lp, ids, roots, 1024, 1025, prefix))


def test_build_shape_checks():
    gpu = _gpu()
    lp = torch.zeros(2, 3, 4, device=DEV)
    ids = torch.zeros(2, 3, 4, dtype=torch.int64, device=DEV)
    roots = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(TypeError, match="int64"):
        gpu.build_tree_batch(lp, ids.int(), roots, 3, 4)
    with pytest.raises(ValueError, match="budget"):
        gpu.build_tree_batch(lp, ids, roots, 4, 4)
    with pytest.raises(ValueError, match="shape"):
        gpu.build_tree_batch(lp, ids[:, :2].contiguous(), roots, 3, 4)


# --------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("algorithm", ["split", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "bs, depth, vocab, ks",
    [(3, 7, 111, (1, 31, 32, 33, 111)), (2, 3, 163840, (1, 32, 33, 256, 257, 1024, 1500))],
)
def test_topk_matches_reference(bs, depth, vocab, ks, dtype, algorithm):
    gpu = _gpu()
    gen = torch.Generator().manual_seed(vocab + depth)
    for mode in ("randn", "round", "few"):
        x = torch.randn(bs, depth, vocab, generator=gen) * 4
        if mode == "round":
            x = x.round()
        elif mode == "few":
            x = torch.randint(-3, 3, (bs, depth, vocab), generator=gen).float()
        x = x.to(dtype)
        xd = x.to(DEV)
        for k in ks:
            lp = torch.empty(bs, depth, k, device=DEV)
            ids = torch.empty(bs, depth, k, dtype=torch.int64, device=DEV)
            _poison(lp, ids)
            gpu.topk_log_probs(xd, k, lp, ids, algorithm=algorithm)
            lp, ids = lp.cpu().numpy(), ids.cpu().numpy()
            for b in range(bs):
                ref = topk_log_probs(x[b], k)
                np.testing.assert_array_equal(ids[b], ref.token_ids, err_msg=f"{mode} k={k} b={b}")
                np.testing.assert_allclose(
                    lp[b], ref.log_probs, rtol=1e-5, atol=1e-5, err_msg=f"{mode} k={k}"
                )


def _assert_topk_rows(x, k, lp, ids, what):
    lp, ids = lp.cpu().numpy(), ids.cpu().numpy()
    for r in range(x.shape[0]):
        ref = topk_log_probs(x[r : r + 1], k)
        np.testing.assert_array_equal(ids[r], ref.token_ids[0], err_msg=f"{what} row {r}")
        np.testing.assert_allclose(lp[r], ref.log_probs[0], rtol=1e-5, atol=1e-5, err_msg=f"{what} row {r}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [111, 32000, 163840])
def test_topk_split_awkward_cases(vocab, dtype):
    """The emulated tests' patterns (ties across slice boundaries, -inf slices, all-equal and
    saw-tooth rows) on the GPU: automatic and forced split counts, k 1 ... 256 (both merges:
    4, 16 and 32 splits of k 8, 64 and 256 take the register merge where S x k <= 1024)."""
    from sglang_ddtree.kernels import topk as tk

    gen = torch.Generator().manual_seed(vocab)
    for k in (1, 7, 8, 33, 64, 256):
        if k > vocab:
            continue
        for splits in (None, 1, 3, 4, 12, 16, 32):
            plan = tk.split_plan(len(TOPK_MODES), vocab, k, tk._sm_count(torch.device(DEV)), splits)
            if plan is None:
                continue
            x = torch.cat([topk_logits(m, 1, vocab, gen, plan.slice_len) for m in TOPK_MODES]).to(dtype)
            lp = torch.empty(len(TOPK_MODES), k, device=DEV)
            ids = torch.empty(len(TOPK_MODES), k, dtype=torch.int64, device=DEV)
            _poison(lp, ids)
            gpu = _gpu()
            gpu.topk_log_probs(x.to(DEV), k, lp, ids, splits=splits)
            _assert_topk_rows(x, k, lp, ids, f"k={k} {plan}")


def test_topk_split_workspace_graph_replay():
    """One workspace, captured once, replayed on new logits (counters reset by every launch);
    bs 1, 8 and 64 of 15 depths share the workspace sized for 64."""
    gpu = _gpu()
    from sglang_ddtree.kernels.topk import TopkWorkspace

    depth, vocab, k = 15, 163840, 64
    ws = TopkWorkspace.allocate(64 * depth, vocab, k, DEV)
    for bs in (1, 8, 64):
        s_logits = torch.empty(bs, depth, vocab, dtype=torch.bfloat16, device=DEV)
        lp = torch.empty(bs, depth, k, device=DEV)
        ids = torch.empty(bs, depth, k, dtype=torch.int64, device=DEV)
        gpu.topk_log_probs(s_logits.normal_(), k, lp, ids, workspace=ws)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gpu.topk_log_probs(s_logits, k, lp, ids, workspace=ws)
        for seed in (1, 2):
            gen = torch.Generator().manual_seed(seed + bs)
            modes = [TOPK_MODES[(i + seed) % len(TOPK_MODES)] for i in range(bs * depth)]
            x = torch.cat([topk_logits(m, 1, vocab, gen) for m in modes]).bfloat16()
            s_logits.copy_(x.view(bs, depth, vocab))
            _poison(lp, ids)
            graph.replay()
            torch.cuda.synchronize()
            rows = slice(0, bs * depth, max(1, bs * depth // 24))  # a sample of rows: the reference is slow
            _assert_topk_rows(x[rows], k, lp.view(-1, k)[rows], ids.view(-1, k)[rows], f"bs={bs} seed={seed}")
        assert int(ws.counters.abs().sum()) == 0


def test_topk_then_build_equals_reference_on_gpu_inputs():
    """Logits -> GPU top-k -> GPU tree == the reference tree of those top-k inputs."""
    gpu = _gpu()
    gen = torch.Generator().manual_seed(0)
    bs, depth, vocab, budget = 5, 15, 163840, 64
    logits = (torch.randn(bs, depth, vocab, generator=gen) * 3).bfloat16().to(DEV)
    lp, ids = gpu.topk_log_probs(logits, budget)
    roots = torch.arange(bs, device=DEV)
    prefix = torch.arange(bs, device=DEV) * 100
    out = gpu.build_tree_batch(lp, ids, roots, budget, budget + 1, prefix)
    ref = reference_tree(
        lp.cpu().numpy(), ids.cpu().numpy(), roots.cpu().numpy(), budget, budget + 1, prefix.cpu().numpy()
    )
    assert_tree_equal(_tree_dict(out), ref)


# --------------------------------------------------------------------------- flat mask


@pytest.mark.parametrize("bs, budget", [(1, 32), (3, 33), (99, 64), (5, 1024)])
def test_flat_mask_matches_reference(bs, budget):
    gpu = _gpu()
    rng = np.random.default_rng(bs * budget)
    lp, ids = random_topk(rng, bs, 6, 1000, budget, "dup")
    width = budget + 1 + bs % 3
    prefix = rng.integers(0, 3000, size=bs).astype(np.int64)
    tree = reference_tree(lp, ids, np.zeros(bs, np.int64), budget, width, prefix)
    vis = torch.from_numpy(unpack_mask_words(tree["mask_words"], width))
    ref = flat_custom_mask(vis, prefix.tolist())
    n = gpu.flat_mask_numel(prefix.tolist(), width)
    assert n == ref.numel()
    for dtype in (torch.bool, torch.uint8):
        out = torch.empty(n + 37, dtype=dtype, device=DEV)
        _poison(out)
        gpu.flat_custom_mask(
            torch.from_numpy(tree["mask_words"]).to(DEV), torch.from_numpy(prefix).to(DEV), out
        )
        got = out.cpu()
        assert torch.equal(got[:n].bool(), ref)
        assert (got[n:].to(torch.uint8) == (1 if dtype == torch.bool else 7)).all(), "wrote past the mask"


# --------------------------------------------------------------------------- accept


@pytest.mark.parametrize("budget", [1, 32, 1024])
@pytest.mark.parametrize("bs", [1, 3, 99, 257])
def test_accept_matches_reference(bs, budget):
    gpu = _gpu()
    rng = np.random.default_rng(bs * 13 + budget)
    vocab = 111
    lp, ids = random_topk(rng, bs, 8, vocab, budget, "dup")
    width = budget + 1 + bs % 2
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    prefix = rng.integers(0, 5000, size=bs).astype(np.int64)
    tree = reference_tree(lp, ids, roots, budget, width, prefix)
    t = {k: torch.from_numpy(v).to(DEV) for k, v in tree.items()}
    out = gpu.allocate_acceptance(bs, width, DEV)
    for follow in (0.0, 0.7, 1.0):
        post = random_posterior(rng, tree["tokens"], tree["parents"], tree["tree_sizes"], vocab, follow)
        _poison(*vars(out).values())
        gpu.accept_walk(
            t["tokens"],
            t["parents"],
            t["tree_sizes"],
            torch.from_numpy(post).to(DEV),
            t["positions"][:, 0].contiguous(),
            out,
        )
        ref = reference_accept(tree["tokens"], tree["parents"], tree["tree_sizes"], post, prefix)
        for key, want in ref.items():
            np.testing.assert_array_equal(
                getattr(out, key).cpu().numpy(), want, err_msg=f"{key} follow={follow}"
            )
        want_sources = commit_sources_ref(ref["path"], ref["accept_lens"])
        np.testing.assert_array_equal(out.sources.cpu().numpy(), want_sources, err_msg=f"follow={follow}")
        np.testing.assert_array_equal(out.emitted.cpu().numpy(), ref["accept_lens"] + 1)


# --------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_and_replay():
    """top-k -> tree -> flat mask -> accept -> commit plan captured once, replayed on new inputs."""
    gpu = _gpu()
    bs, depth, vocab, budget = 8, 15, 163840, 32
    width = budget + 1
    max_prefix = 500
    s_logits = torch.empty(bs, depth, vocab, dtype=torch.bfloat16, device=DEV)
    s_roots = torch.empty(bs, dtype=torch.int64, device=DEV)
    s_prefix = torch.empty(bs, dtype=torch.int64, device=DEV)
    s_post = torch.empty(bs, width, dtype=torch.int64, device=DEV)
    lp = torch.empty(bs, depth, budget, device=DEV)
    ids = torch.empty(bs, depth, budget, dtype=torch.int64, device=DEV)
    tree = Trees.allocate(bs, width, DEV)
    acc = gpu.allocate_acceptance(bs, width, DEV)
    mask = torch.empty(bs * width * (max_prefix + width), dtype=torch.bool, device=DEV)
    sources = torch.empty(bs, width, dtype=torch.int64, device=DEV)
    slots = torch.arange(width, device=DEV)

    def step():
        gpu.topk_log_probs(s_logits, budget, lp, ids)
        gpu.build_tree_batch(lp, ids, s_roots, budget, width, s_prefix, out=tree)
        # posterior: every slot's last child (else 7): the walk goes through siblings
        is_child = tree.parents[:, None, :] == slots[None, :, None]  # [bs, parent, child]
        last = torch.where(is_child.any(-1), width - 1 - is_child.flip(-1).to(torch.int8).argmax(-1), -1)
        s_post.copy_(torch.where(last >= 0, tree.tokens.gather(1, last.clamp(min=0)), 7))
        gpu.flat_custom_mask(tree.mask_words, s_prefix, mask)
        gpu.accept_walk(tree.tokens, tree.parents, tree.tree_sizes, s_post, s_prefix, out=acc)
        sources.copy_(acc.sources)  # written by the accept kernel

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        s_logits.copy_((torch.randn(bs, depth, vocab, generator=g) * 3).bfloat16())
        s_roots.copy_(torch.randint(0, vocab, (bs,), generator=g))
        s_prefix.copy_(torch.randint(0, max_prefix, (bs,), generator=g))

    fill(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and loads every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    accepted = 0
    for seed in (2, 3, 4):
        fill(seed)
        _poison(lp, ids, sources, *vars(tree).values(), *vars(acc).values())
        graph.replay()
        torch.cuda.synchronize()
        x = s_logits.cpu()
        prefix = s_prefix.cpu().numpy()
        for b in range(bs):
            np.testing.assert_array_equal(ids[b].cpu().numpy(), topk_log_probs(x[b], budget).token_ids)
        ref = reference_tree(
            lp.cpu().numpy(), ids.cpu().numpy(), s_roots.cpu().numpy(), budget, width, prefix
        )
        assert_tree_equal(_tree_dict(tree), ref, f"replay seed={seed}")
        post = s_post.cpu().numpy()
        racc = reference_accept(ref["tokens"], ref["parents"], ref["tree_sizes"], post, prefix)
        for key, want in racc.items():
            np.testing.assert_array_equal(getattr(acc, key).cpu().numpy(), want, err_msg=key)
        accepted += int(racc["accept_lens"].sum())
        vis = torch.from_numpy(unpack_mask_words(ref["mask_words"], width))
        flat = flat_custom_mask(vis, prefix.tolist())
        assert torch.equal(mask[: flat.numel()].cpu(), flat)
        want_sources = commit_sources_ref(racc["path"], racc["accept_lens"])
        np.testing.assert_array_equal(sources.cpu().numpy(), want_sources)
    assert accepted > 0


# --------------------------------------------------------------------------- known fault
# Inputs on which the register-heap build faulted on the H200 (gpu/jobs/build_probe.py):
# one request, depth 7, vocab 4096, budget 16, k 16, duplicated log-probs (seeds 0 and 2).
FAULT_CASES = [("dup", 0), ("dup", 2)]


@pytest.mark.parametrize("ties, seed", FAULT_CASES)
def test_shared_heap_builds_the_fault_cases(ties, seed):
    """The heap the worker uses builds the reference tree where the register heap faults."""
    lp, ids = random_topk(np.random.default_rng(seed), 1, 7, 4096, 16, ties)
    roots, prefix = np.array([5]), np.array([100])
    out = _tree_on_gpu(lp, ids, roots, 16, 17, prefix, heap_in_registers=False)
    assert_tree_equal(_tree_dict(out), reference_tree(lp, ids, roots, 16, 17, prefix), f"seed={seed}")


@pytest.mark.parametrize("ties, seed", FAULT_CASES)
def test_register_heap_builds_the_former_fault_cases(ties, seed):
    """In a child process (a fault loses the CUDA context): the register heap on the inputs it
    faulted on before the build lost its child/sibling links, checked against the reference."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np; sys.path.insert(0, 'tests')\n"
        "from test_kernels_gpu import _tree_on_gpu, _tree_dict\n"
        "from kernel_cases import random_topk, assert_tree_equal, reference_tree\n"
        f"lp, ids = random_topk(np.random.default_rng({seed}), 1, 7, 4096, 16, {ties!r})\n"
        "roots, prefix = np.array([5]), np.array([100])\n"
        "out = _tree_on_gpu(lp, ids, roots, 16, 17, prefix, heap_in_registers=True)\n"
        "assert_tree_equal(_tree_dict(out), reference_tree(lp, ids, roots, 16, 17, prefix), 'regs')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-800:]
