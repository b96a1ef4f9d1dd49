"""The target's MLA tree verify on SGLang's triton backend, through the split tree kernel.

On CUDA, SGLang 0.5.23's triton backend runs a target-verify forward through
``extend_attention_fwd``: one program per (request, head, query tile) walks the request's
whole prefix serially. At Kimi K2.6's 8 heads per GPU that costs 0.57 ms per layer at a
4096-token prefix against 0.046 ms for the split kernel, 2.2 against 0.04 at 16k
(``results/k26-rank_h200_verify_attention.md``); over 61 layers it made every
speculative round at 4096-token prompts cost 4x its cost at 96 tokens.

The hook replaces the kernel launch alone: SGLang still writes the verify tokens' KV, allocates
the output and builds the metadata (under CUDA graphs too); the split kernel reads the same
tensors with the same meaning - every prefix key visible, the tree under the flat custom mask
(SGLang's kernel also clips it causally per query tile, which drops nothing: a tree's nodes come
in topological order, so the mask is lower triangular). Any call outside that contract goes to
SGLang's kernel: other head sizes, a paged, scaled or windowed cache, sinks, soft caps, score
mods, a verify of uneven widths.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...config import serving_ddtree, sglang_verify_attention_requested

logger = logging.getLogger("sglang_ddtree")

D_QK, D_V = 576, 512  # absorbed MLA: 512 latent + 64 rope key columns; values = the latent


def plain_options(kw: dict) -> bool:
    """Whether a ``_forward_extend_kernel`` call's options are SGLang's plain attention: no
    soft cap, window, temperature, paging, sinks, score mod (the plugin's kernels serve no other)."""
    return (
        kw.get("logit_cap", 0.0) == 0.0
        and kw.get("sliding_window_size", -1) in (-1, None)
        and kw.get("xai_temperature_len", -1) in (-1, None)
        and kw.get("page_size", 1) == 1
        and all(kw.get(name) is None for name in ("sinks", "window_kv_offsets", "score_mod", "aux_tensors"))
    )


def servable(
    q, k_extend, o, k_buffer, v_buffer, qo_indptr, custom_mask, mask_indptr, max_extend_len, kw
) -> bool:
    """Whether a ``_forward_extend_kernel`` call is an absorbed-MLA tree verify the split
    kernel computes with SGLang's meaning (host checks only: no device read, graph-safe)."""
    return (
        plain_options(kw)
        and custom_mask is not None
        and mask_indptr is not None
        and q.shape[-1] == D_QK
        and o.shape[-1] == D_V
        and k_extend.shape[1] == 1
        and q.dtype == k_buffer.dtype == k_extend.dtype
        and q.is_contiguous()
        and k_extend.is_contiguous()
        and o.is_contiguous()
        # the values are the first 512 columns of the key rows (SGLang's MLA pool)
        and v_buffer.data_ptr() == k_buffer.data_ptr()
        and v_buffer.stride(0) == k_buffer.stride(0) == D_QK
        and q.shape[0] == (qo_indptr.shape[0] - 1) * int(max_extend_len)
    )


def _split_or_sglang(original, sms, layer, q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr,
                     kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_extend_len,
                     k_descale, v_descale, sm_scale, **kw):  # fmt: skip
    if (
        k_descale == 1.0
        and v_descale == 1.0
        and servable(
            q, k_extend, o, k_buffer, v_buffer, qo_indptr, custom_mask, mask_indptr, max_extend_len, kw
        )
    ):
        from ...kernels.mla_verify import tree_verify_attention

        tree_verify_attention(
            q, k_extend, o, k_buffer, kv_indptr, kv_indices, custom_mask, mask_indptr,
            int(max_extend_len), float(sm_scale), sms,
        )  # fmt: skip
        return o
    return original(
        layer, q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
        is_causal, mask_indptr, max_extend_len, k_descale, v_descale, sm_scale, **kw,
    )  # fmt: skip


def use_split_kernel(backend, sms: int) -> None:
    """Route this backend's verify launches through the split kernel (the rest unchanged)."""
    backend._forward_extend_kernel = functools.partial(_split_or_sglang, backend._forward_extend_kernel, sms)


_CHECKED: dict[tuple, str | None] = {}  # (heads, dtype) -> the self-check's verdict, once per process


def _checked(backend, dtype, sms: int) -> str | None:
    """The split kernel checked against SGLang's on this GPU before it serves (a tile that
    does not fit a smaller GPU's shared memory, say, keeps SGLang's kernel, logged)."""
    from ...kernels.mla_verify import self_check

    key = (int(backend.num_head), dtype)
    if key not in _CHECKED:
        reference = functools.partial(backend._forward_extend_kernel, None)  # no layer needed for MLA
        _CHECKED[key] = self_check(
            reference, key[0], dtype, torch.device("cuda", torch.cuda.current_device()), sms
        )
    return _CHECKED[key]


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after(result, backend, model_runner, *args, **kwargs):
        if (
            serving_ddtree(getattr(model_runner, "spec_algorithm", None))
            and not model_runner.is_draft_worker
            and getattr(backend, "use_mla", False)
            and not sglang_verify_attention_requested()
        ):
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            failure = _checked(backend, model_runner.dtype, sms)
            if failure is None:
                use_split_kernel(backend, sms)
                logger.info("DDTREE: the MLA target verifies its trees with the split tree-attention kernel")
            else:
                logger.warning(
                    "DDTREE: the MLA target keeps SGLang's verify kernel (split kernel self-check: %s)",
                    failure,
                )
        return result

    HookRegistry.register(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", after, HookType.AFTER
    )
