"""The split top-k launcher's geometry (sglang_ddtree/kernels/topk.py): the shared memory it
sizes holds the merge's candidates and the k of the kernel's overflow path always, and a
slice's worst-case collection where that is small, else many times the usual ~k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ddtree.kernels import topk as tk

THREADS = 256


def _thread_counts(vocab: int, lo: int, hi: int, vec: int, row_aligned: bool) -> np.ndarray:
    """Elements each thread visits in cuda/ddtree_topk_split.cu::ddt_visit_slice."""
    counts = np.zeros(THREADS, np.int64)
    if row_aligned and lo % vec == 0:
        v_lo, v_full = lo // vec, hi // vec
        nvec = max(0, v_full - v_lo)
        counts += vec * (nvec // THREADS)
        counts[: nvec % THREADS] += vec
        lo = v_full * vec
    n = max(0, hi - lo)
    counts += n // THREADS
    counts[: n % THREADS] += 1
    return counts


@pytest.mark.parametrize("vocab", [111, 4001, 32000, 151936, 163840, 262144])
@pytest.mark.parametrize("k", [1, 7, 8, 33, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 15, 120, 960])
def test_plan_sizes_the_candidate_list(rows, vocab, k):
    if k > vocab:
        assert tk.split_plan(rows, vocab, k) is None
        return
    plan = tk.split_plan(rows, vocab, k)
    if plan is None:  # the merge would not fit: the row kernel serves it (only k 256 here)
        assert k > 128 and vocab > 163840
        return
    s, length, g, cap = plan.splits, plan.slice_len, plan.merge_chunk, plan.cap
    assert length % 8 == 0 and (s - 1) * length < vocab <= s * length
    assert cap & (cap - 1) == 0 and k <= cap <= 8192  # the overflow path collects k
    # stage 1: at most k threads hold a candidate >= the bound; where all their elements fit,
    # no block can overflow, else the list holds at least 8x the usual ~k
    worst = 0
    for split in range(s):
        lo, hi = split * length, min(vocab, (split + 1) * length)
        for vec, aligned in ((4, True), (8, True), (8, False)):
            worst = max(worst, int(np.sort(_thread_counts(vocab, lo, hi, vec, aligned))[-k:].sum()))
    assert tk.worst_candidates(length, k) >= worst
    assert cap >= min(worst, 8 * k, 2048)
    if s > 1 and g == 0:  # stage 2 in registers: 4 candidates a thread, two exchange buffers
        assert tk.register_merge(s, k) and s * k <= 4 * THREADS and 2 * s * k <= cap
    elif s > 1:  # stage 2 sampled: one sample per thread, at most (C + S) x g candidates reach the bound
        assert not tk.register_merge(s, k)
        chunks = -(-k // g)
        assert s * chunks <= THREADS
        assert (chunks + s) * g <= cap


def test_small_batches_fill_the_gpu():
    """bs 1 x 15 depths over vocab 163840: hundreds of blocks, not 15."""
    for k in (8, 16, 32, 64):
        plan = tk.split_plan(15, 163840, k, sm_count=132)
        assert 15 * plan.splits >= 200
        big = tk.split_plan(960, 163840, k, sm_count=132)
        assert big.splits == 1  # 960 rows fill the GPU: a block per row, no merge


def test_bs1_plans_merge_in_registers():
    """bs 1 (7 or 15 depths) over vocab 163840: powers of two, S x k <= 1024, so the register
    merge; bs 8 (9 splits) and k 256 over 16 splits keep the sampled merge."""
    for rows in (7, 15):
        for k in (8, 16, 32, 64):
            plan = tk.split_plan(rows, 163840, k, sm_count=132)
            assert plan.merge_chunk == 0 and plan.splits in (16, 32), (rows, k, plan)
    assert tk.split_plan(56, 163840, 64, sm_count=132).merge_chunk > 0  # 9 splits
    assert tk.split_plan(7, 163840, 256, sm_count=132).merge_chunk > 0  # 16 x 256 > 1024
    assert [tk.register_merge(s, k) for s, k in ((2, 2), (8, 128), (16, 128), (1, 64), (12, 64))] == [
        False,
        True,
        False,
        False,
        False,
    ]


def test_forced_splits_and_limits():
    assert tk.split_plan(4, 163840, 64, splits=3).cap == 2048  # 55k-entry slices: the usual list
    assert tk.split_plan(4, 163840, 64, splits=20).splits == 20
    assert tk.split_plan(4, 163840, 257) is None  # above the split kernel's k: the row kernel
    assert tk.split_plan(2, 111, 33, splits=4).slice_len == 32


@pytest.mark.parametrize("k", [8, 64, 256])
def test_workspace_covers_every_batch(k):
    ws = tk.TopkWorkspace.allocate(64 * 15, 163840, k, "cpu", sm_count=132)
    assert int(ws.counters.abs().sum()) == 0
    for rows in range(1, 64 * 15 + 1):
        plan = tk.split_plan(rows, 163840, k, sm_count=132)
        assert ws.fits(rows, k, plan.splits), rows


def test_automatic_splits_stay_in_one_wave():
    """topk_splits_h200_5ba7f73: at 448 rows (bs 64 x depth 7) one split beat two at every k
    (64.0 vs 76.7 us at k 8), two being the rounded-up fill's choice (896 blocks: 1.7 waves of
    the 528 resident)."""
    assert tk.auto_splits(448, 163840, 8, 132) == 1
    assert tk.auto_splits(960, 163840, 64, 132) == 1
    for rows in (2, 7, 56, 100, 224, 264, 300, 529):
        splits = tk.auto_splits(rows, 163840, 8, 132)
        assert rows * splits <= max(rows, 4 * 132), rows
        assert rows * (splits + 1) > 4 * 132 or splits == 32, rows


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="algorithm"):
        tk.topk_log_probs(torch.zeros(1, 8), 2, algorithm="auto")


def test_wide_k_caps_the_automatic_splits_at_16():
    """At bs 1 (7 rows, vocab 163,840) 16 splits measured faster than 32 for k >= 16."""
    assert tk.auto_splits(7, 163840, 16, 132) == 16
    assert tk.auto_splits(7, 163840, 64, 132) == 16
    assert tk.auto_splits(7, 163840, 8, 132) == 32
