"""Launcher of the fused draft top-k kernels (``cuda/ddtree_topk_split.cu``, ``cuda/ddtree_topk.cu``).

Reference: :func:`sglang_ddtree.tree.build.topk_log_probs` (batched): order by logit
descending, ties to the smaller token id, log-prob = logit - logsumexp(row) in float32.

Two kernels give the same result:

* ``split`` (default, k <= 256): each row's vocabulary is split over many blocks; each block
  writes its slice's top k and partial log-sum-exp to a workspace, the row's last block merges
  them (in registers where S and k are powers of two and S x k <= 1024, as at bs 1: see
  :func:`register_merge`; else through a sampled bound). The number of splits follows the row count so that small batches still fill the GPU.
  It measured faster than the row kernel at every batch size and k timed on the H200
  (bench_results/topk_kernels_h200_5ba7f73.md at the tag bench-results-archive, bs 1-64, k 8-64, depth 7 and 15).
* ``row``: one block per row (k <= 1024); the fallback above k 256 and the baseline of the
  benchmark.

Above k 1024 a torch path gives the same result. Launches go to the current torch stream and
write caller-owned buffers: with ``out_*`` and a :class:`TopkWorkspace` passed, nothing is
allocated and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._cupy import kernel, ptr

TOPK_MAX_K = 1024  # the row kernel's limit; above, torch
SPLIT_MAX_K = 256  # the split kernel's limit; above, the row kernel
KERNELS = ("split", "row")

_ROW_THREADS = 512
_SPLIT_THREADS = 256
_MERGE_PER_THREAD = 4  # candidates a thread holds in the register merge (DDT_MERGE_PER_THREAD)
# Candidate slots of a block (8 bytes each) where its slice's worst case needs more: a block
# collects about k candidates (up to k x a thread's elements in a massive tie), so 2048 slots
# leave 8x headroom at k 256 and 32x at k 64; a block that overflows them takes the kernel's
# exact k-th-candidate path.
_CAP_USUAL = 2048
_CAP_MAX = 8192  # shared-memory limit of a plan (64 KiB)
_AUTO_SPLITS_MAX = 32  # more splits make the merge (S x k candidates) the slow part
_AUTO_SPLITS_MAX_WIDE_K = (
    16  # k >= 16: 16 splits beat 32 at bs 1 (topk_kernels_h200: 14.3 vs 16.4 us at k 16)
)
_WIDE_K = 16
_BLOCKS_PER_SM = 4  # resident blocks of the split kernel (its launch bounds)
_AUTO_SLICE_MIN = 2048  # shorter slices cost more in fixed per-block work than they save
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SPLIT_KERNELS = {
    torch.float32: "ddtree_topk_split_f32",
    torch.bfloat16: "ddtree_topk_split_bf16",
    torch.float16: "ddtree_topk_split_f16",
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _elements_per_thread(slice_len: int) -> int:
    """An upper bound of one thread's elements in a slice, for every dtype and load path
    (the +1 vector covers the scalar tail of a row)."""
    return 8 * (_ceil_div(_ceil_div(slice_len, 8), _SPLIT_THREADS) + 1)


def _merge_chunk(splits: int, k: int) -> int:
    """The smallest chunk g with ``splits * ceil(k / g)`` samples, one per thread."""
    g = max(1, _ceil_div(splits * k, _SPLIT_THREADS))
    while splits * _ceil_div(k, g) > _SPLIT_THREADS:
        g += 1
    return g


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def register_merge(splits: int, k: int) -> bool:
    """Whether the row's last block merges the sorted lists in registers (the kernel's
    ``ddt_topk_merge_lists``): the lists pair up level by level and split over threads
    ``_MERGE_PER_THREAD`` candidates each, so S and k are powers of two, k >= 4, S x k <= 4 x 256."""
    return (
        splits > 1
        and _power_of_two(splits)
        and _power_of_two(k)
        and _MERGE_PER_THREAD <= k
        and splits * k <= _MERGE_PER_THREAD * _SPLIT_THREADS
    )


def merge_geometry(splits: int, k: int) -> tuple[int, int]:
    """(g, slots) of a merge of ``splits`` lists: the merge chunk (0: the register merge) and
    the candidate slots it needs in shared memory (the register merge's two exchange buffers of
    S x k; the sampled merge's (C + S) x g candidates that can reach its bound)."""
    if register_merge(splits, k):
        return 0, 2 * splits * k
    g = _merge_chunk(splits, k)
    return g, (_ceil_div(k, g) + splits) * g


@dataclass(frozen=True)
class SplitPlan:
    """Geometry of one split top-k launch (see ``cuda/ddtree_topk_split.cu``)."""

    splits: int  # blocks per row
    slice_len: int  # vocabulary entries per block, a multiple of 8
    merge_chunk: int  # g: list chunk per merge sample; 0: the lists merge in registers
    cap: int  # candidate slots in shared memory, a power of two

    @property
    def smem_bytes(self) -> int:
        return 8 * self.cap


def auto_splits(rows: int, vocab: int, k: int, sm_count: int) -> int:
    """As many splits as fit in one wave of resident blocks; one per row once the rows fill it.

    Rounded down, not up: a second, partial wave costs more than the merge of fewer, longer
    slices saves (topk_splits_h200_5ba7f73: 448 rows at k 8 / 64 took 64.0 / 77.1 us with 1 split,
    76.7 / 95.8 with 2, the first of which the rounded-up fill had chosen).
    """
    fill = max(1, _BLOCKS_PER_SM * sm_count // max(rows, 1))
    cap = _AUTO_SPLITS_MAX_WIDE_K if k >= _WIDE_K else _AUTO_SPLITS_MAX
    return min(fill, cap, max(1, vocab // _AUTO_SLICE_MIN))  # each term >= 1


def worst_candidates(slice_len: int, k: int) -> int:
    """The most candidates a block can collect over a slice (k threads' elements each)."""
    return max(k, k * _elements_per_thread(slice_len))


def split_plan(
    rows: int, vocab: int, k: int, sm_count: int = 132, splits: int | None = None
) -> SplitPlan | None:
    """The split kernel's geometry, or None when it cannot serve (k > 256, or the merge's
    candidates would not fit in shared memory); ``splits`` overrides the automatic choice."""
    if not 1 <= k <= min(SPLIT_MAX_K, vocab):
        return None
    want = auto_splits(rows, vocab, k, sm_count) if splits is None else int(splits)
    want = max(1, min(want, _ceil_div(vocab, 8)))
    slice_len = 8 * _ceil_div(_ceil_div(vocab, want), 8)
    n_splits = _ceil_div(vocab, slice_len)
    if n_splits > _SPLIT_THREADS:
        return None
    need = min(worst_candidates(slice_len, k), max(_CAP_USUAL, k))
    g = 1
    if n_splits > 1:
        g, merge_slots = merge_geometry(n_splits, k)
        need = max(need, merge_slots)
    cap = 1 << (need - 1).bit_length()
    if cap > _CAP_MAX:
        return None
    return SplitPlan(n_splits, slice_len, g, cap)


@dataclass
class TopkWorkspace:
    """Caller-owned scratch of the split kernel: per (row, split) the slice's top k and
    partial log-sum-exp, and a per-row counter that must be zero before the first launch
    (each launch leaves it zero). One workspace per stream: launches sharing one must not
    overlap."""

    candidates: torch.Tensor  # int64 [>= rows * splits * k]
    partials: torch.Tensor  # float32 [>= rows * splits * 2]
    counters: torch.Tensor  # int32 [>= rows], zero

    @classmethod
    def allocate(cls, rows: int, vocab: int, k: int, device, sm_count: int | None = None) -> TopkWorkspace:
        """Enough for every automatic launch of up to ``rows`` rows with this vocab and k."""
        sm = sm_count if sm_count is not None else _sm_count(torch.device(device))
        lists = max(r * auto_splits(r, vocab, k, sm) for r in range(1, max(rows, 1) + 1))
        return cls.for_splits(1, k, lists, device, counters=rows)

    @classmethod
    def for_splits(cls, rows: int, k: int, splits: int, device, counters: int | None = None) -> TopkWorkspace:
        """Exactly enough for ``rows`` rows of ``splits`` splits (``counters`` rows of counters)."""
        n = max(1, rows * splits)
        return cls(
            candidates=torch.empty(n * k, dtype=torch.int64, device=device),
            partials=torch.empty(2 * n, dtype=torch.float32, device=device),
            counters=torch.zeros(max(1, counters or rows), dtype=torch.int32, device=device),
        )

    def fits(self, rows: int, k: int, splits: int) -> bool:
        return (
            self.candidates.numel() >= rows * splits * k
            and self.partials.numel() >= 2 * rows * splits
            and self.counters.numel() >= rows
        )


@functools.cache
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def topk_log_probs(
    draft_logits: torch.Tensor,
    k: int,
    out_log_probs: torch.Tensor | None = None,
    out_token_ids: torch.Tensor | None = None,
    workspace: TopkWorkspace | None = None,
    splits: int | None = None,
    algorithm: str = "split",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k log-probs and token ids of draft logits, ties to the smaller id.

    Parameters
    ----------
    draft_logits : float32 / bfloat16 / float16 ``[..., vocab]`` (e.g. ``[bs, depth, vocab]``),
        contiguous, on the GPU.
    k : int, ``1 <= k <= vocab``.
    out_log_probs : float32 ``[..., k]`` or None (allocated).
    out_token_ids : int64 ``[..., k]`` or None (allocated).
    workspace : :class:`TopkWorkspace` or None (allocated per call when the split kernel runs).
    splits : blocks per row of the split kernel (None: from the row count and the GPU).
    algorithm : ``"split"`` (the row kernel where its plan cannot serve) or ``"row"`` (one
        block per row, the benchmark's baseline); the result is the same.

    Returns
    -------
    (log_probs, token_ids)
        float32 ``[..., k]`` (``logit - logsumexp(row)``, descending) and int64 ``[..., k]``.
    """
    if draft_logits.dtype not in _DTYPE_CODE:
        raise TypeError(f"draft_logits must be float32, bfloat16 or float16, got {draft_logits.dtype}")
    if algorithm not in KERNELS:
        raise ValueError(f"algorithm must be one of {KERNELS}, got {algorithm!r}")
    lead, vocab = tuple(draft_logits.shape[:-1]), int(draft_logits.shape[-1])
    k = int(k)
    if not 1 <= k <= vocab:
        raise ValueError(f"need 1 <= k <= vocab, got k={k}, vocab={vocab}")
    _check(draft_logits, "draft_logits", draft_logits.dtype, [*lead, vocab])
    dev = draft_logits.device
    if out_log_probs is None:
        out_log_probs = torch.empty((*lead, k), dtype=torch.float32, device=dev)
    if out_token_ids is None:
        out_token_ids = torch.empty((*lead, k), dtype=torch.int64, device=dev)
    _check(out_log_probs, "out_log_probs", torch.float32, [*lead, k])
    _check(out_token_ids, "out_token_ids", torch.int64, [*lead, k])
    rows = draft_logits.numel() // max(vocab, 1)
    if rows == 0:
        return out_log_probs, out_token_ids
    plan = split_plan(rows, vocab, k, _sm_count(dev), splits) if algorithm == "split" else None
    if plan is not None:
        _launch_split(draft_logits, rows, vocab, k, plan, workspace, out_log_probs, out_token_ids)
    elif k <= TOPK_MAX_K:
        _launch_row(draft_logits, rows, vocab, k, out_log_probs, out_token_ids)
    else:
        lp, ids = topk_log_probs_torch(draft_logits, k)
        out_log_probs.copy_(lp)
        out_token_ids.copy_(ids)
    return out_log_probs, out_token_ids


# The split kernel's benchmark cut points (``DDT_TOPK_CUT`` in cuda/ddtree_topk_split.cu).
SPLIT_CUTS = {
    5: "slice read, max only",
    6: "log-sum-exp",
    1: "per-thread sample (slice read)",
    2: "bound and lse",
    4: "candidates collected",
    3: "candidates ranked",
    0: "merge (full kernel)",
}


def split_kernel_cut(draft_logits, k: int, cut: int, workspace: TopkWorkspace, out_lp, out_ids) -> None:
    """Benchmark only: the split kernel (automatic plan) stopped after ``cut`` (:data:`SPLIT_CUTS`;
    0 is the whole kernel). A cut leaves the outputs unwritten and the row counters as they were."""
    rows, vocab = draft_logits.numel() // draft_logits.shape[-1], draft_logits.shape[-1]
    plan = split_plan(rows, vocab, k, _sm_count(draft_logits.device))
    _launch_split(draft_logits, rows, vocab, k, plan, workspace, out_lp, out_ids, cut)


def _launch_split(logits, rows, vocab, k, plan: SplitPlan, workspace, out_lp, out_ids, cut: int = 0) -> None:
    if workspace is None:
        workspace = TopkWorkspace.for_splits(rows, k, plan.splits, logits.device)
    elif not workspace.fits(rows, k, plan.splits):
        raise ValueError(f"workspace too small for {rows} rows x {plan.splits} splits x k={k}")
    defines = (f"DDT_TOPK_CUT={cut}",) if cut else ()
    kernel("ddtree_topk_split", _SPLIT_KERNELS[logits.dtype], defines)(
        (rows * plan.splits,),
        (_SPLIT_THREADS,),
        (
            ptr(logits),
            vocab,
            vocab,
            k,
            plan.splits,
            plan.slice_len,
            plan.merge_chunk,
            plan.cap,
            ptr(workspace.candidates),
            ptr(workspace.partials),
            ptr(workspace.counters),
            ptr(out_lp),
            ptr(out_ids),
        ),
        shared_mem=plan.smem_bytes,
    )


def _launch_row(logits, rows, vocab, k, out_lp, out_ids) -> None:
    kernel("ddtree_topk", "ddtree_topk_logprobs")(
        (rows,),
        (_ROW_THREADS,),
        (
            ptr(logits),
            _DTYPE_CODE[logits.dtype],
            vocab,
            vocab,
            k,
            ptr(out_lp),
            ptr(out_ids),
            0,  # path_taken: not recorded
        ),
    )


def topk_log_probs_torch(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-only version of :func:`topk_log_probs` (any device, any k): ``torch.topk`` on
    an int64 key (orderable float bits, inverted id), so ties go to the smaller id."""
    from ..tree.topk import sorted_topk

    x = draft_logits.float()
    values, top_ids = sorted_topk(x, k)
    return values - torch.logsumexp(x, dim=-1, keepdim=True), top_ids
