"""Target-verify attention for SGLang's ``torch_native`` backend (the CPU path).

SGLang's torch_native backend has no ``TARGET_VERIFY`` forward. DDTree needs one
that takes a tree mask: each verify slot sees the whole committed prefix and,
inside the tree block, only its ancestors and itself. The same forward serves the
DFlash drafter's block (encoder-only layers: the block sees itself entirely) and a
chain verify (causal block).

The verify input carries the mask as ``spec_info.tree_visibility`` ``[bs, width,
width]`` bool; without it the block is causal.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def block_mask(n_q: int, prefix_len: int, tree: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """Allowed (query, key) pairs over ``prefix_len + n_q`` keys; None = all allowed (also
    for a block of one slot: it sees the prefix and itself)."""
    if not causal or n_q == 1:
        return None
    if tree is None:
        tree = torch.ones((n_q, n_q), dtype=torch.bool).tril_()
    prefix = torch.ones((n_q, prefix_len), dtype=torch.bool, device=tree.device)
    return torch.cat([prefix, tree], dim=1)


def verify_attention(
    q: torch.Tensor,  # [bs * n_q, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [slots, kv_heads, v_dim]
    req_to_token: torch.Tensor,  # [rows, max_len]
    req_pool_indices: torch.Tensor,  # [bs]
    prefix_lens: torch.Tensor,  # [bs] committed lengths (verify tokens excluded)
    tree_visibility: torch.Tensor | None,  # [bs, n_q, n_q] bool or None
    causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    """Masked attention of every verify slot over prefix + verify block; returns
    ``[bs * n_q, heads, v_dim]``."""
    bs = int(req_pool_indices.shape[0])
    n_q = q.shape[0] // bs
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = q.new_empty((q.shape[0], heads, v_cache.shape[-1]))
    rows, lens = req_pool_indices.tolist(), prefix_lens.tolist()
    for b in range(bs):
        prefix_len = int(lens[b])
        slots = req_to_token[rows[b], : prefix_len + n_q].long()
        keys = k_cache[slots].transpose(0, 1).to(q.dtype)  # [kv_heads, L, d]
        values = v_cache[slots].transpose(0, 1).to(q.dtype)
        tree = tree_visibility[b] if tree_visibility is not None else None
        mask = block_mask(n_q, prefix_len, tree, causal)
        query = q[b * n_q : (b + 1) * n_q].transpose(0, 1)  # [heads, n_q, d]
        result = scaled_dot_product_attention(
            query.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=None if mask is None else mask.unsqueeze(0).unsqueeze(0),
            scale=scaling,
            enable_gqa=heads != kv_heads,
        )
        out[b * n_q : (b + 1) * n_q] = result.squeeze(0).transpose(0, 1)
    return out


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook for ``TorchNativeAttnBackend.forward_extend``."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
    causal = not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = verify_attention(
        q_,
        backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        getattr(forward_batch.spec_info, "tree_visibility", None),
        causal,
        layer.scaling,
    )
    return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        forward_extend,
        HookType.AROUND,
    )
