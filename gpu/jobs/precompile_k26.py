"""Compile the JIT kernel the K2.6 rank needs and the small pair does not: SGLang's Marlin MoE
GEMM for bf16 activations with INT4 experts (about 5 minutes of nvcc on the H200, where a
server start would otherwise spend them). A no-op once the carried cache holds it.

    python gpu/jobs/precompile_k26.py     # inside gpu/device.sh (its cache variables)
"""

import time

import torch
from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module

began = time.monotonic()
# The specialisation SGLang's fused Marlin MoE picks at TP-1 without expert parallelism
# (sgl_kernel_jit_moe_wna16_marlin_bf16_t_false_false_true_false_true in the cache):
# dtype, is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count.
_jit_moe_wna16_marlin_module(torch.bfloat16, False, False, True, False, True)
print(f"[precompile_k26] Marlin MoE kernel ready after {time.monotonic() - began:.0f} s", flush=True)
