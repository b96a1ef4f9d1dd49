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

from ..kernels.mla_tree_attention import D_LATENT, D_QK, SM_SCALE, TreeVerifyProblem


def flat_custom_mask(p: TreeVerifyProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's target-verify mask: per request ``W`` rows over ``L + W`` keys, row-major,
    requests back to back (prefix columns all visible); and its ``mask_indptr``."""
    bs, W = p.bs, p.n_nodes
    L = p.kv_pool.shape[0] // bs
    prefix = torch.ones(bs, W, L, dtype=torch.bool, device=p.q.device)
    mask = torch.cat([prefix, p.tree_mask != 0], dim=-1)  # [bs, W, L + W]
    indptr = torch.arange(bs + 1, device=p.q.device, dtype=torch.int64) * (W * (L + W))
    return mask.reshape(-1), indptr


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
