"""The tree-kernel benchmark's report: its targets, Markdown tables and plot, from the
results ``tree_kernels.run`` measures (kept apart so they can be read and tested on a CPU)."""

from __future__ import annotations

from pathlib import Path

from lab.bench import kernel_report

TARGETS = {
    "build_vs_python_bs64_b64": 500.0,
    "build_vs_cpp_bs64_b64": 20.0,
    "build_us_bs1_b32": 20.0,
    "accept_us_bs64": 5.0,
}


def _find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def evaluate_targets(results: dict) -> dict:
    """The issue's targets, measured at block 16 (depth 15), the drafters' block size."""
    out = {}
    blk = 16 if any(r["block"] == 16 for r in results["build"]) else results["build"][0]["block"]
    r = _find(results["build"], block=blk, budget=64, bs=64)
    if r:
        out["build_vs_python_bs64_b64"] = dict(value=r["speedup_vs_python"], target=">= 500x")
        out["build_vs_cpp_bs64_b64"] = dict(value=r["speedup_vs_cpp"], target=">= 20x")
        out["build_vs_python_bs64_b64"]["met"] = r["speedup_vs_python"] >= TARGETS["build_vs_python_bs64_b64"]
        out["build_vs_cpp_bs64_b64"]["met"] = r["speedup_vs_cpp"] >= TARGETS["build_vs_cpp_bs64_b64"]
        r1 = _find(results["build"], block=blk, budget=64, bs=1)
        if r1:
            out["build_flatness_bs64_over_bs1_b64"] = dict(
                value=r["gpu_us"] / r1["gpu_us"], target="~1 (flat)"
            )
    r = _find(results["build"], block=blk, budget=32, bs=1)
    if r:
        out["build_us_bs1_b32"] = dict(value=r["gpu_us"], target="<= 20 us", met=r["gpu_us"] <= 20.0)
        out["build_us_bs1_b32_single_graph"] = dict(value=r["gpu_single_graph_us"], target="<= 20 us")
    worst = max((a["gpu_us"] for a in results["accept"] if a["bs"] == 64 and a["block"] == blk), default=None)
    if worst is not None:
        out["accept_us_bs64"] = dict(
            value=worst, target="<= 5 us", met=worst <= 5.0, note="worst budget at bs=64"
        )
    return out


TITLE = "Tree build and accept: Python reference vs C++ vs CUDA kernels"
METHOD = (
    "vocab {vocab}; GPU: {graph_timing}; CPU paths: wall clock of the round trip (device->host copy, "
    "build, host->device copy), median. Every configuration was checked equal to the reference before "
    "timing. Times in microseconds."
)
TARGET_COLUMNS = (("name", "target"), ("value", "measured"), ("target", "goal"), ("status", "status"))
BUILD_COLUMNS = (
    ("budget", "budget"),
    ("bs", "bs"),
    ("python_us", "python"),
    ("cpp_us", "C++"),
    ("gpu_us", "GPU"),
    ("gpu_single_graph_us", "GPU (1/graph)"),
    ("speedup_vs_python", "x python"),
    ("speedup_vs_cpp", "x C++"),
)
ACCEPT_COLUMNS = (
    ("budget", "budget"),
    ("bs", "bs"),
    ("python_us", "python"),
    ("torch_us", "torch walk"),
    ("gpu_us", "GPU"),
    ("mean_accept_len", "mean accept len"),
)
TOPK_COLUMNS = (
    ("budget", "k"),
    ("bs", "bs"),
    ("gpu_us", "split kernel"),
    ("row_kernel_us", "row kernel"),
    ("torch_exact_us", "torch, exact ties"),
    ("torch_topk_inexact_us", "torch.topk, ties not pinned"),
)
POP_CYCLES_COLUMNS = (
    ("budget", "budget"),
    ("width", "width"),
    ("registers_kernel", "register heap"),
    ("registers_cycles_per_pop", "cycles/pop"),
    ("shared_kernel", "shared heap"),
    ("shared_cycles_per_pop", "cycles/pop"),
)
POP_CYCLES_NOTE = (
    "What bounds the build: each pop is a chain of dependent warp steps (lane max, warp "
    "max reduction, ballot, shuffles from the winner, the two new keys), so its time is "
    "the chain's latency, the same at any batch size."
)


def to_markdown(results: dict) -> str:
    lines = kernel_report.head(TITLE, METHOD, results)
    lines += kernel_report.targets_section("Targets (block 16, depth 15)", results["targets"], TARGET_COLUMNS)
    for block in sorted({r["block"] for r in results["build"]}):
        same_block = {"block": block}
        lines += kernel_report.section(
            f"Build, block {block} (depth {block - 1})", results["build"], BUILD_COLUMNS, where=same_block
        )
        lines += kernel_report.section(
            f"Accept, block {block}", results["accept"], ACCEPT_COLUMNS, where=same_block
        )
        lines += kernel_report.section(
            f"Top-k (bf16 logits, vocab {results['vocab']}), block {block}",
            results["topk"],
            TOPK_COLUMNS,
            where=same_block,
        )
    if results.get("pop_cycles"):
        lines += kernel_report.section(
            "Cycles per pop (one request, clock64 around the search)",
            results["pop_cycles"],
            POP_CYCLES_COLUMNS,
            intro=POP_CYCLES_NOTE,
        )
    if results.get("notes"):
        lines += ["## Notes", "", *results["notes"], ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    blk = max(r["block"] for r in results["build"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    ax = axes[0]
    for key, label in (
        ("python_us", "Python heapq (+copies)"),
        ("cpp_us", "C++ (+copies)"),
        ("gpu_us", "CUDA kernel"),
    ):
        rows = [r for r in results["build"] if r["block"] == blk and r["budget"] == 64]
        ax.plot([r["bs"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="us",
        title=f"tree build, budget 64, block {blk}",
    )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    ax = axes[1]
    for budget in sorted({r["budget"] for r in results["build"]}):
        rows = [r for r in results["build"] if r["block"] == blk and r["budget"] == budget]
        ax.plot([r["bs"] for r in rows], [r["gpu_us"] for r in rows], marker="o", label=f"budget {budget}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="us", title=f"CUDA tree build by budget, block {blk}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    ax = axes[2]
    rows = [r for r in results["accept"] if r["block"] == blk and r["budget"] == 64]
    for key, label in (
        ("python_us", "Python"),
        ("torch_us", "torch walk"),
        ("gpu_us", "CUDA"),
    ):
        ax.plot([r["bs"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="batch size", ylabel="us", title=f"accept walk, budget 64, block {blk}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    fig.suptitle(
        f"{results['stamp'].get('device')} - commit {str(results['stamp'].get('commit'))[:12]}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
