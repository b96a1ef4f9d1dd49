"""The drafter's block attention on SGLang's triton backend, through one split-KV decode.

SGLang 0.5.23 runs the DFlash drafter's block forward (target-verify mode, non-causal) through
``extend_attention_fwd``, which walks each request's prefix serially; at long prompts that is
most of the drafter's attention (``kernels/draft_attention.py``). The hook replaces the kernel
launch alone, as ``mla_verify.py`` does for the target: SGLang still writes the block's K/V,
allocates the output and builds the metadata, eagerly and under CUDA graphs. The block's slots
come from the forward batch (``forward_extend`` is wrapped to keep them for the launch). Any
call outside the contract goes to SGLang's kernel: a mask, causal layers, paged, scaled or
windowed caches, sinks, soft caps, score mods, uneven blocks, more requests than the scratch
holds. The drafter's attention shapes the proposals only; the target verifies every token.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...config import serving_ddtree, sglang_verify_attention_requested
from ...kernels.compare import relative_difference
from .mla_verify import plain_options

logger = logging.getLogger("sglang_ddtree")


def servable(
    q, k_buffer, v_buffer, qo_indptr, custom_mask, is_causal, max_extend_len, block_loc, scratch, kw
) -> bool:
    """Whether a ``_forward_extend_kernel`` call is a non-causal block the decode path computes
    with SGLang's meaning (host checks only: graph-safe)."""
    bs = qo_indptr.shape[0] - 1
    return (
        plain_options(kw)
        and custom_mask is None
        and not is_causal
        and block_loc is not None
        and scratch is not None
        and k_buffer.dim() == 3
        and q.shape[1] % k_buffer.shape[1] == 0
        and q.shape[1] * scratch.width == scratch.q.shape[1]
        and q.shape[-1] == k_buffer.shape[-1] == scratch.q.shape[-1]
        and v_buffer.shape[-1] == scratch.o.shape[-1]
        and q.dtype == k_buffer.dtype == scratch.q.dtype
        and int(max_extend_len) == scratch.width
        and bs <= scratch.max_bs
        and q.shape[0] == bs * scratch.width == block_loc.shape[0]
    )


class BlockAttention:
    """The drafter backend's launches, routed: the decode path where :func:`servable`, else
    SGLang's kernel. One scratch per block width, allocated at the first call of that width."""

    def __init__(self, backend, max_bs: int):
        self.backend = backend
        self.max_bs = max_bs
        self.block_loc = None
        self.scratch = {}
        self.sglang_kernel = backend._forward_extend_kernel
        self.sglang_extend = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        self.block_loc = (
            forward_batch.out_cache_loc if forward_batch.forward_mode.is_target_verify() else None
        )
        try:
            return self.sglang_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self.block_loc = None

    def kernel(self, layer, q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
               custom_mask, is_causal, mask_indptr, max_extend_len, k_descale, v_descale, sm_scale, **kw):  # fmt: skip
        scratch = self._scratch(q, v_buffer, max_extend_len) if self.block_loc is not None else None
        if (
            k_descale == 1.0
            and v_descale == 1.0
            and servable(
                q,
                k_buffer,
                v_buffer,
                qo_indptr,
                custom_mask,
                is_causal,
                max_extend_len,
                self.block_loc,
                scratch,
                kw,
            )
        ):
            from ...kernels.draft_attention import block_attention

            return block_attention(
                q, o, k_buffer, v_buffer, kv_indptr, kv_indices, self.block_loc, sm_scale, scratch
            )
        return self.sglang_kernel(
            layer, q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
            is_causal, mask_indptr, max_extend_len, k_descale, v_descale, sm_scale, **kw,
        )  # fmt: skip

    def _scratch(self, q, v_buffer, width):
        from ...kernels.draft_attention import BlockScratch

        width = int(width)
        if width not in self.scratch:
            self.scratch[width] = BlockScratch.allocate(
                self.max_bs, width, q.shape[1], q.shape[-1], v_buffer.shape[-1],
                int(self.backend.max_context_len), q.dtype, q.device,
            )  # fmt: skip
        return self.scratch[width]


