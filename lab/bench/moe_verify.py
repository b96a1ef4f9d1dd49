"""Verify cost of Kimi K2.6's INT4 Marlin MoE through SGLang's own kernels, as a function of M.

M is the number of tokens in one target forward (verify width = streams x (budget + 1)).
The layer (``moe_layer.MarlinMoE``) calls SGLang 0.5.23's JIT kernels directly, loaded by
``jit_bundle`` so that only the kernel modules have to import; its output is checked against
a float32 dequantised reference before anything is timed.

Timed, per M: routing (router GEMM -> softmax top-k), the expert MLP core (alignment + GEMM1 +
SiLU-and-mul + GEMM2: the quantity in docs/anchors.md), the top-k combine, and for composing
a whole layer the bf16 shared expert (FFN 2048) and the dense first-layer MLP (FFN 18432),
each at full size and as a 1/8 tensor-parallel shard.  Two timing modes: eager (CUDA events
around one call, host launch gaps included: how the anchors were measured) and CUDA-graph
replay (what a served model sees).  Bandwidth is compared with a device-to-device copy
measured in the same run.

    python -m lab.bench.moe_verify                 # full sweep -> results/
    python -m lab.bench.moe_verify --make-bundle .carry/sgl   # on a CPU host

``--make-bundle`` prepares what a GPU host without SGLang needs: the JIT kernels compiled for
sm_90a (nvcc on this host) and a trimmed copy of the installed SGLang Python package;
``--bundle DIR`` on the GPU host makes the benchmark use them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lab.bench.jit_bundle import load_sglang_kernels, make_bundle
from lab.bench.moe_layer import (
    M_SWEEP,
    DenseMLP,
    MarlinMoE,
    MoEShape,
    align_path,
    expected_experts_touched,
    marlin_block_size_m,
    route,
    route_uniform,
)
from lab.bench.moe_report import plot, render_markdown
from sglang_ddtree.kernels.compare import relative_difference


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


# =========================================================================== sweeps


class _GraphTimer:
    """CUDA-graph medians; NaN for the rest of the sweep once capture is refused (noted in ``res``)."""

    def __init__(self, reps: int, res: dict):
        self.reps, self.res, self.ok = reps, res, True

    def __call__(self, fn) -> float:
        from lab.bench._stamp import time_graph

        if not self.ok:
            return float("nan")
        try:
            return time_graph(fn, self.reps)["median_ms"]
        except Exception as exc:
            self.ok = False
            self.res["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(
                f"[moe_verify] CUDA-graph capture failed, eager only from here: {self.res['graph_error']}",
                flush=True,
            )
            torch.cuda.synchronize()
            return float("nan")


class _Inputs:
    """Tokens and their routing for one M, from one seeded generator (the same in every run)."""

    def __init__(self, shape: MoEShape, routing: str, dev: str = "cuda"):
        self.shape, self.routing, self.dev = shape, routing, dev
        self.gen = torch.Generator(device=dev).manual_seed(1234)
        self.router_w = torch.randn(
            shape.num_experts, shape.hidden, device=dev, dtype=torch.bfloat16, generator=self.gen
        )
        self.router_w *= shape.hidden**-0.5

    def __call__(self, m: int):
        x = torch.randn(m, self.shape.hidden, device=self.dev, dtype=torch.bfloat16, generator=self.gen)
        if self.routing == "uniform":
            w, ids = route_uniform(m, self.shape.num_experts, self.shape.top_k, self.gen, self.dev)
        else:
            w, ids = route(x, self.router_w, self.shape.top_k)
        return x, w, ids


def _check_moe(moe: MarlinMoE, sg, shape: MoEShape, inputs: _Inputs, check_ms) -> list[dict]:
    """The layer against its float32 dequantised reference, before anything is timed."""
    checks = []
    for m in check_ms:
        x, w, ids = inputs(m)
        out = moe(x, w, ids)
        torch.cuda.synchronize()
        err = relative_difference(out, moe.reference(x, w, ids))
        ok = bool(torch.isfinite(out).all()) and err < 2e-2
        path = align_path(m, shape.top_k, shape.num_experts, sg.small_numel_limit)
        checks.append({"M": m, "align_path": path, "rel_err": err, "ok": ok})
        print(
            f"[moe_verify] ffn={shape.ffn} check M={m}: rel_err={err:.2e} {'ok' if ok else 'FAILED'}",
            flush=True,
        )
    return checks


def _time_moe_row(moe: MarlinMoE, sg, shape: MoEShape, inputs: _Inputs, m: int, tg: _GraphTimer, reps: int):
    from lab.bench._stamp import time_eager

    x, w, ids = inputs(m)
    touched = int(ids.unique().numel())

    def core():
        return moe.experts(x, w, ids)

    def core_combine():
        return moe(x, w, ids)

    def router():
        return route(x, inputs.router_w, shape.top_k)

    def layer():
        w2, ids2 = route(x, inputs.router_w, shape.top_k)
        return moe(x, w2, ids2)

    return {
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


def _add_bandwidth(r: dict, expert_weight_bytes: int, copy_gbs: float) -> None:
    """Weight bytes streamed by the touched experts, as GB/s and as a fraction of the copy's."""
    r["weight_bytes"] = r["experts_touched"] * expert_weight_bytes
    for mode in ("eager", "graph"):
        t = r[f"core_{mode}"] / 1e3
        r[f"weight_gbs_{mode}"] = r["weight_bytes"] / t / 1e9
        r[f"bw_frac_{mode}"] = r[f"weight_gbs_{mode}"] / copy_gbs
        r[f"us_per_token_{mode}"] = r[f"core_{mode}"] * 1e3 / r["M"]


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
    res = {} if into is None else into
    tg = _GraphTimer(reps, res)
    t0 = time.time()
    moe = MarlinMoE(sg, shape, "cuda", seed=shape.ffn)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    inputs = _Inputs(shape, routing)
    checks = _check_moe(moe, sg, shape, inputs, check_ms)
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
        r = _time_moe_row(moe, sg, shape, inputs, m, tg, reps)
        _add_bandwidth(r, eb, copy_gbs)
        rows.append(r)
        if on_row:
            on_row()
        print(
            f"[moe_verify] ffn={shape.ffn} M={m:5d} touched={r['experts_touched']:3d} core eager "
            f"{r['core_eager']:.3f} ms graph {r['core_graph']:.3f} ms ({r['weight_gbs_graph']:.0f} GB/s) "
            f"layer {r['layer_graph']:.3f} ms",
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
    from lab.bench._stamp import time_eager, time_graph

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


# =========================================================================== main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: results/)")
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

    from lab.bench import _stamp

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
