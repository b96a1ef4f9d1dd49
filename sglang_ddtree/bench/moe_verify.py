"""Verify cost of Kimi K2.6's INT4 Marlin MoE through SGLang's own kernels, as a function of M.

M is the number of tokens in one target forward (verify width = streams x (budget + 1)).
The routed-expert path mirrors ``sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe``
step by step (block-size choice, alignment dispatch, both ``moe_wna16_marlin_gemm`` calls
with the same flags, SiLU-and-mul, top-k sum), calling SGLang 0.5.23's JIT kernels directly
so that only the kernel modules have to import.  Weights are random INT4 (uint4b8, group 32)
packed GPTQ-style and converted with SGLang's ``gptq_marlin_repack`` kernel and its Marlin
scale permutation, exactly as SGLang's weight loader does; the output is checked against a
float32 dequantised reference before anything is timed.

Timed, per M: routing (router GEMM -> softmax top-k), the expert MLP core (alignment + GEMM1 +
SiLU-and-mul + GEMM2: the quantity in docs/anchors.md), the top-k combine, and for composing
a whole layer the bf16 shared expert (FFN 2048) and the dense first-layer MLP (FFN 18432),
each at full size and as a 1/8 tensor-parallel shard.  Two timing modes: eager (CUDA events
around one call, host launch gaps included: how the anchors were measured) and CUDA-graph
replay (what a served model sees).  Bandwidth is compared with a device-to-device copy
measured in the same run.

    python -m sglang_ddtree.bench.moe_verify                 # full sweep -> bench_results/
    python -m sglang_ddtree.bench.moe_verify --make-bundle .carry/sgl   # on a CPU host

``--make-bundle`` prepares what a GPU host without SGLang needs: the JIT kernels compiled for
sm_90a (nvcc on this host) and a trimmed copy of the installed SGLang Python package;
``--bundle DIR`` on the GPU host makes the benchmark use them.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

M_SWEEP = (1, 2, 4, 8, 9, 16, 32, 33, 64, 65, 90, 128, 256, 512, 1024)

# docs/anchors.md, "SGLang's INT4 Marlin MoE measured on our H200": M -> (full ms, shard ms).
ANCHOR_H200 = {
    1: (0.219, 0.229),
    4: (0.343, 0.219),
    8: (0.558, 0.210),
    16: (0.863, 0.237),
    32: (1.357, 0.315),
    64: (2.046, 0.405),
    128: (2.643, 0.487),
    256: (3.041, 0.555),
    512: (3.609, 0.639),
    1024: (6.027, 0.940),
}
# The seed system (RTX PRO 6000 Blackwell, one GPU, full size): M -> (ms, us/token).
SEED_BLACKWELL = {
    1: (0.151, 150.6),
    9: (1.180, 131.2),
    32: (3.171, 99.1),
    90: (5.189, 57.7),
    256: (7.018, 27.4),
    1024: (7.0, 6.85),
}


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


def _interp_log(ms: Sequence[float], ts: Sequence[float], m: float) -> float:
    """Piecewise-linear interpolation of t over log2(M)."""
    xs = [math.log2(x) for x in ms]
    x = math.log2(m)
    if x <= xs[0]:
        return ts[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ts[i - 1] + f * (ts[i] - ts[i - 1])
    return ts[-1]


def plateau_m(ms: Sequence[int], ts: Sequence[float], ref_m: int = 512, tol: float = 0.2) -> int | None:
    """Smallest swept M whose per-call time is within ``tol`` of the time at ``ref_m``.

    At ``ref_m`` every expert's weights are streamed and the GEMMs are not yet
    compute-bound; the plateau is where a verify forward already costs (1 - tol) of that,
    so widening it further is nearly free until compute takes over.
    """
    if ref_m not in ms:
        return None
    t_ref = ts[list(ms).index(ref_m)]
    for m, t in zip(ms, ts):
        if t >= (1.0 - tol) * t_ref:
            return m
    return None


def compute_bound_onset(ms: Sequence[int], ts: Sequence[float], ratio: float = 1.5) -> int | None:
    """Smallest swept M from which doubling M costs at least ``ratio`` x the time (interpolated)."""
    for m in ms:
        if 2 * m > ms[-1]:
            break
        if m >= 64 and _interp_log(ms, ts, 2 * m) / _interp_log(ms, ts, m) >= ratio:
            return m
    return None


# =========================================================================== SGLang kernels

_JIT_MODULES = ("moe_wna16_marlin", "moe_align", "moe_align_single_token", "gptq_marlin_repack")


def _install_placeholders() -> None:
    """Placeholders for two modules SGLang's top-level package imports but the kernels never use."""
    if importlib.util.find_spec("IPython") is None:
        ipy = types.ModuleType("IPython")
        disp = types.ModuleType("IPython.display")
        disp.HTML = lambda *a, **k: None
        disp.display = lambda *a, **k: None
        ipy.display = disp
        ipy.get_ipython = lambda: None  # matplotlib asks for a running shell
        sys.modules.setdefault("IPython", ipy)
        sys.modules.setdefault("IPython.display", disp)
    if importlib.util.find_spec("sniffio") is None:
        sn = types.ModuleType("sniffio")

        class AsyncLibraryNotFoundError(RuntimeError):
            pass

        def current_async_library():
            raise AsyncLibraryNotFoundError("placeholder")

        sn.AsyncLibraryNotFoundError = AsyncLibraryNotFoundError
        sn.current_async_library = current_async_library
        sys.modules.setdefault("sniffio", sn)


