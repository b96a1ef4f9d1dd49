"""The report of ``pair_eval``: one row per arm (tokens per round, non-argmax share, target
forwards per token, greedy identity to the plain server), its Markdown table, the machine it
ran on and the plot."""

from __future__ import annotations

import platform
from pathlib import Path

from lab.bench._stamp import md_table, stamp


def machine_stamp() -> dict:
    info = stamp()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    import os

    info.update(cpu=cpu, cpu_count=os.cpu_count(), platform=platform.platform())
    for package in ("sglang", "transformers"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - a missing version is reported as None
            info[package] = None
    return info


def summarize(results: list[dict], offline: dict[str, float]) -> list[dict]:
    plain = next(r for r in results if r["arm"] == "plain")["phases"]["greedy"]["outputs"]
    rows = []
    for r in results:
        g = r["phases"]["greedy"]
        s = r["phases"].get("sample", {})
        rows.append(
            {
                "arm": r["arm"],
                "budget": r["budget"],
                "max_topk": r["max_topk"],
                "greedy_tokens_per_round": g["tokens_per_round"],
                "greedy_offline_prediction": offline.get(r["arm"]),
                "greedy_non_argmax_share": g.get("non_argmax_share"),
                "greedy_target_forwards_per_token": g["target_forwards_per_token"],
                "greedy_identical_to_plain": g["outputs"] == plain,
                "sample_tokens_per_round": s.get("tokens_per_round"),
                "sample_non_argmax_share": s.get("non_argmax_share"),
                "sample_target_forwards_per_token": s.get("target_forwards_per_token"),
                "greedy_seconds": g["seconds"],
                "sglang_avg_spec_accept_length": g.get("sglang_avg_spec_accept_length"),
            }
        )
    return rows


def markdown(data: dict) -> str:
    rows = data["rows"]
    chain = next(r for r in rows if r["arm"] == "chain")

    def rel(value, base):
        return "-" if value is None or not base else f"{value / base:.2f}x"

    def num(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    table = md_table(
        [
            "arm",
            "budget",
            "T=0 tokens/round",
            "vs chain",
            "offline prediction",
            "T=0 non-argmax share",
            "T=0 target fwd/token",
            "T=0 identical to plain",
            "T=1 tokens/round",
            "vs chain",
            "T=1 non-argmax share",
        ],
        [
            [
                r["arm"],
                "-"
                if r["budget"] is None
                else (f"{r['budget']} (top-1)" if r["max_topk"] == 1 else r["budget"]),
                num(r["greedy_tokens_per_round"]),
                rel(r["greedy_tokens_per_round"], chain["greedy_tokens_per_round"]) if r["budget"] else "-",
                num(r["greedy_offline_prediction"]),
                num(r["greedy_non_argmax_share"], "{:.1%}"),
                num(r["greedy_target_forwards_per_token"], "{:.3f}"),
                "yes" if r["greedy_identical_to_plain"] else "**NO**",
                num(r["sample_tokens_per_round"]),
                rel(r["sample_tokens_per_round"], chain["sample_tokens_per_round"]) if r["budget"] else "-",
                num(r["sample_non_argmax_share"], "{:.1%}"),
            ]
            for r in rows
        ],
    )
    st = data["stamp"]
    cfg = data["config"]
    return "\n".join(
        [
            f"# DDTree vs the DFlash chain on the trained pair `{data['pair']}`",
            "",
            f"{cfg['prompts']} held-out prompts, {cfg['max_new_tokens']} new tokens each, one request at a time; "
            f"drafter block {cfg['block']}; real SGLang servers on the CPU (float32, overlap off). "
            "tokens/round = accepted drafts + the bonus token (the accept length); non-argmax share = accepted "
            "tokens that a chain of the drafter's top-1 picks would not have proposed; target fwd/token = "
            "(decode rounds + prefills) / output tokens. T=1: acceptance only (outputs are samples).",
            "",
            table,
            "",
            f"machine: `{st.get('cpu')}` x{st.get('cpu_count')} | sglang `{st.get('sglang')}` | torch `{st.get('torch')}` "
            f"| commit `{st.get('commit')}` | date `{st.get('date_utc')}`",
        ]
    )


def plot(path: Path, data: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = data["rows"]
    chain = next(r for r in rows if r["arm"] == "chain")
    trees = [r for r in rows if r["arm"].startswith("tree")]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key, label, color in (("greedy", "T=0", "C0"), ("sample", "T=1", "C1")):
        if chain[f"{key}_tokens_per_round"] is None:
            continue  # a greedy-only run (--no-sampling) has no T=1 line to draw
        xs = [r["budget"] for r in trees]
        ax.plot(
            xs,
            [r[f"{key}_tokens_per_round"] for r in trees],
            marker="o",
            color=color,
            label=f"DDTree {label}",
        )
        ax.axhline(chain[f"{key}_tokens_per_round"], ls="--", color=color, lw=1, label=f"chain {label}")
    offline = [r["greedy_offline_prediction"] for r in trees]
    if all(v is not None for v in offline):
        ax.plot(
            [r["budget"] for r in trees],
            offline,
            ls=":",
            marker="x",
            color="C0",
            label="DDTree T=0 offline replay",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (nodes per round)")
    ax.set_ylabel("tokens per round (accept length)")
    ax.set_title(
        f"DDTree vs chain, trained pair {data['pair']} (block {data['config']['block']})", fontsize=10
    )
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