def use_block_decode(backend, max_bs: int) -> BlockAttention:
    """Route this drafter backend's block launches through the decode path."""
    routed = BlockAttention(backend, max_bs)
    backend.forward_extend = routed.forward_extend
    backend._forward_extend_kernel = routed.kernel
    return routed


_CHECKED: dict[tuple, str | None] = {}  # (heads, kv heads, head dim, dtype) -> the self-check's verdict


def self_check(sglang_kernel, heads: int, kv_heads: int, head_dim: int, dtype, device) -> str | None:
    """The decode path against ``sglang_kernel`` (a ``_forward_extend_kernel`` launch) on a
    random block of uneven prefixes; None when they agree, else why not."""
    from ...kernels.draft_attention import BlockScratch, block_attention

    gen = torch.Generator().manual_seed(0)
    width, prefix_lens = 8, [300, 0, 45]
    bs, slots = len(prefix_lens), sum(prefix_lens) + 3 * 8 + 5
    order = torch.randperm(slots, generator=gen)
    kv_indices = order[: sum(prefix_lens)].to(device)
    block_loc = order[sum(prefix_lens) : sum(prefix_lens) + bs * width].to(device)
    k_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(bs * width, heads, head_dim, generator=gen).to(device, dtype)
    kv_indptr = torch.tensor(
        [0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=device) * width
    scale = head_dim**-0.5
    want = torch.zeros(bs * width, heads, head_dim, dtype=dtype, device=device)
    sglang_kernel(None, q, k_buffer[block_loc], v_buffer[block_loc], want, k_buffer, v_buffer, qo_indptr,
                  kv_indptr, kv_indices, None, False, None, width, 1.0, 1.0, scale)  # fmt: skip
    got = torch.full_like(want, float("nan"))
    scratch = BlockScratch.allocate(bs, width, heads, head_dim, head_dim, 400, dtype, device)
    block_attention(q, got, k_buffer, v_buffer, kv_indptr, kv_indices, block_loc, scale, scratch)
    error = relative_difference(got, want)
    if not torch.isfinite(got).all() or error > 2e-2:
        return f"relative difference {error:.3g} from SGLang's kernel"
    return None


def _checked(backend, dtype) -> str | None:
    key = (int(backend.num_head), int(backend.num_kv_head), int(backend.v_head_dim), dtype)
    if key not in _CHECKED:
        device = torch.device("cuda", torch.cuda.current_device())
        _CHECKED[key] = self_check(backend._forward_extend_kernel, *key[:3], dtype, device)
    return _CHECKED[key]


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after(result, backend, model_runner, *args, **kwargs):
        if (
            serving_ddtree(getattr(model_runner, "spec_algorithm", None))
            and model_runner.is_draft_worker
            and not getattr(backend, "use_mla", False)
            and torch.cuda.is_available()
            and not sglang_verify_attention_requested()
        ):
            failure = _checked(backend, model_runner.dtype)
            if failure is None:
                use_block_decode(backend, _graph_max_bs())
                logger.info("DDTREE: the drafter's block attention runs as a split-KV decode")
            else:
                logger.warning("DDTREE: the drafter keeps SGLang's block attention (self-check: %s)", failure)
        return result

    HookRegistry.register(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", after, HookType.AFTER
    )


@functools.cache
def _graph_max_bs() -> int:
    """The largest batch the drafter's graphs capture (32 when they capture none)."""
    from sglang.srt.runtime_context import get_exec

    config = getattr(getattr(get_exec(), "graph", None), "cuda_graph_config", None)
    sizes = getattr(getattr(config, "decode", None), "bs", None) or [32]  # an eager server: none
    return int(max(sizes))
