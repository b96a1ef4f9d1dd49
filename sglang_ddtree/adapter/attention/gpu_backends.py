"""Tree-masked verify on SGLang's GPU attention backends.

DDTree hands every backend SGLang's flat verify ``custom_mask`` (per request
``[width, prefix + width]``, see ``tree/layout.py``) on a ``DFLASH_VERIFY`` input.
What each backend does with it in SGLang 0.5.23 (docs/backends.md):

* **triton** (MHA and MLA) and **flashinfer** (MHA): their target-verify paths
  read ``spec_info.custom_mask``, eagerly and under CUDA graphs. Under graphs the
  kernel variant (masked or causal) is fixed at capture, by the *dummy* verify
  input SGLang builds - which for the DFlash family has no mask. DDTree captures
  with a mask (:func:`install_capture_input`), or every replay would verify causally.
* **fa3** (MHA and MLA): builds the tree path (prefix pass + per-row expanded tail
  pass from the custom mask, merged by log-sum-exp) only when
  ``speculative_eagle_topk > 1``. DDTree keeps ``topk = 1`` for the rest of SGLang
  and turns the tree path on in the target's FA3 backend alone (:func:`install_fa3_tree_path`).
* everything else (flashinfer MLA, trtllm_mla, flashmla, cutlass_mla, fa4, ...) has no
  tree mask on the verify path and is refused at start-up.

triton is served on the H200 and checked token for token against the plain server
under CUDA graphs (tests/gpu_server, docs/gpu.md). fa3 and flashinfer are wired by reading
SGLang's code and untested on a GPU (the GPU bundle carries neither). The CPU path
(torch_native) is tested end to end.
"""

from __future__ import annotations

import logging

from ...config import serving_ddtree

logger = logging.getLogger("sglang_ddtree")

TREE_MASK_BACKENDS = {
    "mha": ("torch_native", "triton", "flashinfer", "fa3"),
    "mla": ("torch_native", "triton", "fa3"),
}


# The backend classes those names build (checked on the live target runner).
TREE_MASK_BACKEND_CLASSES = (
    "TorchNativeAttnBackend",
    "TritonAttnBackend",
    "FlashInferAttnBackend",
    "FlashAttentionBackend",
)


def supported_backends(is_mla: bool) -> tuple[str, ...]:
    return TREE_MASK_BACKENDS["mla" if is_mla else "mha"]


def check_live_backend(attn_backend) -> None:
    """Refuse a target attention backend without a tree-masked verify path (one
    SGLang chose itself, or one a hub-hosted target made unknowable at start-up)."""
    from ...config import DDTreeConfigError

    backends = [attn_backend, *(getattr(attn_backend, "attn_backend_list", None) or [])]
    for backend in backends:
        name = type(backend).__name__
        if name not in TREE_MASK_BACKEND_CLASSES and not name.endswith(
            ("HybridAttnBackend", "TboAttnBackend")
        ):
            raise DDTreeConfigError(
                f"DDTREE: the target's attention backend {name} has no tree-masked verify path; "
                "launch with --attention-backend triton or fa3 (docs/backends.md)."
            )


def install_capture_input() -> None:
    """Capture target-verify CUDA graphs with a tree mask present.

    Two places build the capture-time verify input in SGLang 0.5.23: the decode
    graph runner's ``get_spec_info`` (the graphs that serve) and
    ``base_runner.create_dummy_verify_input`` (dummy and warm-up forwards). For the
    DFlash family the first passes ``custom_mask=None`` on backends that verify a
    chain causally (triton, flashinfer, fa3: ``_DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS``),
    so the triton verify kernel is captured in its causal variant and every replay
    ignores the tree mask: siblings attend to each other and greedy output drifts.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def with_tree_mask(spec_info, runner, *args, **kwargs):
        model_runner = runner.model_runner
        if (
            spec_info is not None
            and serving_ddtree(model_runner.spec_algorithm)
            and not model_runner.is_draft_worker
            and spec_info.custom_mask is None
        ):
            spec_info.custom_mask = runner.buffers.custom_mask
        return spec_info

    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
        with_tree_mask,
        HookType.AFTER,
    )

    def around(original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs):
        if not serving_ddtree(spec_algorithm) or is_draft_worker:
            return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        from ..verify_input import DDTreeVerifyInput

        return DDTreeVerifyInput(
            draft_token=None,
            positions=None,
            draft_token_num=int(num_tokens_per_req),
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )

    HookRegistry.register(
        "sglang.srt.model_executor.runner.base_runner.create_dummy_verify_input", around, HookType.AROUND
    )


def install_fa3_tree_path() -> None:
    """FA3 builds its tree (cascade) verify only for ``topk > 1``: enable it in the
    target's backend when DDTREE is served."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after(result, backend, model_runner, *args, **kwargs):
        if serving_ddtree(getattr(model_runner, "spec_algorithm", None)) and not backend.is_draft_runner:
            backend.topk = max(int(backend.topk or 0), 2)
            logger.info("DDTREE: FA3 target backend uses its tree (cascade) verify path")
        return result

    HookRegistry.register(
        "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.__init__",
        after,
        HookType.AFTER,
    )


def install() -> None:
    install_capture_input()
    import torch

    if torch.cuda.is_available():  # FA3, the split verify kernel and the block decode are CUDA-only
        install_fa3_tree_path()
        from .. import verify_graph_memory
        from . import draft_attention, mla_verify

        mla_verify.install()
        draft_attention.install()
        verify_graph_memory.install()
