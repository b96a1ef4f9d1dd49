"""Kimi K2.6's INT4 Marlin MoE layer through SGLang's own kernels (``MarlinMoE``), with its
float32 reference, the routing, a bf16 dense MLP, and the shape bookkeeping the MoE
benchmarks share (``moe_verify``, ``moe_tp_allreduce``).

The routed-expert path mirrors ``sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe``
step by step (block-size choice, alignment dispatch, both ``moe_wna16_marlin_gemm`` calls
with the same flags, SiLU-and-mul, top-k sum). Weights are random INT4 (uint4b8, group 32)
packed GPTQ-style and converted with SGLang's ``gptq_marlin_repack`` kernel and its Marlin
scale permutation, exactly as SGLang's weight loader does. The kernels come from
``jit_bundle.load_sglang_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

# Tokens per target forward swept by the MoE benchmarks (verify width = streams x (budget + 1)).
M_SWEEP = (1, 2, 4, 8, 9, 16, 32, 33, 64, 65, 90, 128, 256, 512, 1024)


@dataclass(frozen=True)
class MoEShape:
    """One rank's routed-expert layer. ``ffn`` is the per-rank expert intermediate size."""

    num_experts: int = 384
    top_k: int = 8
    hidden: int = 7168
    ffn: int = 2048
    group_size: int = 32

    def expert_weight_bytes(self) -> int:
        """Bytes one expert streams: int4 W13 [hidden, 2 ffn] and W2 [ffn, hidden] plus bf16 group scales."""
        packed = (self.hidden * 2 * self.ffn + self.ffn * self.hidden) // 2
        scales = (
            self.hidden // self.group_size * 2 * self.ffn + self.ffn // self.group_size * self.hidden
        ) * 2
        return packed + scales


