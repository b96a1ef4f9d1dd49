"""TP-N verify cost of the MoE layer with its all-reduce: one process per GPU, NCCL.

Each rank runs its tensor-parallel shard of SGLang's INT4 Marlin MoE (expert FFN 2048 / N,
same routing on every rank, as with a replicated router) and then all-reduces the
[M, 7168] bf16 output, for the same M sweep as ``moe_verify``.  Reported per M: the slowest
rank's MoE time, the all-reduce time, MoE + all-reduce back to back, and the effective
scaling against the one-GPU full-size MoE (from ``--baseline-json`` or measured on rank 0).

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): set here at import, before any
process is started, and again inside each worker.

    python -m sglang_ddtree.bench.moe_tp_allreduce --world 8 --bundle .carry/sgl
    torchrun --nproc-per-node 8 -m sglang_ddtree.bench.moe_tp_allreduce --bundle .carry/sgl
    python -m sglang_ddtree.bench.moe_tp_allreduce --dry-run --world 2   # CPU, gloo, stand-in MoE
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang_ddtree.bench.moe_layer import M_SWEEP  # noqa: E402

HIDDEN = 7168


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =========================================================================== timing per backend


def _time_cpu(fn: Callable[[], object], reps: int, warmup: int = 2, aligned: bool = True) -> float:
    """Median ms per call on CPU; with ``aligned`` the ranks start each sample together."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        if aligned:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _time_cuda_batch(fn: Callable[[], object], reps: int, calls: int = 10) -> float:
    """Median over ``reps`` samples of ``calls`` back-to-back calls (ms per call); ranks aligned by a barrier."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / calls)
    return statistics.median(ts)


def _time_cuda(fn: Callable[[], object], reps: int, collective: bool) -> tuple[float, str]:
    """Local work: CUDA-graph replay. Anything with a collective: back-to-back eager batches, the
    same on every rank (a capture that failed on one rank only would leave the ranks out of step)."""
    from sglang_ddtree.bench._stamp import time_graph

    if collective:
        return _time_cuda_batch(fn, reps), "eager_batch"
    dist.barrier()
    return time_graph(fn, reps=reps)["median_ms"], "graph"


# =========================================================================== stand-in for the CPU dry run


class CpuStandInMoE:
    """Two float32 GEMMs of the shard's expert shape over ``top_k`` rows per token (no Marlin)."""

    def __init__(self, hidden: int, ffn: int, top_k: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.top_k, self.ffn = top_k, ffn
        self.w13 = torch.randn(hidden, 2 * ffn, generator=g) * hidden**-0.5
        self.w2 = torch.randn(ffn, hidden, generator=g) * ffn**-0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat_interleave(self.top_k, 0) @ self.w13
        h = torch.nn.functional.silu(h[:, : self.ffn]) * h[:, self.ffn :]
        return (h @ self.w2).view(x.shape[0], self.top_k, -1).sum(1)


# =========================================================================== the worker


def worker(rank: int, world: int, args: argparse.Namespace, init: str) -> dict | None:
    os.environ.update(MULTICAST_OFF)  # the environment of every process, whatever started it
    dry = args.dry_run
    dist.init_process_group("gloo" if dry else "nccl", init_method=init, rank=rank, world_size=world)
    try:
        return _run_rank(rank, world, args)
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    dry = args.dry_run
    hidden = args.hidden
    ffn = args.ffn // world
    rows, baseline = [], {}
    env_seen = {k: os.environ.get(k) for k in MULTICAST_OFF}
    if dry:
        torch.set_num_threads(1)  # the ranks share the host's cores
        moe = CpuStandInMoE(hidden, ffn, seed=rank)
        full = CpuStandInMoE(hidden, args.ffn, seed=99) if rank == 0 else None

        def moe_step(x, w, ids):
            return moe(x)

        def timer(fn, collective):
            return _time_cpu(fn, args.reps), "cpu"

        dtype, dev = torch.float32, "cpu"
    else:
        from sglang_ddtree.bench.jit_bundle import load_sglang_kernels
        from sglang_ddtree.bench.moe_layer import MarlinMoE, MoEShape, route

        torch.cuda.set_device(rank % torch.cuda.device_count())
        sg = load_sglang_kernels(args.bundle)
        moe = MarlinMoE(sg, MoEShape(ffn=ffn, hidden=hidden), seed=1000 + rank, keep_reference=False)
        full = None
        if rank == 0 and args.measure_baseline:
            full = MarlinMoE(sg, MoEShape(ffn=args.ffn, hidden=hidden), seed=7, keep_reference=False)
        router_w = torch.randn(384, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5

        def moe_step(x, w, ids):
            return moe(x, w, ids)

        def timer(fn, collective):
            return _time_cuda(fn, args.reps, collective)

        dtype, dev = torch.bfloat16, "cuda"

    for m in args.ms:
        g = torch.Generator(device=dev).manual_seed(m)  # same tokens, same routing on every rank
        x = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)
        w = ids = None
        if not dry:
            w, ids = route(x, router_w, 8)
        buf = torch.randn(m, hidden, device=dev, dtype=dtype, generator=g)

        def f_moe(x=x, w=w, ids=ids):
            return moe_step(x, w, ids)

        def f_ar(buf=buf):
            dist.all_reduce(buf)

        def f_total(x=x, w=w, ids=ids):
            out = moe_step(x, w, ids)
            dist.all_reduce(out)
            return out

        t_moe, mode = timer(f_moe, False)
        t_ar, mode_ar = timer(f_ar, True)
        t_tot, mode_tot = timer(f_total, True)
        row = {
            "M": m,
            "moe_ms": t_moe,
            "allreduce_ms": t_ar,
            "total_ms": t_tot,
            "modes": [mode, mode_ar, mode_tot],
        }
        if full is not None:
            if dry:
                baseline[m] = _time_cpu(lambda x=x: full(x), args.reps, aligned=False)
            else:
                from sglang_ddtree.bench._stamp import time_graph

                baseline[m] = time_graph(lambda x=x, w=w, ids=ids: full(x, w, ids), reps=args.reps)[
                    "median_ms"
                ]
        rows.append(row)
        if rank == 0:
            print(
                f"[tp] M={m:5d} moe {t_moe:.3f} ms, all-reduce {t_ar:.3f} ms, total {t_tot:.3f} ms",
                flush=True,
            )

    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rows": rows, "env": env_seen})
    if rank != 0:
        return None
    return {"per_rank": gathered, "baseline_ms": baseline}


# =========================================================================== report


def summarise(raw: dict, world: int, baseline_json: str | None) -> dict:
    """Slowest-rank times per M and effective scaling vs the one-GPU full-size MoE."""
    per_rank = raw["per_rank"]
    base = {int(k): v for k, v in raw.get("baseline_ms", {}).items()}
    base_src = "measured on rank 0 in this run" if base else None
    if not base and baseline_json and Path(baseline_json).exists():
        ref = json.loads(Path(baseline_json).read_text())
        base = {r["M"]: r["core_combine_graph"] for r in ref["moe"]["ffn2048"]["rows"]}
        base_src = f"{baseline_json} (ffn2048 core_combine_graph)"
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        m = r0["M"]
        per = [pr["rows"][i] for pr in per_rank]
        row = {
            "M": m,
            "moe_ms_max": max(p["moe_ms"] for p in per),
            "moe_ms_mean": statistics.mean(p["moe_ms"] for p in per),
            "allreduce_ms_max": max(p["allreduce_ms"] for p in per),
            "total_ms_max": max(p["total_ms"] for p in per),
            "modes": r0["modes"],
        }
        if m in base:
            row["one_gpu_full_ms"] = base[m]
            row["scaling"] = base[m] / row["total_ms_max"]
            row["scaling_efficiency"] = row["scaling"] / world
        rows.append(row)
    envs = [pr["env"] for pr in per_rank]
    return {"world": world, "baseline_source": base_src, "rows": rows, "env_per_rank": envs}


def render_markdown(res: dict) -> str:
    from sglang_ddtree.bench._stamp import md_table, stamp_markdown

    w = res["world"]
    title = f"# TP-{w} MoE verify cost with all-reduce"
    if res["dry_run"]:
        title += " (CPU dry run: gloo, stand-in MoE)"
    if "model" in res:
        title += " -- MODEL (one-GPU shard measured, all-reduce modelled)"
    lines = [title, "", stamp_markdown(res["stamp"]), ""]
    if "model" in res:
        mdl = res["model"]
        lines += [
            f"Shard: {res['shard_source']}. All-reduce: **modelled**, not measured: t = {mdl['latency_us']} us + "
            f"2 (N-1)/N x bytes / {mdl['bus_gbs']} GB/s (NCCL ring busBW on 8x H100/H200 NVLink without NVLink "
            "SHARP, NVIDIA/nccl issues #1442 and #1455; alpha is an assumption). Measured on: "
            f"{stamp_markdown(res.get('measured_stamp') or {})}.",
            "",
        ]
    lines += [
        f"Per rank: routed-expert shard (FFN {res['ffn']}/{w}) then all-reduce of [M, {res['hidden']}]. Times are "
        f"the slowest rank's medians; baseline: {res['baseline_source']}.",
        "",
    ]
    rows = [
        [r["M"], r["moe_ms_max"], r["allreduce_ms_max"], r["total_ms_max"], r.get("one_gpu_full_ms", "-"),
         f"{r['scaling']:.2f}x" if "scaling" in r else "-", "/".join(r["modes"])]
        for r in res["rows"]
    ]  # fmt: skip
    lines.append(
        md_table(
            [
                "M",
                "MoE ms (max rank)",
                "all-reduce ms",
                "MoE + all-reduce ms",
                "1-GPU full ms",
                "scaling",
                "timing",
            ],
            rows,
        )
    )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path):
    from sglang_ddtree.bench._stamp import plot_lines

    ms = [r["M"] for r in res["rows"]]
    series = {
        "MoE shard (max rank)": (ms, [r["moe_ms_max"] for r in res["rows"]]),
        "all-reduce": (ms, [r["allreduce_ms_max"] for r in res["rows"]]),
        "MoE + all-reduce": (ms, [r["total_ms_max"] for r in res["rows"]]),
    }
    if all("one_gpu_full_ms" in r for r in res["rows"]):
        series["one GPU, full size"] = (ms, [r["one_gpu_full_ms"] for r in res["rows"]])
    return plot_lines(
        path, series, title=f"TP-{res['world']} MoE + all-reduce", xlabel="M", ylabel="ms", logy=True
    )


