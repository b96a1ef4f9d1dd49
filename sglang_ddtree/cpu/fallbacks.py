"""CPU serving mode: the gaps between SGLang's GPU-first code and a CPU.

Installed by the plugin only when ``SGLANG_USE_CPU_ENGINE=1``; a GPU server
never runs any of this. Each fallback logs the first time it serves.
"""

from __future__ import annotations

import functools

import torch

from ..first_use_log import FirstUseLog

_INSTALLED = False
log_fallback = FirstUseLog("sglang_ddtree.cpu", "CPU mode fallback served")


def _patch_record_stream() -> None:
    """``Tensor.record_stream`` raises on CPU tensors; there is nothing to record."""
    original = torch.Tensor.record_stream
    if getattr(original, "_sglang_ddtree_cpu", False):
        return

    @functools.wraps(original)
    def record_stream(self, stream):
        if self.device.type == "cpu":
            log_fallback("Tensor.record_stream", "no-op for CPU tensors")
            return None
        return original(self, stream)

    record_stream._sglang_ddtree_cpu = True
    torch.Tensor.record_stream = record_stream


def _allow_torch_native_choices() -> None:
    """torch_native is SGLang's only CPU attention backend: let it serve the drafter,
    and deterministic inference (per-request sampling seeds; it is deterministic
    on a CPU)."""
    from sglang.srt.arg_groups import choices

    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices(["torch_native"])
    if "torch_native" not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        choices.add_deterministic_attention_backend_choices(["torch_native"])


def input_embeds_in_model_dtype(log=log_fallback) -> None:
    """``ModelRunner._extend_forward_kwargs`` casts ``input_embeds`` to bf16 whatever
    the model dtype; a float32 model (what CPU tests use, so that greedy
    comparisons are not at the mercy of bf16 rounding) then fails in its first
    GEMM. Cast to the model's dtype instead. See patches/0001-input-embeds-dtype.md."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, runner, forward_batch, *args, **kwargs):
        result = original(runner, forward_batch, *args, **kwargs)
        dtype = getattr(runner, "dtype", torch.bfloat16)
        embeds = result.get("input_embeds")
        if embeds is not None and forward_batch.input_embeds is not None and embeds.dtype != dtype:
            log("ModelRunner input_embeds dtype", f"cast to {dtype}")
            result["input_embeds"] = forward_batch.input_embeds.to(dtype)
        return result

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs", around, HookType.AROUND
    )


def _skip_batch_invariant_kernels() -> None:
    """``--enable-deterministic-inference`` switches on SGLang's batch-invariant
    Triton kernels, which need a GPU. On a CPU keep torch's own kernels (run to run
    deterministic for a fixed batch) so that per-request sampling seeds still work."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, runner, *args, **kwargs):
        log_fallback("batch-invariant kernels", "skipped on CPU; sampling seeds still honoured")
        return None

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
        around,
        HookType.AROUND,
    )


def _mla_on_torch_native() -> None:
    """DeepSeek-family (MLA) models pick their attention method per backend; with no
    entry for torch_native they take Triton's choice, whose prefill (MHA over
    decompressed K/V) torch_native cannot serve from the latent cache. On torch_native
    every MLA forward uses the absorbed path, which reads the latent cache."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    def handle_attention_torch_native(attn, forward_batch):
        log_fallback("MLA on torch_native", "absorbed MLA for every forward")
        return _dispatch_mla_subtype(attn, forward_batch)

    AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


def install() -> None:
    """Install every CPU fallback (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from . import boot

    boot.activate()
    _patch_record_stream()
    _allow_torch_native_choices()
    input_embeds_in_model_dtype()
    _skip_batch_invariant_kernels()
    _mla_on_torch_native()