def _scalar_types():
    """``sgl_kernel.scalar_type.scalar_types`` without running ``sgl_kernel/__init__`` (which
    loads compiled ops that only match the torch they were built for)."""
    try:
        from sgl_kernel.scalar_type import scalar_types

        return scalar_types
    except ImportError:
        pass
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sgl_kernel is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "scalar_type.py"
    name = "sgl_kernel_scalar_type"
    mspec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[name] = mod
    mspec.loader.exec_module(mod)
    return mod.scalar_types


def _sglang_functions(relpath: str, names: Sequence[str], namespace: dict) -> dict:
    """Execute only the named top-level functions of an SGLang source file.

    Used for the pure-torch Marlin scale permutation in ``marlin_utils.py``, whose module
    imports reach far into SGLang's runtime; the functions themselves need only torch.
    """
    spec = importlib.util.find_spec("sglang")
    src_path = Path(list(spec.submodule_search_locations)[0]) / relpath
    tree = ast.parse(src_path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in body}
    if missing:
        raise ImportError(f"{relpath}: functions {sorted(missing)} not found")
    code = compile(ast.Module(body=body, type_ignores=[]), str(src_path), "exec")
    ns = dict(namespace)
    exec(code, ns)  # noqa: S102 - SGLang's own source, read from the installed package
    return {n: ns[n] for n in names}


def _use_prebuilt(modules: Sequence[types.ModuleType], jit_dir: Path) -> None:
    """Route each kernel module's ``load_jit`` to a prebuilt ``<module name>.so`` when one exists."""
    from sglang.kernels.jit.utils.compile import spec as _spec

    prefix = _spec._MODULE_NAME_PREFIX

    for mod in modules:
        real = mod.load_jit
        if getattr(real, "_prebuilt", False):
            continue

        def load(*args, _real=real, **kwargs):
            so = jit_dir / f"{prefix}{'_'.join(str(a) for a in args)}.so"
            if so.exists():
                from tvm_ffi import load_module

                try:
                    return load_module(str(so))
                except Exception as exc:  # fall back to compiling
                    print(f"[moe_verify] prebuilt {so.name} failed to load ({exc}); compiling", flush=True)
            return _real(*args, **kwargs)

        load._prebuilt = True
        mod.load_jit = load