def expected_experts_touched(m: int, num_experts: int = 384, top_k: int = 8) -> float:
    """Expected distinct experts hit by m tokens under uniform routing: E (1 - (1 - k/E)^m)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** m)


def marlin_block_size_m(m: int, top_k: int, num_experts: int) -> int:
    """The M block size ``fused_marlin_moe`` picks (its loop over 8, 16, 32, 48, 64)."""
    for block in (8, 16, 32, 48, 64):
        if m * top_k / num_experts / block < 0.9:
            return block
    return 64


def align_path(m: int, top_k: int, num_experts: int, small_numel_limit: int = 64) -> str:
    """Which alignment kernel SGLang 0.5.23 runs for this M (single token / small numel / JIT)."""
    if m == 1:
        return "single_token"
    if m * top_k <= small_numel_limit and num_experts + 1 > 64:
        return "small_numel"
    return "jit_align"


def random_gptq_int4(num_experts: int, size_k: int, size_n: int, group: int, gen: torch.Generator, device):
    """Random uint4b8 weights packed GPTQ-style ([E, K/8, N] int32, row k = 8 r + i at bits 4 i)
    and bf16 group scales [E, K/group, N]."""
    packed = torch.randint(
        -(2**31),
        2**31 - 1,
        (num_experts, size_k // 8, size_n),
        dtype=torch.int32,
        device=device,
        generator=gen,
    )
    scales = (
        torch.rand((num_experts, size_k // group, size_n), device=device, generator=gen) * 3e-3 + 1e-3
    ).to(torch.bfloat16)
    return packed, scales


def dequant_gptq_int4(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [K, N] weights of one expert from its GPTQ int32 packing and group scales."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    q = q.reshape(-1, packed.shape[-1]).float() - 8.0
    return q * scales.float().repeat_interleave(group, dim=0)


class MarlinMoE:
    """SGLang's INT4 Marlin fused MoE at one shape, on valid Marlin-packed random weights."""

    def __init__(
        self, sg: SimpleNamespace, shape: MoEShape, device="cuda", seed: int = 0, keep_reference=True
    ):
        self.sg, self.shape, self.device = sg, shape, device
        gen = torch.Generator(device=device).manual_seed(seed)
        E, H, F, G = shape.num_experts, shape.hidden, shape.ffn, shape.group_size
        q13, s13 = random_gptq_int4(E, H, 2 * F, G, gen, device)  # W13: K = hidden, N = 2 ffn
        q2, s2 = random_gptq_int4(E, F, H, G, gen, device)  # W2: K = ffn, N = hidden
        self.w13, self.w2 = self._repack(q13, H, 2 * F), self._repack(q2, F, H)
        self.s13 = sg.permute_scales(s=s13, size_k=H, size_n=2 * F, group_size=G)
        self.s2 = sg.permute_scales(s=s2, size_k=F, size_n=H, group_size=G)
        self.reference_weights = (q13, s13, q2, s2) if keep_reference else None
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.use_atomic_add = torch.cuda.get_device_capability(device)[0] >= 9

    def _repack(self, packed: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
        """``gptq_marlin_moe_repack``: SGLang's per-expert loop over its repack kernel."""
        E = packed.shape[0]
        out = torch.empty((E, size_k // 16, size_n * 2), dtype=torch.int32, device=packed.device)
        no_perm = torch.empty(0, dtype=torch.int32, device=packed.device)
        for e in range(E):
            out[e] = self.sg.repack(packed[e], no_perm, size_k, size_n, 4)
        return out

    def drop_reference(self) -> None:
        self.reference_weights = None

    # ---- the steps of fused_marlin_moe -------------------------------------------
    def align(self, topk_ids: torch.Tensor, block: int):
        """``moe_align_block_size(..., return_inactive_prefix_count=True)`` as SGLang dispatches it."""
        sg, E = self.sg, self.shape.num_experts
        m = topk_ids.shape[0]
        if m == 1:
            return sg.align_single_token(topk_ids, block, return_inactive_prefix_count=True)
        numel = topk_ids.numel()
        if numel < E + 1:
            max_padded = numel * block
        else:
            max_padded = numel + (E + 1) * (block - 1)
        max_padded = (max_padded + 3) // 4 * 4
        dev = topk_ids.device
        sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
        expert_ids = torch.empty(((max_padded + block - 1) // block,), dtype=torch.int32, device=dev)
        ntp = torch.empty((2,), dtype=torch.int32, device=dev)
        if numel <= sg.small_numel_limit and E + 1 > 64:
            sg.align_small_numel(
                topk_ids, E + 1, block, sorted_ids, expert_ids, ntp, write_inactive_prefix_count=True
            )
        else:
            cumsum = torch.empty((E + 2,), dtype=torch.int32, device=dev)
            sg.align_jit(
                topk_ids,
                E + 1,
                block,
                sorted_ids,
                expert_ids,
                ntp,
                cumsum,
                True,
                write_inactive_prefix_count=True,
            )
        return sorted_ids, expert_ids, ntp

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Alignment + GEMM1 + SiLU-and-mul + GEMM2; returns [M * top_k, hidden] weighted rows."""
        sg, sh = self.sg, self.shape
        m, K = x.shape
        N, topk = sh.ffn, sh.top_k
        block = marlin_block_size_m(m, topk, sh.num_experts)
        sorted_ids, expert_ids, ntp = self.align(topk_ids, block)
        ws = min((max(2 * N, K) // 64) * (sorted_ids.size(0) // block), self.sms * 4)
        workspace = torch.zeros(ws, dtype=torch.int, device=x.device)
        cache2 = torch.empty((m * topk, N), device=x.device, dtype=x.dtype)
        cache13 = torch.empty((m * topk * max(2 * N, K),), device=x.device, dtype=x.dtype)
        cache1 = cache13[: m * topk * 2 * N].view(-1, 2 * N)
        cache3 = cache13[: m * topk * K].view(-1, K)
        common = dict(
            is_ep=False,
            expert_ids_are_sorted=True,
            has_inactive_prefix_count=True,
            b_q_type=sg.uint4b8,
            is_k_full=True,
            use_atomic_add=self.use_atomic_add,
            use_fp32_reduce=True,
            is_zp_float=False,
        )
        cache1 = sg.marlin_gemm(
            x, cache1, self.w13, None, self.s13, None, None, None, None, workspace, sorted_ids, expert_ids, ntp,
            topk_weights, moe_block_size=block, top_k=topk, mul_topk_weights=False, size_m=m, size_n=2 * N,
            size_k=K, **common,
        )  # fmt: skip
        torch.mul(torch.nn.functional.silu(cache1[:, :N]), cache1[:, N:], out=cache2)
        return sg.marlin_gemm(
            cache2, cache3, self.w2, None, self.s2, None, None, None, None, workspace, sorted_ids, expert_ids, ntp,
            topk_weights, moe_block_size=block, top_k=1, mul_topk_weights=True, zero_inactive_output=True,
            size_m=m * topk, size_n=K, size_k=N, **common,
        )  # fmt: skip

    def __call__(self, x, topk_weights, topk_ids) -> torch.Tensor:
        return self.experts(x, topk_weights, topk_ids).view(x.shape[0], self.shape.top_k, -1).sum(dim=1)

    def reference(self, x, topk_weights, topk_ids) -> torch.Tensor:
        """float32 MoE on the dequantised weights (same routing)."""
        q13, s13, q2, s2 = self.reference_weights
        G, N = self.shape.group_size, self.shape.ffn
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for e in topk_ids.unique().tolist():
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = xf[tok] @ dequant_gptq_int4(q13[e], s13[e], G)
            h = torch.nn.functional.silu(h[:, :N]) * h[:, N:]
            y = (h @ dequant_gptq_int4(q2[e], s2[e], G)) * topk_weights[tok, slot, None].float()
            out.index_add_(0, tok, y)
        return out


def route_uniform(m: int, num_experts: int, top_k: int, gen: torch.Generator, device="cuda"):
    """Uniformly random distinct experts per token with random normalised weights (no router)."""
    vals, ids = torch.rand(m, num_experts, device=device, generator=gen).topk(top_k, dim=-1)
    return vals / vals.sum(dim=-1, keepdim=True), ids.to(torch.int32)


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int):
    """Router logits -> softmax top-k (renormalised): fp32 weights, int32 ids."""
    logits = x @ router_w.t()
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids.to(torch.int32)


class DenseMLP:
    """bf16 gated MLP (gate/up fused, SiLU-and-mul, down): shared expert and dense layer."""

    def __init__(self, hidden: int, ffn: int, device="cuda", seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.ffn = ffn
        self.w_gu = (
            torch.randn(2 * ffn, hidden, device=device, generator=g, dtype=torch.bfloat16) * hidden**-0.5
        )
        self.w_d = torch.randn(hidden, ffn, device=device, generator=g, dtype=torch.bfloat16) * ffn**-0.5

    def weight_bytes(self) -> int:
        return (self.w_gu.numel() + self.w_d.numel()) * 2

    def __call__(self, x):
        h = x @ self.w_gu.t()
        return (torch.nn.functional.silu(h[:, : self.ffn]) * h[:, self.ffn :]) @ self.w_d.t()
