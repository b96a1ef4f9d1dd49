"""The TP-N MoE + all-reduce benchmark's results (``moe_tp_allreduce``): the slowest-rank
summary, its Markdown and plot, and the model of the TP-N layer from one-GPU measurements."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HIDDEN = 7168


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
    from lab.bench._stamp import md_table, stamp_markdown

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
    from lab.bench._stamp import plot_lines

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
    from lab.budget_model import allreduce_ms

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