def load_sglang_kernels(bundle: str | os.PathLike | None = None) -> SimpleNamespace:
    """Import SGLang's Marlin MoE, alignment and repack kernels (and nothing else of SGLang)."""
    if bundle:
        jit_dir = Path(bundle) / "jit"
    _install_placeholders()
    t0 = time.time()
    from sglang.kernels.ops.moe import (
        moe_align,
        moe_align_single_token,
        moe_align_small_numel,
        moe_wna16_marlin,
    )
    from sglang.kernels.ops.quantization import gptq_marlin_repack

    if bundle and jit_dir.is_dir():
        _use_prebuilt([moe_wna16_marlin, moe_align, moe_align_single_token, gptq_marlin_repack], jit_dir)
    perm = _sglang_functions(
        "srt/layers/quantization/marlin_utils.py",
        ["get_scale_perms", "marlin_permute_scales", "marlin_moe_permute_scales"],
        {"torch": torch},
    )
    return SimpleNamespace(
        marlin_gemm=moe_wna16_marlin.moe_wna16_marlin_gemm,
        align_jit=moe_align.moe_align_block_size,
        align_single_token=moe_align_single_token.moe_align_single_token,
        align_small_numel=moe_align_small_numel.moe_align_small_numel,
        small_numel_limit=moe_align_small_numel.SMALL_NUMEL_LIMIT,
        repack=gptq_marlin_repack.gptq_marlin_repack,
        permute_scales=perm["marlin_moe_permute_scales"],
        uint4b8=_scalar_types().uint4b8,
        import_s=time.time() - t0,
    )


# =========================================================================== the layer


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


