"""The target's MLA tree-verify attention, served by the split tree kernel.

Same contract as SGLang 0.5.23's ``extend_attention_fwd`` on a target-verify forward of
absorbed MLA (what its triton backend launches): queries ``[bs * W, H, 576]``, the verify
tokens' own latent rows ``k_extend`` ``[bs * W, 1, 576]`` (values: their first 512 columns),
the pool's latent rows ``k_buffer`` ``[slots, 1, 576]`` read through ``kv_indptr`` /
``kv_indices``, every prefix key visible, the tree under SGLang's flat custom mask. SGLang's
kernel walks each request's prefix serially in one program per (request, head, query tile);
this one splits the prefix over the whole GPU and shares each key tile between all the
request's ``W x H`` query rows (``mla_tree_attention.py``).

Graph-safe: every launch shape depends on ``(bs, W, heads)`` alone, never on the prefix
lengths a CUDA-graph replay changes. The prefix splits are fixed per shape; each split finds
its keys on the device, and a split past a short prefix writes an empty part.
"""

from __future__ import annotations

import torch

from ..tree.layout import flat_custom_mask
from .compare import relative_difference
from .mla_tree_attention import (
    D_LATENT,
    D_QK,
    LOG2E,
    SplitConfig,
    choose_d_chunks,
    launch_combine,
    launch_partial,
)

MAX_SPLITS = 64  # prefix parts per (request, row tile); the merge reads them all
PART_DTYPE = torch.float32  # the parts stay float32: the merge adds no bf16 rounding of its own


def config_for(heads: int, n_nodes: int) -> SplitConfig:
    """Prefix-kernel tile per shape, as tuned on the H200 (results/kimi-k2.6_h200_mla_tree_attention.md:
    one config wins everywhere but 8 heads x 17 nodes)."""
    if heads <= 8 and 9 <= n_nodes <= 24:
        return SplitConfig(32, 64, 4, 2)
    return SplitConfig(64, 64, 8, 2)


def graph_safe_splits(bs: int, rows: int, block_m: int, sms: int) -> int:
    """About two programs per SM over the longest prefix, from the shape alone."""
    tiles = -(-rows // block_m)
    return max(1, min(MAX_SPLITS, -(-2 * sms // (bs * tiles))))


def tree_verify_attention(
    q, k_extend, o, k_buffer, kv_indptr, kv_indices, custom_mask, mask_indptr, n_nodes: int, sm_scale: float, sms: int
) -> None:  # fmt: skip
    """Writes ``o`` ``[bs * W, H, 512]``; ``bs = len(kv_indptr) - 1``, ``W = n_nodes``."""
    bs, heads = kv_indptr.shape[0] - 1, q.shape[1]
    rows = n_nodes * heads
    cfg = config_for(heads, n_nodes)
    n_splits = graph_safe_splits(bs, rows, cfg.block_m, sms)
    o_part = torch.empty(bs, n_splits + 1, rows, D_LATENT, device=q.device, dtype=PART_DTYPE)
    lse_part = torch.empty(bs, n_splits + 1, rows, device=q.device, dtype=torch.float32)
    q_rows = q.view(bs, rows, D_QK)  # a request's rows node-major, as the kernel reads them
    kv = k_buffer.view(k_buffer.shape[0], D_QK)
    k_tree = k_extend.view(bs, n_nodes, D_QK)
    for tail in (False, True):
        launch_partial(
            q_rows, kv, kv_indptr, kv_indices, k_tree, custom_mask, mask_indptr, o_part, lse_part,
            sm_scale * LOG2E, heads, n_nodes, cfg, tail, flat_mask=True,
        )  # fmt: skip
    launch_combine(o_part, lse_part, o.view(bs, rows, D_LATENT), choose_d_chunks(bs, rows, sms))


def self_check(reference, heads: int, dtype, device, sms: int) -> str | None:
    """The split kernel against ``reference`` (a launcher with ``extend_attention_fwd``'s
    arguments) on small verify problems in this server's head count and dtype, at widths that
    take each prefix-kernel tile: None when they agree, else why not (an exception included,
    e.g. a tile that does not fit this GPU's shared memory)."""
    gen = torch.Generator(device=device).manual_seed(0)
    prefix_lens = [37, 150]  # neither a multiple of a key tile
    for width in (2, 17):
        bs = len(prefix_lens)
        q = torch.randn(bs * width, heads, D_QK, generator=gen, device=device).to(dtype)
        k_extend = torch.randn(bs * width, 1, D_QK, generator=gen, device=device).to(dtype)
        pool = torch.randn(sum(prefix_lens) + 1, 1, D_QK, generator=gen, device=device).to(dtype)
        kv_indptr = torch.tensor([0, prefix_lens[0], sum(prefix_lens)], dtype=torch.int32, device=device)
        kv_indices = torch.arange(1, sum(prefix_lens) + 1, device=device)
        chain = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = flat_custom_mask(chain[None].expand(bs, -1, -1), prefix_lens)  # SGLang's layout
        sizes = [width * (n + width) for n in prefix_lens]
        mask_indptr = torch.tensor([0, sizes[0], sum(sizes)], dtype=torch.int64, device=device)
        split, want = (
            torch.full((bs * width, heads, D_LATENT), float("nan"), dtype=dtype, device=device) for _ in "ab"
        )
        try:
            tree_verify_attention(
                q, k_extend, split, pool, kv_indptr, kv_indices, mask, mask_indptr, width, 0.07, sms
            )
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=device) * width
            reference(q, k_extend, k_extend[..., :D_LATENT].contiguous(), want, pool, pool[..., :D_LATENT],
                      qo_indptr, kv_indptr, kv_indices, mask, True, mask_indptr, width, 1.0, 1.0, 0.07)  # fmt: skip
        except Exception as why:  # noqa: BLE001 - any failure means: keep SGLang's kernel
            return f"{type(why).__name__}: {str(why)[:200]}"
        error = relative_difference(split, want)
        if not torch.isfinite(split).all() or error > 2e-2:
            return f"width {width}: relative difference {error:.1e} from SGLang's kernel"
    return None
