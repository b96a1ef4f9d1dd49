"""Inputs and exact comparisons shared by the fast-path tests (C++ builder, emulated CUDA
kernels, CUDA kernels on a GPU): every fast path must give the reference's integers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from sglang_ddtree.kernels import cpp
from sglang_ddtree.tree.accept import accept_walk_ref
from sglang_ddtree.tree.layout import build_tree_batch_ref, pack_mask_words

TIES = ("none", "dup", "int")


def random_topk(rng: np.random.Generator, bs: int, depth: int, vocab: int, budget: int, ties: str = "none"):
    """Per-depth top-k inputs ``[bs, depth, k]`` (``k = min(budget, vocab)``, at least 1).

    ``ties``: ``"none"`` (continuous log-probs), ``"dup"`` (rounded to 1/2: duplicated
    log-probs, many equal path scores), ``"int"`` (log-probs in {0, -1, -2, -3}: exact ties
    everywhere, zeros included, the rank-tuple order decides).
    """
    k = max(1, min(budget, vocab))
    raw = -rng.exponential(2.0, size=(bs, depth, k))
    if ties == "dup":
        raw = np.round(raw * 2) / 2
    elif ties == "int":
        raw = -rng.integers(0, 4, size=(bs, depth, k)).astype(np.float64)
    lp = -np.sort(-raw, axis=-1).astype(np.float32)  # descending per row
    ids = rng.integers(0, vocab, size=(bs, depth, k)).astype(np.int64)
    return np.ascontiguousarray(lp), ids


# Inputs (ties, depth, budget, seed of random_topk, vocab 3000, one request) on which the
# heap's top is, at some pops, tied only between entries that one lane of the build kernel
# scans (node indices equal mod 32) and the earlier-popped node is not the one the rank-tuple
# order picks: the in-lane tie path. Found by searching seeds with lane_local_tie_pops.
LANE_TIE_CASES = (("dup", 3, 64, 3), ("dup", 3, 95, 82), ("int", 3, 40, 159), ("dup", 5, 40, 113))


def lane_local_tie_pops(lp, budget: int) -> int:
    """Pops of the reference search (one request, log-probs ``[depth, k]``) whose top entry is
    tied only within one lane's nodes (indices equal mod 32) and not won by the lowest index."""
    depth, k = lp.shape
    par, dep, cnt, score, path = [-1], [0], [0], [0.0], [()]
    hits = 0
    for _ in range(budget):
        entries = {
            n: score[n] + float(lp[dep[n], cnt[n]]) for n in range(len(par)) if cnt[n] < k and dep[n] < depth
        }
        if not entries:
            break
        top = max(entries.values())
        tied = [n for n, v in entries.items() if v == top]
        win = min(tied, key=lambda n: path[n] + (cnt[n],))
        hits += len(tied) > 1 and len({n % 32 for n in tied}) == 1 and win != min(tied)
        par.append(win)
        dep.append(dep[win] + 1)
        cnt.append(0)
        score.append(top)
        path.append(path[win] + (cnt[win],))
        cnt[win] += 1
    return hits


def reference_tree(lp, ids, roots, budget, width, prefix_lens):
    """The reference batch layout as a dict of numpy arrays (mask packed per request)."""
    ref = build_tree_batch_ref(lp, ids, roots, budget, width)
    words = np.stack([pack_mask_words(v) for v in ref.visibility]) if len(roots) else None
    return {
        "tokens": ref.tokens,
        "depths": ref.depths,
        "parents": ref.parents,
        "tree_sizes": ref.tree_sizes,
        "positions": ref.positions(prefix_lens),
        "mask_words": words,
    }


def assert_tree_equal(got: dict, ref: dict, context: str = "") -> None:
    for key, want in ref.items():
        have = got[key]
        if isinstance(have, torch.Tensor):
            have = have.cpu().numpy()
        assert have.shape == want.shape, f"{context} {key}: shape {have.shape} != {want.shape}"
        if not np.array_equal(have, want):
            bad = np.argwhere(have != want)[:5].tolist()
            raise AssertionError(f"{context} {key}: differs from the reference at {bad}")