# =========================================================================== the sweep


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_moe(
    sg,
    shape: MoEShape,
    ms: Sequence[int],
    copy_gbs: float,
    reps: int,
    check_ms=(1, 9, 33),
    into=None,
    on_row=None,
    routing: str = "router",
) -> dict:
    """Check, then time every M; fills and returns ``into`` (a dict), calling ``on_row()`` after each M.

    routing: "router" (router GEMM -> softmax top-k on random tokens: somewhat uneven expert
    loads, as a real router gives) or "uniform" (distinct uniformly random experts per token).
    """
    from sglang_ddtree.bench._stamp import time_eager, time_graph

    res = {} if into is None else into
    graph_ok = [True]

    def tg(fn):
        """CUDA-graph median, or NaN for the rest of the sweep if capture is refused."""
        if not graph_ok[0]:
            return float("nan")
        try:
            return time_graph(fn, reps)["median_ms"]
        except Exception as exc:
            graph_ok[0] = False
            res["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(
                f"[moe_verify] CUDA-graph capture failed, eager only from here: {res['graph_error']}",
                flush=True,
            )
            torch.cuda.synchronize()
            return float("nan")

    dev = "cuda"
    t0 = time.time()
    moe = MarlinMoE(sg, shape, dev, seed=shape.ffn)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    gen = torch.Generator(device=dev).manual_seed(1234)
    router_w = torch.randn(shape.num_experts, shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    router_w *= shape.hidden**-0.5

    def inputs(m):
        x = torch.randn(m, shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        if routing == "uniform":
            w, ids = route_uniform(m, shape.num_experts, shape.top_k, gen, dev)
        else:
            w, ids = route(x, router_w, shape.top_k)
        return x, w, ids

    checks = []
    for m in check_ms:
        x, w, ids = inputs(m)
        out = moe(x, w, ids)
        torch.cuda.synchronize()
        err = _rel_err(out, moe.reference(x, w, ids))
        ok = bool(torch.isfinite(out).all()) and err < 2e-2
        path = align_path(m, shape.top_k, shape.num_experts, sg.small_numel_limit)
        checks.append({"M": m, "align_path": path, "rel_err": err, "ok": ok})
        print(
            f"[moe_verify] ffn={shape.ffn} check M={m}: rel_err={err:.2e} {'ok' if ok else 'FAILED'}",
            flush=True,
        )
    moe.drop_reference()
    torch.cuda.empty_cache()

    eb = shape.expert_weight_bytes()
    rows = []
    res.update(
        shape=asdict(shape),
        routing=routing,
        expert_weight_bytes=eb,
        build_s=build_s,
        checks=checks,
        rows=rows,
    )
    for m in ms:
        x, w, ids = inputs(m)
        touched = int(ids.unique().numel())

        def core(x=x, w=w, ids=ids):
            return moe.experts(x, w, ids)

        def core_combine(x=x, w=w, ids=ids):
            return moe(x, w, ids)

        def router(x=x):
            return route(x, router_w, shape.top_k)

        def layer(x=x):
            w2, ids2 = route(x, router_w, shape.top_k)
            return moe(x, w2, ids2)

        r = {
            "M": m,
            "experts_touched": touched,
            "experts_expected": expected_experts_touched(m, shape.num_experts, shape.top_k),
            "block_size_m": marlin_block_size_m(m, shape.top_k, shape.num_experts),
            "align_path": align_path(m, shape.top_k, shape.num_experts, sg.small_numel_limit),
            "core_eager": time_eager(core, reps)["median_ms"],
            "core_graph": tg(core),
            "core_combine_graph": tg(core_combine),
            "router_graph": tg(router),
            "router_eager": time_eager(router, reps)["median_ms"],
            "layer_graph": tg(layer),
            "layer_eager": time_eager(layer, reps)["median_ms"],
        }
        r["weight_bytes"] = touched * eb
        for mode in ("eager", "graph"):
            t = r[f"core_{mode}"] / 1e3
            r[f"weight_gbs_{mode}"] = r["weight_bytes"] / t / 1e9
            r[f"bw_frac_{mode}"] = r[f"weight_gbs_{mode}"] / copy_gbs
            r[f"us_per_token_{mode}"] = r[f"core_{mode}"] * 1e3 / m
        rows.append(r)
        if on_row:
            on_row()
        print(
            f"[moe_verify] ffn={shape.ffn} M={m:5d} touched={touched:3d} core eager {r['core_eager']:.3f} ms "
            f"graph {r['core_graph']:.3f} ms ({r['weight_gbs_graph']:.0f} GB/s) layer {r['layer_graph']:.3f} ms",
            flush=True,
        )
    moe = None
    torch.cuda.empty_cache()
    ms_l = [r["M"] for r in rows]
    res["plateau"] = {
        mode: {
            "plateau_m": plateau_m(ms_l, [r[f"core_{mode}"] for r in rows]),
            "compute_bound_onset_m": compute_bound_onset(ms_l, [r[f"core_{mode}"] for r in rows]),
        }
        for mode in ("eager", "graph")
    }
    return res


def sweep_dense(hidden: int, ffn: int, ms: Sequence[int], copy_gbs: float, reps: int) -> dict:
    from sglang_ddtree.bench._stamp import time_eager, time_graph

    mlp = DenseMLP(hidden, ffn)
    rows = []
    for m in ms:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

        def fwd(x=x):
            return mlp(x)

        r = {"M": m, "eager": time_eager(fwd, reps)["median_ms"], "graph": time_graph(fwd, reps)["median_ms"]}
        r["weight_gbs_graph"] = mlp.weight_bytes() / (r["graph"] / 1e3) / 1e9
        r["bw_frac_graph"] = r["weight_gbs_graph"] / copy_gbs
        rows.append(r)
    return {"hidden": hidden, "ffn": ffn, "weight_bytes": mlp.weight_bytes(), "rows": rows}


# =========================================================================== report


def render_markdown(res: dict) -> str:
    from sglang_ddtree.bench._stamp import md_table, stamp_markdown

    st = res["stamp"]
    out = [
        "# INT4 Marlin MoE verify cost at Kimi K2.6 shapes",
        "",
        stamp_markdown(st),
        "",
        f"Measured ceilings in this run: device-to-device copy **{res['copy_gbs']:.0f} GB/s** (read + write), "
        f"bf16 matmul **{res['matmul_tflops']:.0f} TFLOP/s**. SGLang kernel import {res['import_s']:.1f} s, "
        f"first calls (JIT load or compile) {res['jit_s']:.1f} s. Timings: median of {res['reps']} CUDA-event "
        "samples; *eager* = one call between events, host launch gaps included (how docs/anchors.md was "
        "measured); *graph* = CUDA-graph replay (what a served model sees).",
        "",
    ]
    for moe in res["moe"].values():
        sh = moe["shape"]
        out += [
            f"## Routed experts, expert FFN {sh['ffn']} ({'one GPU, full' if sh['ffn'] == 2048 else 'one TP-8 shard'})",
            "",
            f"E={sh['num_experts']}, top-{sh['top_k']}, hidden {sh['hidden']}, group {sh['group_size']}, uint4b8, "
            f"routing: {moe.get('routing', 'router')}; "
            f"{moe['expert_weight_bytes'] / 1e6:.2f} MB streamed per touched expert. Correctness against a float32 "
            "dequantised reference: "
            + ", ".join(f"M={c['M']} ({c['align_path']}) rel err {c['rel_err']:.1e} {'ok' if c['ok'] else 'FAILED'}" for c in moe["checks"]),
            "",
        ]  # fmt: skip
        rows = []
        for r in moe["rows"]:
            anchor = ANCHOR_H200.get(r["M"])
            a = anchor[0 if sh["ffn"] == 2048 else 1] if anchor and sh["ffn"] in (2048, 256) else None
            rows.append([
                r["M"], r["experts_touched"], r["align_path"], r["core_eager"], r["us_per_token_eager"],
                f"{a:.3f} ({r['core_eager'] / a:.2f}x)" if a else "-",
                r["core_graph"], r["us_per_token_graph"], r["weight_gbs_graph"], f"{100 * r['bw_frac_graph']:.0f}%",
                r["router_graph"], r["core_combine_graph"] - r["core_graph"], r["layer_graph"],
            ])  # fmt: skip
        out.append(md_table(
            ["M", "experts touched", "align", "core eager ms", "us/token", "anchor ms (ratio)", "core graph ms",
             "us/token", "weight GB/s", "of copy BW", "router ms", "combine ms", "layer graph ms"], rows))  # fmt: skip
        p = moe["plateau"]
        out += [
            "",
            f"Plateau M (first M within 20% of the M=512 time): eager **{p['eager']['plateau_m']}**, graph "
            f"**{p['graph']['plateau_m']}**; compute-bound onset (doubling M costs >= 1.5x): eager "
            f"{p['eager']['compute_bound_onset_m']}, graph {p['graph']['compute_bound_onset_m']}.",
            "",
        ]
    if res["dense"]:
        out += ["## bf16 dense MLPs (shared expert, first-layer dense MLP), graph replay", ""]
        names = list(res["dense"])
        ms = [r["M"] for r in res["dense"][names[0]]["rows"]]
        rows = [[m] + [res["dense"][n]["rows"][i]["graph"] for n in names] for i, m in enumerate(ms)]
        out.append(md_table(["M"] + [f"{n} ms" for n in names], rows))
        out += ["", "Weight bandwidth at M=1 (graph): " + ", ".join(
            f"{n} {res['dense'][n]['rows'][0]['weight_gbs_graph']:.0f} GB/s ({100 * res['dense'][n]['rows'][0]['bw_frac_graph']:.0f}%)"
            for n in names), ""]  # fmt: skip
    return "\n".join(out)


def plot(res: dict, path: Path) -> Path | None:
    from sglang_ddtree.bench._stamp import plot_lines

    series = {}
    for moe in res["moe"].values():
        f = moe["shape"]["ffn"]
        ms = [r["M"] for r in moe["rows"]]
        series[f"routed FFN {f}, eager"] = (ms, [r["core_eager"] for r in moe["rows"]])
        series[f"routed FFN {f}, graph"] = (ms, [r["core_graph"] for r in moe["rows"]])
    series["anchor FFN 2048 (eager)"] = (list(ANCHOR_H200), [v[0] for v in ANCHOR_H200.values()])
    series["anchor FFN 256 (eager)"] = (list(ANCHOR_H200), [v[1] for v in ANCHOR_H200.values()])
    return plot_lines(path, series, title=f"INT4 Marlin MoE per call, {res['stamp'].get('device')}",
                      xlabel="M (tokens per forward)", ylabel="ms per call", logy=True)  # fmt: skip


# =========================================================================== bundle for a GPU host


BUNDLE_VARIANTS = [
    # (module, function, args) -- the variants fused_marlin_moe and this benchmark reach on sm_90.
    (
        "sglang.kernels.ops.moe.moe_wna16_marlin",
        "_jit_moe_wna16_marlin_module",
        ("bf16", False, False, True, False, True),
    ),
    (
        "sglang.kernels.ops.moe.moe_wna16_marlin",
        "_jit_moe_wna16_marlin_module",
        ("bf16", False, False, True, True, True),
    ),
    ("sglang.kernels.ops.moe.moe_align", "_jit_moe_align_module", ("int32", True, False, False)),
    ("sglang.kernels.ops.moe.moe_align_single_token", "_jit_align_single_token_module", (True,)),
    ("sglang.kernels.ops.quantization.gptq_marlin_repack", "_jit_gptq_marlin_repack_module", ()),
]
_SLIM_EXCLUDE = ("multimodal_gen", "test", "benchmark")
_BUNDLE_PREFIX = {
    "sglang.kernels.ops.moe.moe_wna16_marlin": "moe_wna16_marlin",
    "sglang.kernels.ops.moe.moe_align": "moe_align_block_size",
    "sglang.kernels.ops.moe.moe_align_single_token": "moe_align_single_token",
    "sglang.kernels.ops.quantization.gptq_marlin_repack": "gptq_marlin_repack",
}


def _bundle_so_name(module: str, args: tuple) -> str:
    """File name load_jit gives a variant (the single-token kernel also keys on PDL, on for sm_90)."""
    cpp = {"bf16": "bf16_t", "int32": "int32_t"}
    parts = [cpp.get(a, a) if isinstance(a, str) else str(a).lower() for a in args]
    if module.endswith("moe_align_single_token"):
        parts = ["true"] + parts
    return "sgl_kernel_jit_" + "_".join([_BUNDLE_PREFIX[module]] + parts) + ".so"


def make_bundle(out: Path, arch=(9, 0), jobs: int | None = None) -> None:
    """Compile the JIT kernels for ``arch`` here (nvcc; no GPU needed) and pack a trimmed copy
    of the installed SGLang Python package, for a GPU host that has neither."""
    import concurrent.futures as cf

    out.mkdir(parents=True, exist_ok=True)
    (out / "jit").mkdir(exist_ok=True)
    cache = out / "jit-cache"
    env = dict(os.environ, SGLANG_JIT_CACHE_DIR=str(cache))
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    code = (
        "import importlib, sys, torch\n"
        "from sglang.kernels.jit.utils import arch\n"
        "from sglang.kernels.jit.utils.compile import loader\n"
        "loader._load = lambda lib: None\n"
        "mod, fn, args = sys.argv[1], sys.argv[2], eval(sys.argv[3])\n"
        "args = tuple(getattr(torch, 'bfloat16' if a == 'bf16' else 'int32') if isinstance(a, str) else a for a in args)\n"
        f"with arch.override_jit_cuda_arch({arch[0]}, {arch[1]}):\n"
        "    getattr(importlib.import_module(mod), fn)(*args)\n"
    )
    t0 = time.time()
    have = {p.name for p in (out / "jit").glob("*.so")}
    todo = [(m, f, a) for m, f, a in BUNDLE_VARIANTS if _bundle_so_name(m, a) not in have]
    with cf.ThreadPoolExecutor(jobs or max(1, len(todo))) as pool:
        futs = [
            pool.submit(
                subprocess.run,
                [sys.executable, "-c", code, m, f, repr(a)],
                env=env,
                capture_output=True,
                text=True,
            )
            for m, f, a in todo
        ]
        for (_m, f, a), fu in zip(todo, futs):
            res = fu.result()
            status = "ok" if res.returncode == 0 else "FAILED:\n" + res.stderr[-3000:]
            print(f"[bundle] {f}{a}: {status}", flush=True)
    for so in cache.rglob("*.so"):
        shutil.copy2(so, out / "jit" / so.name)
    print(
        f"[bundle] compiled in {time.time() - t0:.0f} s: {sorted(p.name for p in (out / 'jit').glob('*.so'))}"
    )

    sg_dir = Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0])
    sk = importlib.util.find_spec("sgl_kernel")

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if len(parts) > 1 and parts[0] == "sglang" and parts[1] in _SLIM_EXCLUDE:
            return None
        if info.name.endswith((".so", ".pyc")) or "__pycache__" in parts:
            return None
        return info

    with tarfile.open(out / "site.tar.gz", "w:gz") as tar:
        tar.add(sg_dir, arcname="sglang", filter=keep)
        if sk is not None:
            sk_dir = Path(list(sk.submodule_search_locations)[0])
            tar.add(sk_dir / "scalar_type.py", arcname="sgl_kernel/scalar_type.py")
            info = tarfile.TarInfo("sgl_kernel/__init__.py")
            info.size = 0
            tar.addfile(info)  # the pure-Python part only: no compiled ops to load
    print(f"[bundle] {out / 'site.tar.gz'}: {(out / 'site.tar.gz').stat().st_size / 1e6:.1f} MB")