# =========================================================================== model (no GPUs)


def model_from_one_gpu(
    moe_json: str, world: int = 8, bus_gbs: float = 370.0, latency_us: float = 15.0, hidden: int = HIDDEN
) -> dict:
    """MODEL of the TP-N layer from one-GPU measurements: the measured 1/N shard (moe_verify's
    ``ffn{2048/N}`` rows, CUDA graphs) plus a modelled NCCL all-reduce of [M, hidden] bf16
    (``budget_model.allreduce_ms``: alpha + 2 (N - 1) / N * bytes / busBW), against the
    measured one-GPU full-size MoE.  Assumes every rank's shard costs the same (same routing)."""
    from sglang_ddtree.budget_model import allreduce_ms

    ref = json.loads(Path(moe_json).read_text())
    key = f"ffn{2048 // world}"
    if key not in ref["moe"]:
        raise SystemExit(f"{moe_json} has no {key} sweep (run moe_verify --ffn {2048 // world})")
    full = {r["M"]: r["core_combine_graph"] for r in ref["moe"]["ffn2048"]["rows"]}
    rows = []
    for r in ref["moe"][key]["rows"]:
        m = r["M"]
        ar = allreduce_ms(m * hidden * 2, n_gpus=world, bus_gbs=bus_gbs, latency_us=latency_us)
        row = {"M": m, "moe_ms_max": r["core_combine_graph"], "allreduce_ms_max": ar, "modes": ["model"] * 3}
        row["total_ms_max"] = row["moe_ms_max"] + ar
        if m in full:
            row["one_gpu_full_ms"] = full[m]
            row["scaling"] = full[m] / row["total_ms_max"]
            row["scaling_efficiency"] = row["scaling"] / world
        rows.append(row)
    return {
        "world": world,
        "model": {
            "bus_gbs": bus_gbs,
            "latency_us": latency_us,
            "formula": "alpha + 2 (N-1)/N * M*hidden*2 B / busBW",
        },
        "baseline_source": f"{moe_json} (ffn2048 core_combine_graph, measured)",
        "shard_source": f"{moe_json} ({key} core_combine_graph, measured on one GPU)",
        "measured_stamp": ref.get("stamp"),
        "rows": rows,
    }