def random_posterior(rng, tokens, parents, sizes, vocab: int, follow: float = 0.85) -> np.ndarray:
    """A target posterior per slot that follows a child of the slot with probability ``follow``."""
    bs, width = tokens.shape
    post = rng.integers(0, vocab, size=(bs, width)).astype(np.int64)
    for b in range(bs):
        children: dict[int, list[int]] = {}
        for c in range(1, int(sizes[b])):
            children.setdefault(int(parents[b, c]), []).append(c)
        for i, kids in children.items():
            if rng.random() < follow:
                post[b, i] = tokens[b, kids[int(rng.integers(len(kids)))]]
    return post


def reference_accept(tokens, parents, sizes, posterior, prefix_lens=None) -> dict:
    acc = accept_walk_ref(tokens, parents, sizes, posterior)
    out = {
        "path": acc.path.numpy(),
        "accept_lens": acc.accept_lens.numpy(),
        "bonus": acc.bonus.numpy(),
        "out_tokens": acc.out_tokens.numpy(),
    }
    if prefix_lens is not None:
        out["new_seq_lens"] = np.asarray(prefix_lens) + out["accept_lens"] + 1
    return out


# Draft-logit patterns for the top-k kernels: continuous, rounded (many equal logits), a few
# distinct values (massive ties), one value everywhere, -inf entries, a whole slice of -inf,
# equal maxima on both sides of every slice boundary, and a saw tooth (many candidates reach
# the bound: the kernels' sort path).
TOPK_MODES = (
    "randn",
    "round",
    "few",
    "equal",
    "neginf",
    "neginf_slice",
    "boundary",
    "sawtooth",
    "staircase",
    "ramp",
)


def topk_logits(mode: str, rows: int, vocab: int, gen: torch.Generator, slice_len: int = 0) -> torch.Tensor:
    """float32 ``[rows, vocab]`` logits of one :data:`TOPK_MODES` pattern. ``slice_len``: the
    split kernel's slice length, where ``"boundary"`` puts its ties (else every 1000)."""
    x = torch.randn(rows, vocab, generator=gen) * 3
    if mode == "round":
        x = x.round()
    elif mode == "few":
        x = torch.randint(-2, 2, (rows, vocab), generator=gen).float()
    elif mode == "equal":
        x = torch.full((rows, vocab), 1.25)
    elif mode == "neginf":
        x[:, ::3] = -float("inf")
    elif mode == "neginf_slice":
        x[:, : vocab // 2] = -float("inf")
    elif mode == "boundary":
        step = slice_len or 1000
        edges = torch.arange(step, vocab, step) if step < vocab else torch.tensor([vocab // 2])
        top = float(x.max()) + 1.0
        for offset in (-2, -1, 0, 1):
            idx = (edges + offset).clamp(0, vocab - 1)
            x[:, idx] = top
    elif mode == "sawtooth":
        x = -(torch.arange(vocab) % 2048).float().expand(rows, vocab).clone()
    elif mode == "staircase":
        # each 8-element vector one value, rising over every 2048 ids: the split kernel's
        # threads each hold one value, the last threads of a block the top ones, and k
        # threads' whole shares tie at the bound (its list's worst case)
        x = ((torch.arange(vocab) % 2048) // 8).float().expand(rows, vocab).clone()
    elif mode == "ramp":
        # rising by 80 over the row: every thread's running maximum passes the split kernel's
        # log-sum-exp slack (16) several times, so its rescales and final rebase carry the sum
        x = torch.linspace(0.0, 80.0, vocab).expand(rows, vocab) + x / 6
    return x.contiguous()


ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"


def compile_emulator():
    """The CUDA kernels' sources built for the CPU against the emulator (tests/cuda_emu)."""
    return cpp.compile_extension(
        "_ddtree_emu",
        [EMU / "emu_kernels.cpp"],
        include_dirs=[ROOT / "cuda", EMU],
        extra_flags=["-O1", "-w"],
        depends=[*sorted((ROOT / "cuda").glob("*.cu*")), EMU / "emu.h"],
    )


def run_under_triton_interpreter(script: Path) -> None:
    """Run a cases script (its ``main``) under Triton's interpreter on the CPU, in a child that
    dies with this process; it must exit 0 and print "ok" last."""
    import pytest

    pytest.importorskip("triton")
    from sglang_ddtree.launch import _parent_death_signal

    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
    out = subprocess.run(  # the child dies with this process (SIGKILL on its parent's death)
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_parent_death_signal(),
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.strip().endswith("ok")
