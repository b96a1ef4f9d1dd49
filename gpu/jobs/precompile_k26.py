"""Compile the JIT kernels the K2.6 rank needs and the small pair does not: SGLang's Marlin
MoE GEMM for bf16 activations with INT4 experts, in the specialisations its fused MoE picks
(about 5 minutes of nvcc each on the H200, where a server start would otherwise spend them;
built in parallel). A no-op for those the carried cache already holds.

    python gpu/jobs/precompile_k26.py     # inside gpu/device.sh (its cache variables)
"""

import concurrent.futures
import time

import torch
from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module

# (is_ep, has_bias, expert_ids_are_sorted, zero_inactive_output, has_inactive_prefix_count) at
# TP-1 without expert parallelism, as seen in the cache after serving the rank
# (sgl_kernel_jit_moe_wna16_marlin_bf16_t_<flags>): the gate/up GEMM, then the down GEMM that
# zeroes inactive rows.
VARIANTS = [(False, False, True, False, True), (False, False, True, True, True)]


def build(flags: tuple) -> str:
    began = time.monotonic()
    _jit_moe_wna16_marlin_module(torch.bfloat16, *flags)
    return f"[precompile_k26] Marlin MoE {flags} ready after {time.monotonic() - began:.0f} s"


with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
    for line in pool.map(build, VARIANTS):
        print(line, flush=True)
