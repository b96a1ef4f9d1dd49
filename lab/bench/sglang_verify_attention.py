"""SGLang's own target-verify attention on a :class:`TreeVerifyProblem` (the baseline).

On CUDA, SGLang 0.5.23's triton backend runs a target-verify forward through
``extend_attention_fwd`` (its split-KV verify kernels are ROCm-only and chain-only): one program
per (request, head, query tile) walks the whole prefix serially, with the tree given as SGLang's
flat custom mask. This lays a problem out the way that backend does for absorbed MLA (keys: the
576-wide latent+rope rows of the pool; values: their first 512 columns) so that the split kernel
and SGLang's path are timed and checked on the same inputs.
"""

from __future__ import annotations

import torch

from sglang_ddtree.kernels.compare import relative_difference
from sglang_ddtree.kernels.mla_tree_attention import D_LATENT, D_QK, SM_SCALE, TreeVerifyProblem
from sglang_ddtree.tree.layout import flat_custom_mask as layout_flat_custom_mask


def flat_custom_mask(p: TreeVerifyProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's target-verify mask of the problem (:func:`sglang_ddtree.tree.layout.flat_custom_mask`)
    and its ``mask_indptr``."""
    bs, W = p.bs, p.n_nodes
    L = p.kv_pool.shape[0] // bs
    mask = layout_flat_custom_mask(p.tree_mask != 0, [L] * bs)
    indptr = torch.arange(bs + 1, device=p.q.device, dtype=torch.int64) * (W * (L + W))
    return mask, indptr


class SGLangVerifyAttention:
    """``extend_attention_fwd`` with every input built once (graph-safe), as the backend calls it."""

    def __init__(self, p: TreeVerifyProblem):
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        self._fwd = extend_attention_fwd
        bs, W, H = p.bs, p.n_nodes, p.heads
        self.p = p
        self.q = p.q.reshape(bs * W, H, D_QK)
        self.k_extend = p.k_tree.reshape(bs * W, 1, D_QK)
        self.v_extend = self.k_extend[..., :D_LATENT].contiguous()
        self.k_buffer = p.kv_pool.view(-1, 1, D_QK)
        self.v_buffer = self.k_buffer[..., :D_LATENT]
        self.out = torch.empty(bs * W, H, D_LATENT, device=p.q.device, dtype=p.q.dtype)
        self.qo_indptr = torch.arange(bs + 1, device=p.q.device, dtype=torch.int32) * W
        self.mask, self.mask_indptr = flat_custom_mask(p)

    def __call__(self) -> torch.Tensor:
        p = self.p
        self._fwd(
            self.q, self.k_extend, self.v_extend, self.out, self.k_buffer, self.v_buffer,
            self.qo_indptr, p.kv_indptr, p.kv_indices, self.mask, True, self.mask_indptr,
            p.n_nodes, 1.0, 1.0, sm_scale=SM_SCALE,
        )  # fmt: skip
        return self.out.view(p.bs, p.n_nodes, p.heads, D_LATENT)


def drafter_attention(
    bs: int, prefix: int, block: int, heads: int, kv_heads: int, head_dim: int, device="cuda"
):
    """SGLang's verify-mode attention at a DFlash drafter's shape (GQA, the block's tokens
    seeing the whole context and each other, no mask): the call its triton backend makes for
    every drafter layer of a round, and the plugin's split-KV decode of the same block
    (``kernels/draft_attention.py``) on the same inputs, checked against each other. Returns two
    zero-argument launchers (inputs built once): SGLang's, the decode path's."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from sglang_ddtree.kernels.draft_attention import BlockScratch, block_attention

    gen = torch.Generator(device=device).manual_seed(bs * 131 + prefix)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    span = prefix + block  # each request's prefix slots, then its block's (written before the kernel)
    q, o, o_decode = (
        randn(bs * block, heads, head_dim),
        randn(bs * block, heads, head_dim),
        randn(bs * block, heads, head_dim),
    )
    k_buffer, v_buffer = randn(bs * span, kv_heads, head_dim), randn(bs * span, kv_heads, head_dim)
    starts = torch.arange(bs, device=device, dtype=torch.int64)[:, None] * span
    kv_indices = (starts + torch.arange(prefix, device=device)).flatten()
    block_loc = (starts + prefix + torch.arange(block, device=device)).flatten()
    k_extend, v_extend = k_buffer[block_loc], v_buffer[block_loc]
    qo_indptr = torch.arange(bs + 1, device=device, dtype=torch.int32) * block
    kv_indptr = torch.arange(bs + 1, device=device, dtype=torch.int32) * prefix
    scratch = BlockScratch.allocate(bs, block, heads, head_dim, head_dim, prefix, torch.bfloat16, device)

    def sglang():
        extend_attention_fwd(
            q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            None, False, None, block, 1.0, 1.0, sm_scale=head_dim**-0.5,
        )  # fmt: skip

    def decode():
        block_attention(
            q, o_decode, k_buffer, v_buffer, kv_indptr, kv_indices, block_loc, head_dim**-0.5, scratch
        )

    sglang()
    decode()
    error = relative_difference(o_decode, o)
    if error > 2e-2:
        raise AssertionError(f"drafter block: decode path vs SGLang relative difference {error:.3g}")
    return sglang, decode


def drafter_prefix_bytes(bs: int, prefix: int, kv_heads: int, head_dim: int) -> int:
    """The fewest bytes one drafter layer's verify must read: its context K and V, once."""
    return 2 * bs * prefix * kv_heads * head_dim * 2


def drafter_sweep(shape, bs_list, prefixes, copy_gbs: float, timer) -> list[dict]:
    """SGLang's verify-mode attention per drafter layer at ``shape`` (block, heads, kv heads,
    head dim), against the time to read the layer's context once at copy bandwidth."""
    block, heads, kv_heads, head_dim = shape
    rows = []
    for bs in bs_list:
        for prefix in prefixes:
            sglang, decode = drafter_attention(bs, prefix, block, heads, kv_heads, head_dim)
            ms, decode_ms = timer(sglang), timer(decode)
            floor = drafter_prefix_bytes(bs, prefix, kv_heads, head_dim) / (copy_gbs * 1e9) * 1e3
            rows.append({"bs": bs, "prefix": prefix, "block": block, "heads": heads, "kv_heads": kv_heads,
                         "head_dim": head_dim, "sglang_ms": ms, "decode_ms": decode_ms,
                         "read_floor_ms": floor})  # fmt: skip
            print(
                f"[mla] drafter bs={bs} L={prefix}: SGLang {ms:.3f} ms, decode path {decode_ms:.3f} ms "
                f"(read floor {floor:.4f})",
                flush=True,
            )
    return rows


def drafter_markdown(rows: list[dict]) -> list[str]:
    from lab.bench._stamp import md_table

    if not rows:
        return []
    r0 = rows[0]
    table = [
        [
            r["bs"],
            r["prefix"],
            r["sglang_ms"],
            r.get("decode_ms", "-"),
            f"{r['sglang_ms'] / r['decode_ms']:.1f}x" if r.get("decode_ms") else "-",
            r["read_floor_ms"],
            f"{r['sglang_ms'] / r['read_floor_ms']:.0f}x",
        ]
        for r in rows
    ]
    return [
        f"## The drafter's verify-mode attention (block {r0['block']}, {r0['heads']} heads, "
        f"{r0['kv_heads']} KV heads, head dim {r0['head_dim']}; per layer): SGLang's kernel and the "
        "plugin's split-KV decode of the same block (checked against each other first)",
        "",
        md_table(
            ["bs", "prefix", "SGLang ms", "decode ms", "SGLang / decode", "read floor ms", "SGLang x floor"],
            table,
        ),
        "",
    ]
