"""Shared helpers for the GPU benchmarks: provenance stamp, ceilings, timing, output.

``stamp()`` says where a number was measured (device, driver, torch/CUDA/Triton versions,
git commit, date); ``host_stamp()`` adds the CPU, every GPU and the serving stack's versions
(the A/B tool's reports).  ``copy_bandwidth_gbs()`` and ``matmul_tflops()`` measure the two
ceilings every result is compared against, in the same run.  ``time_eager`` and
``time_graph`` are the two timing modes used throughout: eager (CUDA events around one
call, host launch gaps included) and CUDA-graph replay (what a served model sees).
``write_outputs`` writes ``<name>.json`` + ``<name>.md`` (+ ``<name>.png``).

Nothing here imports SGLang; CUDA is only touched when a function is called.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sglang_ddtree.ab import stamp as _provenance

# Provenance lives with the A/B tool (the package); the lab's benchmarks stamp the same way.
REPO_ROOT = _provenance.REPO_ROOT
git_commit, stamp, host_stamp, host_load = (
    _provenance.git_commit,
    _provenance.stamp,
    _provenance.host_stamp,
    _provenance.host_load,
)


# --------------------------------------------------------------------------- ceilings


def copy_bandwidth_gbs(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = nbytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")  # never time on zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    if not torch.equal(dst, src):
        raise RuntimeError("copy bandwidth check: destination differs from source")
    t = statistics.median(times)
    del src, dst
    return 2 * n * 2 / t / 1e9


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """bf16 matrix-product rate (TFLOP/s) on random data, n x n x n."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


# --------------------------------------------------------------------------- timing


def time_eager(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> dict:
    """Median of ``reps`` CUDA-event timings of one call each (ms), host launch gaps included.

    The stream is synchronised before each call, so what a served model without CUDA graphs
    would pay per call (Python + launch latency between kernels) is part of the number.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return _summary(times)


def time_graph(fn: Callable[[], object], reps: int = 30, warmup: int = 3, calls_per_graph: int = 1) -> dict:
    """Capture ``calls_per_graph`` calls of ``fn`` in one CUDA graph; median replay time per call (ms)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / calls_per_graph)
    out = _summary(times)
    del graph
    return out


def _summary(times_ms: Sequence[float]) -> dict:
    ts = sorted(times_ms)
    return {
        "median_ms": statistics.median(ts),
        "min_ms": ts[0],
        "p90_ms": ts[min(len(ts) - 1, int(0.9 * len(ts)))],
        "reps": len(ts),
    }


# --------------------------------------------------------------------------- output


def results_dir(path: str | os.PathLike | None = None) -> Path:
    out = Path(path) if path else REPO_ROOT / "results"
    out.mkdir(parents=True, exist_ok=True)
    return out


def device_slug(stamp: dict) -> str:
    """``NVIDIA H200`` -> ``h200``: the device part of a results file name."""
    import re

    name = str(stamp.get("device") or "cpu").lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def write_outputs(out_dir: Path, name: str, data: dict, markdown: str) -> list[Path]:
    """Write ``name.json`` and ``name.md``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pj, pm = out_dir / f"{name}.json", out_dir / f"{name}.md"
    pj.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    pm.write_text(markdown.rstrip() + "\n")
    return [pj, pm]


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON (also used to checkpoint a sweep while it runs)."""
    Path(path).write_text(json.dumps(data, indent=1, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def stamp_markdown(st: dict) -> str:
    keys = ["device", "driver", "torch", "cuda_runtime", "triton", "commit", "date_utc"]
    return " | ".join(f"{k}: `{st.get(k)}`" for k in keys)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if v == 0 or abs(v) >= 100:
                return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}"
            if abs(v) >= 1:
                return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plot_lines(
    path: Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
    logy: bool = False,
    hlines: dict[str, float] | None = None,
) -> Path | None:
    """One PNG with a line per series; returns None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", ms=3, label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, ls="--", lw=0.8, color="gray")
        ax.text(ax.get_xlim()[0], y, " " + label, va="bottom", fontsize=7, color="gray")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", lw=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
