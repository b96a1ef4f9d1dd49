"""TP-N verify cost of the MoE layer with its all-reduce: one process per GPU, NCCL.

Each rank runs its tensor-parallel shard of SGLang's INT4 Marlin MoE (expert FFN 2048 / N,
same routing on every rank, as with a replicated router) and then all-reduces the
[M, 7168] bf16 output, for the same M sweep as ``moe_verify``.  Reported per M: the slowest
rank's MoE time, the all-reduce time, MoE + all-reduce back to back, and the effective
scaling against the one-GPU full-size MoE (from ``--baseline-json`` or measured on rank 0).

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): set here at import, before any
process is started, and again inside each worker.

    python -m lab.bench.moe_tp_allreduce --world 8 --bundle .carry/sgl
    torchrun --nproc-per-node 8 -m lab.bench.moe_tp_allreduce --bundle .carry/sgl
    python -m lab.bench.moe_tp_allreduce --dry-run --world 2   # CPU, gloo, stand-in MoE
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
from dataclasses import dataclass
from pathlib import Path

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lab.bench.moe_layer import M_SWEEP  # noqa: E402
from lab.bench.moe_tp_report import (  # noqa: E402
    HIDDEN,
    model_from_one_gpu,
    plot,
    render_markdown,
    summarise,
)


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
    from lab.bench._stamp import time_graph

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


@dataclass(frozen=True)
class RankBench:
    """What differs between the CPU dry run and the GPU run of one rank: its MoE shard, the
    routing, the timer, and (rank 0 only) a timer of the unsplit one-GPU layer."""

    moe_step: Callable  # (x, weights, ids) -> [M, hidden]
    route: Callable  # x -> (weights, ids), the same on every rank
    time: Callable  # (fn, collective) -> (ms, mode)
    time_full: Callable | None  # (x, weights, ids) -> ms of the full-size layer
    dtype: torch.dtype
    device: str


def _cpu_rank_bench(rank: int, args: argparse.Namespace, ffn: int) -> RankBench:
    torch.set_num_threads(1)  # the ranks share the host's cores
    moe = CpuStandInMoE(args.hidden, ffn, seed=rank)
    full = CpuStandInMoE(args.hidden, args.ffn, seed=99) if rank == 0 else None

    def time_full(x, w, ids):
        return _time_cpu(lambda: full(x), args.reps, aligned=False)

    return RankBench(
        moe_step=lambda x, w, ids: moe(x),
        route=lambda x: (None, None),
        time=lambda fn, collective: (_time_cpu(fn, args.reps), "cpu"),
        time_full=time_full if full is not None else None,
        dtype=torch.float32,
        device="cpu",
    )


def _gpu_rank_bench(rank: int, args: argparse.Namespace, ffn: int) -> RankBench:
    from lab.bench._stamp import time_graph
    from lab.bench.jit_bundle import load_sglang_kernels
    from lab.bench.moe_layer import MarlinMoE, MoEShape, route

    torch.cuda.set_device(rank % torch.cuda.device_count())
    sg = load_sglang_kernels(args.bundle)
    moe = MarlinMoE(sg, MoEShape(ffn=ffn, hidden=args.hidden), seed=1000 + rank, keep_reference=False)
    full = None
    if rank == 0 and args.measure_baseline:
        full = MarlinMoE(sg, MoEShape(ffn=args.ffn, hidden=args.hidden), seed=7, keep_reference=False)
    router_w = torch.randn(384, args.hidden, device="cuda", dtype=torch.bfloat16) * args.hidden**-0.5

    def time_full(x, w, ids):
        return time_graph(lambda: full(x, w, ids), reps=args.reps)["median_ms"]

    return RankBench(
        moe_step=lambda x, w, ids: moe(x, w, ids),
        route=lambda x: route(x, router_w, 8),
        time=lambda fn, collective: _time_cuda(fn, args.reps, collective),
        time_full=time_full if full is not None else None,
        dtype=torch.bfloat16,
        device="cuda",
    )


def _measure(bench: RankBench, m: int, hidden: int) -> tuple[dict, float | None]:
    """One M: the shard's MoE, the all-reduce of its output, and both back to back (the row);
    and the full-size layer's time where this rank measures it."""
    g = torch.Generator(device=bench.device).manual_seed(m)  # same tokens, same routing on every rank
    x = torch.randn(m, hidden, device=bench.device, dtype=bench.dtype, generator=g)
    w, ids = bench.route(x)
    buf = torch.randn(m, hidden, device=bench.device, dtype=bench.dtype, generator=g)

    def total():
        out = bench.moe_step(x, w, ids)
        dist.all_reduce(out)
        return out

    t_moe, mode = bench.time(lambda: bench.moe_step(x, w, ids), False)
    t_ar, mode_ar = bench.time(lambda: dist.all_reduce(buf), True)
    t_tot, mode_tot = bench.time(total, True)
    row = {
        "M": m,
        "moe_ms": t_moe,
        "allreduce_ms": t_ar,
        "total_ms": t_tot,
        "modes": [mode, mode_ar, mode_tot],
    }
    full_ms = bench.time_full(x, w, ids) if bench.time_full is not None else None
    return row, full_ms


def _run_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """Every M on this rank; rank 0 gathers all ranks' rows (and its baseline) and returns them."""
    env_seen = {k: os.environ.get(k) for k in MULTICAST_OFF}
    setup = _cpu_rank_bench if args.dry_run else _gpu_rank_bench
    bench = setup(rank, args, args.ffn // world)
    rows, baseline = [], {}
    for m in args.ms:
        row, full_ms = _measure(bench, m, args.hidden)
        if full_ms is not None:
            baseline[m] = full_ms
        rows.append(row)
        if rank == 0:
            print(
                f"[tp] M={m:5d} moe {row['moe_ms']:.3f} ms, all-reduce {row['allreduce_ms']:.3f} ms, "
                f"total {row['total_ms']:.3f} ms",
                flush=True,
            )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "rows": rows, "env": env_seen})
    if rank != 0:
        return None
    return {"per_rank": gathered, "baseline_ms": baseline}


# =========================================================================== main


def _spawn_entry(rank: int, world: int, args: argparse.Namespace, init: str, out_file: str) -> None:
    res = worker(rank, world, args, init)
    if res is not None:
        Path(out_file).write_text(json.dumps(res))


def main(argv: Sequence[str] | None = None) -> int:
    from lab.bench import _stamp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="processes (default: all GPUs; 2 with --dry-run)")
    ap.add_argument("--ms", type=int, nargs="+", default=list(M_SWEEP))
    ap.add_argument("--ffn", type=int, default=2048, help="full expert FFN; each rank holds ffn / world")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bundle", default=None, help="folder from moe_verify --make-bundle")
    ap.add_argument("--baseline-json", default="results/kimi-k2.6_h200_moe_verify.json")
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
