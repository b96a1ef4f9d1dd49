"""GPU bundle mode: SGLang 0.5.23 on the sgl_kernel build the bundle carries.

``gpu/device.sh`` serves SGLang 0.5.23's Python code with sglang-kernel 0.4.5's
compiled ops (the newest build for the GPU machine's torch). Installed by the plugin
as a lab module (``SGLANG_DDTREE_TEST_PLUGIN=lab.gpu_compat``, which that script sets);
a normal install never runs any of this. Each change logs the first time it serves.

* float32 RMSNorm: sgl_kernel 0.4.5's ``rmsnorm`` has no float32 kernel; float32
  servers (the exactness tests) take SGLang's own ``forward_native``.
* float32 drafter inputs: ``ModelRunner`` casts ``input_embeds`` to bf16 whatever the
  model dtype (patches/0001-input-embeds-dtype.md), which a float32 drafter rejects.
"""

from __future__ import annotations

import torch

from sglang_ddtree.first_use_log import FirstUseLog

_INSTALLED = False
log_served = FirstUseLog("lab.gpu_compat", "GPU bundle compatibility served")


def _float32_rmsnorm_native() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, norm, x, *args, **kwargs):
        if x.dtype != torch.float32:
            return original(norm, x, *args, **kwargs)
        log_served("RMSNorm float32", "forward_native: sgl_kernel 0.4.5 has no float32 rmsnorm")
        kwargs.pop("quant_linear", None)
        return norm.forward_native(x, *args[:2], **kwargs)

    HookRegistry.register("sglang.srt.layers.layernorm.RMSNorm.forward_cuda", around, HookType.AROUND)


def install() -> None:
    """Install every bundle compatibility change (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from sglang_ddtree.cpu.fallbacks import input_embeds_in_model_dtype

    _float32_rmsnorm_native()
    input_embeds_in_model_dtype(log_served)
