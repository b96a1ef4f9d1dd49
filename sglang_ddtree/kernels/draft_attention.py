"""The drafter's block attention as one split-KV decode over prefix + block.

A DFlash drafter's block forward is a target-verify forward of ``W`` query rows per request,
non-causal: every row attends to the request's whole prefix and to every row of the block
(SGLang's ``models/dflash.py``; its layers are encoder-only unless the config says causal). On
CUDA, SGLang 0.5.23's triton backend runs it through ``extend_attention_fwd``, whose programs
walk each request's prefix serially: 0.21 ms per drafter layer at bs 1 and a 4096-token prefix,
0.80 at 16k (``results/k26-rank_h200_verify_attention.md``).

Non-causal with no mask, the block is a decode: the ``W x Hq`` query rows of a request are query
heads of one decode step over the request's keys, prefix and block alike (``forward_extend``
writes the block's K/V to the pool before its kernel runs). SGLang's split-KV decode kernel
(``decode_attention_fwd``) computes it once the block's slots follow the prefix's in the key
indices. Heads go in the order (kv head, group, row), so its grouping (``head //
(heads / kv_heads)``) still maps each query row to its KV head.

:func:`block_attention_reference` is the readable definition the kernel path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SPLIT_KEYS = 128  # keys per split below which more splits cost more than they spread
MAX_SPLITS = 32


def block_attention_reference(
    q, k_buffer, v_buffer, kv_indptr, kv_indices, block_loc, width: int, sm_scale: float
):
    """Float32 ``[bs * W, Hq, Dv]``: each request's W query rows over its prefix keys
    (``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``) and its block's (``block_loc[r*W:(r+1)*W]``)."""
    bs = kv_indptr.numel() - 1
    hq, hkv = q.shape[1], k_buffer.shape[1]
    out = torch.empty(q.shape[0], hq, v_buffer.shape[-1], dtype=torch.float32, device=q.device)
    for r in range(bs):
        slots = torch.cat(
            [
                kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])].long(),
                block_loc[r * width : (r + 1) * width].long(),
            ]
        )
        k = k_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)  # [keys, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)
        rows = q[r * width : (r + 1) * width].float()  # [W, Hq, D]
        scores = torch.einsum("whd,khd->hwk", rows, k) * sm_scale
        out[r * width : (r + 1) * width] = torch.einsum("hwk,khd->whd", scores.softmax(-1), v)
    return out


@dataclass
class BlockScratch:
    """Buffers of the decode path for up to ``max_bs`` requests of ``width`` rows (allocated
    once, so CUDA graphs capture the launches)."""

    max_bs: int
    width: int
    indptr: torch.Tensor  # int32 [max_bs + 1]
    indices: torch.Tensor  # int64 [max_bs * (context + width)]
    splits: torch.Tensor  # int32 [max_bs]
    q: torch.Tensor  # [max_bs, W * Hq, D]
    o: torch.Tensor  # [max_bs, W * Hq, Dv]
    logits: torch.Tensor  # float32 [max_bs, W * Hq, MAX_SPLITS, Dv]
    lse: torch.Tensor  # float32 [max_bs, W * Hq, MAX_SPLITS]

    @classmethod
    def allocate(
        cls, max_bs: int, width: int, heads: int, head_dim: int, v_dim: int, context: int, dtype, device
    ):
        rows = width * heads
        return cls(
            max_bs=max_bs,
            width=width,
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            indices=torch.zeros(max_bs * (context + width), dtype=torch.int64, device=device),
            splits=torch.ones(max_bs, dtype=torch.int32, device=device),
            q=torch.empty(max_bs, rows, head_dim, dtype=dtype, device=device),
            o=torch.empty(max_bs, rows, v_dim, dtype=dtype, device=device),
            logits=torch.empty(max_bs, rows, MAX_SPLITS, v_dim, dtype=torch.float32, device=device),
            lse=torch.empty(max_bs, rows, MAX_SPLITS, dtype=torch.float32, device=device),
        )


def block_attention(
    q, o, k_buffer, v_buffer, kv_indptr, kv_indices, block_loc, sm_scale: float, scratch: BlockScratch
):
    """``o`` ``[bs * W, Hq, Dv]`` = :func:`block_attention_reference`, through one split-KV
    decode (no host read: graph-safe)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    width = scratch.width
    bs, hq, hkv = kv_indptr.numel() - 1, q.shape[1], k_buffer.shape[1]
    group = hq // hkv
    indptr, indices = scratch.indptr[: bs + 1], scratch.indices
    steps = torch.arange(bs + 1, dtype=torch.int32, device=q.device) * width
    indptr.copy_(kv_indptr + steps)
    join_indices(kv_indptr, kv_indices, block_loc, indices, width)
    lens = indptr[1:] - indptr[:-1]
    scratch.splits[:bs].copy_(((lens + MIN_SPLIT_KEYS - 1) // MIN_SPLIT_KEYS).clamp(1, MAX_SPLITS))
    heads_first = q.view(bs, width, hkv, group, q.shape[-1]).permute(0, 2, 3, 1, 4)
    scratch.q[:bs].view(bs, hkv, group, width, q.shape[-1]).copy_(heads_first)
    decode_attention_fwd(
        scratch.q[:bs], k_buffer, v_buffer, scratch.o[:bs], indptr, indices, scratch.logits[:bs],
        scratch.lse[:bs], scratch.splits[:bs], MAX_SPLITS, sm_scale, 1.0, 1.0,
    )  # fmt: skip
    rows_first = scratch.o[:bs].view(bs, hkv, group, width, -1).permute(0, 3, 1, 2, 4)
    o.view(bs, width, hkv, group, -1).copy_(rows_first)
    return o


def join_indices(kv_indptr, kv_indices, block_loc, out, width: int) -> None:
    """``out``: per request its prefix's key slots, then its block's ``width`` slots, packed
    at ``kv_indptr[r] + r * width``."""
    import triton

    bs = kv_indptr.numel() - 1
    _join_kernel()[(bs,)](kv_indptr, kv_indices, block_loc, out, width, triton.next_power_of_2(width), 1024)


_JOIN = None


def _join_kernel():
    global _JOIN
    if _JOIN is None:
        import triton
        import triton.language as tl

        @triton.jit
        def join(kv_indptr, kv_indices, block_loc, out, W, W_P2: tl.constexpr, BLOCK: tl.constexpr):
            r = tl.program_id(0)
            start = tl.load(kv_indptr + r)
            n = tl.load(kv_indptr + r + 1) - start
            dst = start + r * W
            for offset in range(0, n, BLOCK):
                idx = offset + tl.arange(0, BLOCK)
                keep = idx < n
                slots = tl.load(kv_indices + start + idx, mask=keep)
                tl.store(out + dst + idx, slots.to(tl.int64), mask=keep)
            w = tl.arange(0, W_P2)
            rows = w < W
            slots = tl.load(block_loc + r * W + w, mask=rows)
            tl.store(out + dst + n + w, slots.to(tl.int64), mask=rows)

        _JOIN = join
    return _JOIN