# =========================================================================== main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: bench_results/)")
    ap.add_argument("--name", default="moe_verify")
    ap.add_argument("--ms", type=int, nargs="+", default=list(M_SWEEP))
    ap.add_argument("--ffn", type=int, nargs="+", default=[2048, 256], help="per-rank expert FFN sizes")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--routing", choices=["router", "uniform"], default="router")
    ap.add_argument("--no-dense", dest="dense", action="store_false", help="skip the bf16 dense MLPs")
    ap.add_argument("--bundle", default=None, help="folder from --make-bundle (prebuilt JIT kernels)")
    ap.add_argument("--make-bundle", default=None, metavar="DIR", help="CPU host: build the bundle and exit")
    args = ap.parse_args(argv)

    if args.make_bundle:
        make_bundle(Path(args.make_bundle))
        return 0

    from sglang_ddtree.bench import _stamp

    st = _stamp.stamp()
    print(f"[moe_verify] {st}", flush=True)
    copy_gbs = _stamp.copy_bandwidth_gbs()
    tflops = _stamp.matmul_tflops()
    print(f"[moe_verify] copy {copy_gbs:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", flush=True)
    sg = load_sglang_kernels(args.bundle)
    print(f"[moe_verify] SGLang kernels imported in {sg.import_s:.1f} s", flush=True)

    # First calls (JIT load or compile) for every variant, on a small shape.
    t0 = time.time()
    warm = MarlinMoE(sg, MoEShape(num_experts=16, ffn=256), seed=7)
    for m in (1, 2, 16):
        x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
        w, ids = route(x, torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16), 8)
        warm(x, w, ids)
    torch.cuda.synchronize()
    del warm
    jit_s = time.time() - t0
    print(f"[moe_verify] kernels ready in {jit_s:.1f} s", flush=True)

    res = {"stamp": st, "copy_gbs": copy_gbs, "matmul_tflops": tflops, "import_s": sg.import_s, "jit_s": jit_s,
           "reps": args.reps, "moe": {}, "dense": {}}  # fmt: skip
    out_dir = _stamp.results_dir(args.out)

    def checkpoint():
        _stamp.write_json(out_dir / f"{args.name}.json", res)

    for f in args.ffn:
        res["moe"][f"ffn{f}"] = {}
        sweep_moe(sg, MoEShape(ffn=f), args.ms, copy_gbs, args.reps, into=res["moe"][f"ffn{f}"], on_row=checkpoint,
                  routing=args.routing)  # fmt: skip
    dense = (
        ("shared_ffn2048", 2048),
        ("shared_ffn256", 256),
        ("dense_ffn18432", 18432),
        ("dense_ffn2304", 2304),
    )
    for label, ffn in dense if args.dense else ():
        res["dense"][label] = sweep_dense(7168, ffn, args.ms, copy_gbs, args.reps)
        print(f"[moe_verify] {label}: M=1 {res['dense'][label]['rows'][0]['graph']:.3f} ms", flush=True)
        checkpoint()

    paths = _stamp.write_outputs(out_dir, args.name, res, render_markdown(res))
    png = plot(res, out_dir / f"{args.name}.png")
    print("[moe_verify] wrote", [str(p) for p in paths + ([png] if png else [])], flush=True)
    ok = all(c["ok"] for m in res["moe"].values() for c in m["checks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