# =========================================================================== main


def _spawn_entry(rank: int, world: int, args: argparse.Namespace, init: str, out_file: str) -> None:
    res = worker(rank, world, args, init)
    if res is not None:
        Path(out_file).write_text(json.dumps(res))


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_ddtree.bench import _stamp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="processes (default: all GPUs; 2 with --dry-run)")
    ap.add_argument("--ms", type=int, nargs="+", default=list(M_SWEEP))
    ap.add_argument("--ffn", type=int, default=2048, help="full expert FFN; each rank holds ffn / world")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bundle", default=None, help="folder from moe_verify --make-bundle")
    ap.add_argument("--baseline-json", default="bench_results/moe_verify.json")
    ap.add_argument("--no-measure-baseline", dest="measure_baseline", action="store_false")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU + gloo with a stand-in MoE (tests the orchestration)"
    )
    ap.add_argument(
        "--model", action="store_true", help="no GPUs: measured one-GPU shard + modelled all-reduce"
    )
    ap.add_argument("--bus-gbs", type=float, default=370.0, help="--model: NCCL all-reduce bus bandwidth")
    ap.add_argument(
        "--latency-us", type=float, default=15.0, help="--model: all-reduce small-message latency"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.dry_run and args.ms == list(M_SWEEP):
        args.ms = [1, 8, 64]

    if args.model:
        world = args.world or 8
        res = model_from_one_gpu(args.baseline_json, world, args.bus_gbs, args.latency_us, args.hidden)
        res.update(
            stamp=_stamp.stamp(),
            dry_run=False,
            ffn=args.ffn,
            hidden=args.hidden,
            ms=[r["M"] for r in res["rows"]],
        )
        name = args.name or f"moe_tp{world}_allreduce_model"
        out_dir = _stamp.results_dir(args.out)
        md = render_markdown(res)
        _stamp.write_outputs(out_dir, name, res, md)
        plot(res, out_dir / f"{name}.png")
        print(md)
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        raw = worker(int(os.environ["RANK"]), world, args, "env://")
        if raw is None:
            return 0
    else:
        world = args.world or (2 if args.dry_run else torch.cuda.device_count())
        if world < 1:
            raise SystemExit("no GPUs")
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "rank0.json")
            init = f"tcp://127.0.0.1:{_free_port()}"
            mp.spawn(_spawn_entry, args=(world, args, init, out_file), nprocs=world, join=True)
            raw = json.loads(Path(out_file).read_text())

    res = summarise(raw, world, args.baseline_json if not args.dry_run else None)
    res.update(stamp=_stamp.stamp(), dry_run=args.dry_run, ffn=args.ffn, hidden=args.hidden, ms=args.ms)
    name = args.name or (f"moe_tp{world}_allreduce" + ("_dryrun" if args.dry_run else ""))
    out_dir = _stamp.results_dir(args.out)
    paths = _stamp.write_outputs(out_dir, name, res, render_markdown(res))
    png = plot(res, out_dir / f"{name}.png")
    print(render_markdown(res))
    print("[tp] wrote", [str(p) for p in paths + ([png] if png else [])], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
