"""Typed launchers of the CUDA kernels (``cuda/*.cu``), one per reference function.

Every launcher checks shapes and dtypes on the host (no device synchronisation), writes
only caller-owned output tensors (allocated here only when ``out`` is None), and launches
on ``torch.cuda.current_stream()``: with preallocated outputs the launches can be captured
in a CUDA graph and replayed. CuPy compiles each kernel module on first use.

=========================================  ===========================================
launcher                                   reference (``sglang_ddtree.tree``)
=========================================  ===========================================
:func:`topk_log_probs` (``topk.py``)       ``build.topk_log_probs`` (batched)
:func:`build_tree_batch`                   ``layout.build_tree_batch_ref`` + ``pack_mask_words``
:func:`flat_custom_mask`                   ``layout.flat_custom_mask``
:func:`accept_walk`                        ``accept.accept_walk_ref``
=========================================  ===========================================

Integer outputs are identical to the references (``tests/test_kernels_gpu.py``); top-k
log-prob values differ from the CPU reference only by the rounding of the log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tree.types import Acceptance, Trees
from ._cupy import kernel, ptr
from .topk import TOPK_MAX_K, TopkWorkspace, topk_log_probs, topk_log_probs_torch  # noqa: F401 - top-k launcher

_BUILD_THREADS = 256
_SMEM_MAX = 227 * 1024  # per-block opt-in limit of sm_90


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


# =========================================================================== tree build


def build_smem_bytes(width: int, depth: int, k: int) -> tuple[int, bool]:
    """Dynamic shared memory of the build kernel and whether the log-probs are staged there."""
    # u64 fkey, f64 score and four int arrays per slot, as cuda/ddtree_tree.cu lays them out
    base = 32 * width + 16
    if base > _SMEM_MAX:
        raise ValueError(
            f"verify width {width} is too large for the GPU builder (max ~{(_SMEM_MAX - 16) // 32})"
        )
    with_lp = base + 4 * depth * k
    return (with_lp, True) if with_lp <= 160 * 1024 else (base, False)


# Register-heap variants of the build kernel: ddtree_build_tree_r<R> holds R heap slots per
# lane in registers and serves widths up to 32 * R; wider trees use the shared-memory heap.
HEAP_REGISTER_SLOTS = (1, 2, 3, 5)


def build_kernel_name(width: int, heap_in_registers: bool = True) -> str:
    """The build kernel for verify width ``width``: the smallest register heap that holds it."""
    if heap_in_registers:
        for slots in HEAP_REGISTER_SLOTS:
            if width <= 32 * slots:
                return f"ddtree_build_tree_r{slots}"
    return "ddtree_build_tree"


def _check_trees(trees: Trees, bs: int, width: int) -> None:
    for name in ("tokens", "depths", "parents", "positions"):
        _check(getattr(trees, name), f"out.{name}", torch.int64, [bs, width])
    _check(trees.tree_sizes, "out.tree_sizes", torch.int64, [bs])
    _check(trees.mask_words, "out.mask_words", torch.int32, [bs, width, (width + 31) // 32])


def build_tree_batch(
    log_probs: torch.Tensor,
    token_ids: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    width: int,
    prefix_lens: torch.Tensor | None = None,
    out: Trees | None = None,
    heap_in_registers: bool = False,
) -> Trees:
    """Build every request's draft tree and its verify layout, one block per request.

    Same trees as :func:`sglang_ddtree.tree.layout.build_tree_batch_ref` (tokens, depths,
    parents, tree sizes) plus positions and the bit-packed ancestor mask of
    :func:`~sglang_ddtree.tree.layout.pack_mask_words`.

    Parameters
    ----------
    log_probs : float32 ``[bs, depth, k]``, per-depth top-k log-probs, descending.
    token_ids : int64 ``[bs, depth, k]``.
    root_tokens : int64 ``[bs]``, the token each tree grows from (slot 0).
    budget : int, nodes per tree (root excluded), ``0 <= budget <= width - 1``.
    width : int, verify width ``W``.
    prefix_lens : int64 ``[bs]`` or None; positions are ``prefix_lens + depth``.
    out : :class:`~sglang_ddtree.tree.types.Trees` for ``(bs, width)`` or None (allocated);
        preallocated outputs let a CUDA graph capture the launch.
    heap_in_registers : use the register-heap kernel when the width allows. Off by default:
        on the H200 the register heap faults (illegal address) on some tied inputs at budget
        16 / k 16 / depth 7, which the CPU emulator does not reproduce
        (``gpu/jobs/build_probe.py``; ``tests/test_kernels_gpu.py::test_register_heap_tie_fault``).
        The shared-memory heap builds the same trees and passed every probed case.

    Returns
    -------
    Trees
        ``tokens``, ``depths``, ``parents``, ``positions`` ``[bs, W]`` int64;
        ``tree_sizes [bs]`` int64; ``mask_words [bs, W, ceil(W/32)]`` int32.
    """
    bs, depth, k = (int(s) for s in log_probs.shape) if log_probs.dim() == 3 else (0, 0, 0)
    _check(log_probs, "log_probs", torch.float32, [None, None, None])
    _check(token_ids, "token_ids", torch.int64, [bs, depth, k])
    _check(root_tokens, "root_tokens", torch.int64, [bs])
    if prefix_lens is not None:
        _check(prefix_lens, "prefix_lens", torch.int64, [bs])
    budget, width = int(budget), int(width)
    if budget < 0 or width < budget + 1:
        raise ValueError(f"need 0 <= budget <= width - 1, got budget={budget}, width={width}")
    if out is None:
        out = Trees.allocate(bs, width, log_probs.device)
    _check_trees(out, bs, width)
    if bs == 0:
        return out
    smem, lp_in_smem = build_smem_bytes(width, depth, k)
    # the register heaps read the log-probs from shared memory: staged or not at all
    kernel("ddtree_tree", build_kernel_name(width, heap_in_registers and lp_in_smem))(
        (bs,),
        (_BUILD_THREADS,),
        (
            ptr(log_probs),
            ptr(token_ids),
            ptr(root_tokens),
            ptr(prefix_lens),
            depth,
            k,
            budget,
            width,
            int(lp_in_smem),
            ptr(out.tokens),
            ptr(out.depths),
            ptr(out.parents),
            ptr(out.tree_sizes),
            ptr(out.positions),
            ptr(out.mask_words),
        ),
        shared_mem=smem,
    )
    return out


# =========================================================================== flat mask


def flat_mask_numel(prefix_lens: Sequence[int], width: int) -> int:
    """Elements of the flat custom mask for host-side ``prefix_lens``."""
    return sum(int(width) * (int(p) + int(width)) for p in prefix_lens)


def flat_custom_mask(
    mask_words: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    chunks: int = 16,
) -> torch.Tensor:
    """SGLang's flat verify ``custom_mask`` from the packed ancestor mask.

    Per request ``b``, row-major ``[W, prefix_lens[b] + W]`` (prefix all True, the tree
    block from ``mask_words``), concatenated over the batch; the offsets are computed on
    the device, so nothing is read back to the host.

    Parameters
    ----------
    mask_words : int32 ``[bs, W, ceil(W/32)]``.
    prefix_lens : int64 ``[bs]`` on the GPU.
    out : bool or uint8 ``[N]``, ``N >= sum_b W * (prefix_lens[b] + W)`` (see
        :func:`flat_mask_numel`); elements past the mask are left untouched, writes past
        ``N`` are dropped.
    chunks : blocks per request.

    Returns
    -------
    out
    """
    if mask_words.dim() != 3:
        raise ValueError(f"mask_words must be [bs, W, ceil(W/32)], got {list(mask_words.shape)}")
    bs, width, nw = (int(s) for s in mask_words.shape)
    if nw != (width + 31) // 32:
        raise ValueError(f"mask_words must be [bs, W, ceil(W/32)], got {list(mask_words.shape)}")
    _check(mask_words, "mask_words", torch.int32, [bs, width, nw])
    _check(prefix_lens, "prefix_lens", torch.int64, [bs])
    if out.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"out must be bool or uint8, got {out.dtype}")
    _check(out, "out", out.dtype, [None])
    if bs == 0:
        return out
    kernel("ddtree_tree", "ddtree_flat_mask")(
        (max(1, int(chunks)), bs),
        (256,),
        (ptr(mask_words), ptr(prefix_lens), width, out.numel(), ptr(out)),
    )
    return out


# =========================================================================== accept


def allocate_acceptance(bs: int, width: int, device) -> Acceptance:
    """Outputs of :func:`accept_walk`, allocated once (e.g. for a CUDA graph)."""

    def e(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int64, device=device)

    return Acceptance(
        path=e(bs, width),
        accept_lens=e(bs),
        bonus=e(bs),
        out_tokens=e(bs, width),
        new_seq_lens=e(bs),
        sources=e(bs, width),
        emitted=torch.empty(bs, dtype=torch.int32, device=device),
    )


def accept_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    tree_sizes: torch.Tensor,
    posterior: torch.Tensor,
    prefix_lens: torch.Tensor | None = None,
    out: Acceptance | None = None,
) -> Acceptance:
    """Walk every tree along the target's ``posterior``, one warp per request.

    Greedy (posterior = argmax per slot) and sampled (one target sample per slot) are the
    same walk; exactly :func:`sglang_ddtree.tree.accept.accept_walk_ref`.

    Parameters
    ----------
    tokens, parents : int64 ``[bs, W]`` (the tree layout).
    tree_sizes : int64 ``[bs]``.
    posterior : int64 ``[bs, W]``, the target's token at every slot.
    prefix_lens : int64 ``[bs]`` or None; with it ``new_seq_lens = prefix + accept + 1``.
    out : :class:`~sglang_ddtree.tree.types.Acceptance` or None (allocated by
        :func:`allocate_acceptance`).

    Returns
    -------
    Acceptance
        ``path [bs, W]`` (-1 padded), ``accept_lens [bs]``, ``bonus [bs]``,
        ``out_tokens [bs, W]`` (0 padded), ``new_seq_lens [bs]``, ``sources [bs, W]`` (the commit
        plan of ``accept.commit_sources_ref``) and ``emitted [bs]`` int32 (each if its buffer exists).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [bs, W], got {list(tokens.shape)}")
    bs, width = (int(s) for s in tokens.shape)
    _check(tokens, "tokens", torch.int64, [bs, width])
    _check(parents, "parents", torch.int64, [bs, width])
    _check(tree_sizes, "tree_sizes", torch.int64, [bs])
    _check(posterior, "posterior", torch.int64, [bs, width])
    if prefix_lens is not None:
        _check(prefix_lens, "prefix_lens", torch.int64, [bs])
    if out is None:
        out = allocate_acceptance(bs, width, tokens.device)
    _check(out.path, "out.path", torch.int64, [bs, width])
    _check(out.accept_lens, "out.accept_lens", torch.int64, [bs])
    _check(out.bonus, "out.bonus", torch.int64, [bs])
    _check(out.out_tokens, "out.out_tokens", torch.int64, [bs, width])
    if out.new_seq_lens is not None:
        _check(out.new_seq_lens, "out.new_seq_lens", torch.int64, [bs])
    if out.sources is not None:
        _check(out.sources, "out.sources", torch.int64, [bs, width])
    if out.emitted is not None:
        _check(out.emitted, "out.emitted", torch.int32, [bs])
    if bs == 0:
        return out
    kernel("ddtree_accept", "ddtree_accept_walk")(
        (bs,),
        (32,),
        (
            ptr(tokens),
            ptr(parents),
            ptr(tree_sizes),
            ptr(posterior),
            ptr(prefix_lens),
            width,
            ptr(out.path),
            ptr(out.accept_lens),
            ptr(out.bonus),
            ptr(out.out_tokens),
            ptr(out.new_seq_lens),
            ptr(out.sources),
            ptr(out.emitted),
        ),
        shared_mem=36 * width,
    )
    return out
