"""An A/B report written out: markdown, a PNG plot, the console summary; and
``python -m sglang_ddtree.ab.render REPORT.json`` to write a report's markdown and PNG again."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = {
    "arm": "the server configuration (flags in the Arms section)",
    "concurrency": "bench_serving --max-concurrency: requests in flight at once",
    "prompts": "requests per run (bench_serving --num-prompts), each generating the fixed output length",
    "output tok/s": "generated tokens per second over the run, all requests together "
    "(bench_serving output_throughput); the median over repeats",
    "min-max": "lowest and highest output tok/s over the repeats",
    "vs baseline": "output tok/s divided by the baseline arm's at the same concurrency (>1: faster)",
    "TPOT ms": "median time per output token after the first, per request (bench_serving median_tpot_ms)",
    "TTFT ms": "median time to first token (bench_serving median_ttft_ms); includes queueing",
    "accept length": "tokens committed per verify round (accepted drafts + the bonus token), from the "
    "server's /server_info over the measured run only (its statistics are reset after warm-up); "
    "- for the plain arm",
}


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(report: dict) -> str:
    sections = (_md_alerts, _md_results, _md_winners, _md_greedy, _md_parity, _md_arms, _md_provenance)
    lines = [f"# A/B: {', '.join(report['settings']['arms'])} ({report['date']})", ""]
    for section in sections:
        lines += section(report)
    return "\n".join(lines) + "\n"


def _hardware(stamp: dict) -> str:
    if stamp.get("gpus"):
        return ", ".join(stamp["gpus"])
    return f"{stamp.get('cpu_model')} ({stamp.get('cpu_count')} cores, CPU)"


def _md_alerts(report: dict) -> list[str]:
    """Failures first, in bold, so that no one reads the numbers of a broken run as good ones."""
    lines = []
    if report["status"] != "ok":
        lines += [f"**{report['status'].upper()}**", "", "```", (report["error"] or "").rstrip(), "```", ""]
    if not report["greedy_check"]["ok"]:
        lines += [f"**{report['greedy_check']['message']}**", ""]
    if not report["parity"]["ok"]:
        lines += [f"**{report['parity']['message']}**", ""]
    if report["servers_left_running"]:
        lines += [f"**servers left running: {', '.join(report['servers_left_running'])}**", ""]
    lines += [f"Warning: {w}" for w in report["warnings"]] + ([""] if report["warnings"] else [])
    return lines


def _md_results(report: dict) -> list[str]:
    s = report["settings"]
    base = s["baseline"]
    lines = [
        f"Target `{s['model']}`, drafter `{s['drafter'] or '-'}` on {_hardware(report['stamp'])}. "
        f"Dataset `{s['dataset']}`"
        + (f" (input {s['input_len']} tokens)" if s.get("input_len") else "")
        + f", output {s['output_len']} tokens per request, seed {s['seed']}, {s['repeats']} repeat(s); "
        f"baseline `{base}`.",
        "",
        "## Results",
        "",
        f"| arm | concurrency | prompts | output tok/s | min-max | vs {base} | TPOT ms | TTFT ms | accept length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _rows_in_order(report):
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['num_prompts']} | {_fmt(r['output_tok_s'])} | "
            f"{_fmt(r['output_tok_s_min'])}-{_fmt(r['output_tok_s_max'])} | "
            f"{_fmt(r['vs_baseline'], 2) + 'x' if r['vs_baseline'] is not None else '-'} | "
            f"{_fmt(r['median_tpot_ms'])} | {_fmt(r['median_ttft_ms'])} | {_fmt(r['accept_length'], 2)} |"
        )
    return lines


def _rows_in_order(report: dict) -> list[dict]:
    """Summary rows by concurrency, then in the order the arms ran."""
    arms = report["settings"]["arms"]
    return sorted(report["summary"], key=lambda r: (r["concurrency"], arms.index(r["arm"])))


def _winner_line(w: dict) -> str:
    margin = f"{w['margin']:.2f}x" if w["margin"] else "-"
    return (
        f"concurrency {w['concurrency']}: {w['winner']} wins, {margin} over {w['runner_up']} ({w['verdict']})"
    )


def _md_winners(report: dict) -> list[str]:
    lines = ["", "## Who wins", ""]
    for w in report["winners"]:
        margin = f"{w['margin']:.2f}x" if w["margin"] else "-"
        lines.append(
            f"- concurrency {w['concurrency']}: **{w['winner']}**, {margin} over {w['runner_up']} ({w['verdict']})"
        )
    if not report["winners"]:
        lines.append("- no concurrency level has two arms measured")
    return lines


def _md_greedy(report: dict) -> list[str]:
    gc = report["greedy_check"]
    lines = ["", "## Greedy check", "", gc["message"] + ".", ""]
    for m in gc["mismatches"]:
        lines.append(
            f"- `{m['arm']}` prompt {m['prompt_index']} ({m['prompt'][:40]!r}): first different token {m['first_diff_token']}, "
            f"{gc['reference']} {m['reference_ids']} vs {m['arm_ids']}"
        )
    return lines


def _md_parity(report: dict) -> list[str]:
    par = report["parity"]
    lines = ["## Parity (read back from each server's /server_info)", "", par["message"] + ".", ""]
    if par["arms_read"]:
        lines += [
            "| setting | " + " | ".join(par["arms_read"]) + " |",
            "|---" * (1 + len(par["arms_read"])) + "|",
        ]
        for key, values in par["settings"].items():
            lines.append(f"| `{key}` | " + " | ".join(_fmt(values.get(a)) for a in par["arms_read"]) + " |")
        lines.append("")
    if par["other_differences"]:
        lines.append("Other settings that differ (speculative ones are expected to):")
        lines.append("")
        for d in par["other_differences"]:
            vals = ", ".join(f"{a}={v!r}" for a, v in d["values"].items())
            lines.append(f"- `{d['key']}`: {vals}{' (expected)' if d['expected'] else ''}")
        lines.append("")
    return lines


def _md_arms(report: dict) -> list[str]:
    lines = ["## Arms", ""]
    for a in report["arms"]:
        env = " ".join(f"{k}={v}" for k, v in a["env"].items())
        start = f", started in {a['start_seconds']} s" if a["start_seconds"] is not None else ""
        lines += [
            f"- **{a['name']}**: {a['description']}{start}",
            "",
            "  ```",
            f"  {env + ' ' if env else ''}{a['launch_command']}",
            "  ```",
        ]
    s = report["settings"]
    if "tiny-models" in str(s["model"]):
        lines += [
            "",
            "Note: the tiny models have random weights. Their drafter is almost never right (accept length "
            "about 1), so speculation can only cost time here: this run checks the tool end to end, not "
            "DDTree's speed.",
        ]
    return lines


def _md_provenance(report: dict) -> list[str]:
    s, st = report["settings"], report["stamp"]
    lines = [
        "",
        "## Provenance",
        "",
        f"- command: `{' '.join(report['command'])}`",
        f"- hardware: {_hardware(st)}" + (f"; CPU {st.get('cpu_model')}" if st.get("gpus") else ""),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in st["versions"].items()),
        f"- commit `{st.get('commit')}`, date {st.get('date_utc')}, host `{st.get('host')}`",
        f"- load: `{s['bench_module']}` (SGLang's bench_serving), cache flushed after each run's warm-up",
        "",
        "## Columns",
        "",
    ]
    return lines + [f"- **{k}**: {v}." for k, v in COLUMNS.items()]


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, s = report["summary"], report["settings"]
    if not rows:
        return None
    base = s["baseline"]
    concs = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    ax2 = ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(s["arms"]):
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["concurrency"])
        if not mine:
            continue
        xs = [r["concurrency"] for r in mine]
        color = colors[i % len(colors)]
        ax.plot(xs, [r["output_tok_s"] for r in mine], marker="o", color=color, label=f"{arm} tok/s")
        if any(r["repeats"] > 1 for r in mine):
            ax.vlines(
                xs, [r["output_tok_s_min"] for r in mine], [r["output_tok_s_max"] for r in mine], color=color
            )
        if arm != base and any(r["vs_baseline"] for r in mine):
            pts = [(r["concurrency"], r["vs_baseline"]) for r in mine if r["vs_baseline"]]
            ax2.plot(*zip(*pts), ls="--", marker="x", color=color, label=f"{arm} / {base}")
    ax2.axhline(1.0, color="gray", lw=0.6, ls=":")
    if len(concs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs)
    ax.set_xticklabels([str(c) for c in concs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tok/s (median)")
    ax2.set_ylabel(f"ratio vs {base} (dashed)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    title = f"A/B {s.get('label') or Path(str(s['model'])).name}: throughput vs concurrency"
    if report["status"] != "ok":
        title += f" [{report['status'].upper()}]"
    ax.set_title(title, fontsize=10)
    ax.grid(True, lw=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(report: dict, out_dir: Path, stem: str, plot_png: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    if plot_png:
        png = plot(report, out_dir / f"{stem}.png")
        if png is not None:
            paths["png"] = png
    report["files"] = {k: str(v) for k, v in paths.items()}
    paths["md"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report, indent=1, default=str) + "\n")
    return list(paths.values())


def rerender(json_path: Path, plot_png: bool = True) -> list[Path]:
    """Write the markdown (and PNG) of a JSON report again, next to it."""
    report = json.loads(Path(json_path).read_text())
    report["settings"].setdefault("label", Path(json_path).stem.removeprefix("ab_").rsplit("_", 1)[0])
    stem = Path(json_path).with_suffix("")
    paths = [stem.with_suffix(".md")]
    paths[0].write_text(markdown(report))
    if plot_png and plot(report, stem.with_suffix(".png")) is not None:
        paths.append(stem.with_suffix(".png"))
    return paths


def console_summary(report: dict) -> str:
    base = report["settings"]["baseline"]
    out = [
        "",
        f"{'arm':<14}{'conc':>5}{'tok/s':>10}{'vs ' + base:>12}{'TPOT ms':>9}{'TTFT ms':>9}{'accept':>8}",
    ]
    for r in _rows_in_order(report):
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] is not None else "-"
        out.append(
            f"{r['arm']:<14}{r['concurrency']:>5}{r['output_tok_s']:>10.1f}{ratio:>12}"
            f"{_fmt(r['median_tpot_ms']):>9}{_fmt(r['median_ttft_ms']):>9}{_fmt(r['accept_length'], 2):>8}"
        )
    out += [_winner_line(w) for w in report["winners"]]
    out.append(f"greedy check: {report['greedy_check']['message']}")
    out.append(f"parity: {report['parity']['message']}")
    out += [f"warning: {w}" for w in report["warnings"]]
    if report["servers_left_running"]:
        out.append(f"SERVERS LEFT RUNNING: {', '.join(report['servers_left_running'])}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write an A/B report's markdown and PNG again from its JSON."
    )
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    for path in args.json:
        for written in rerender(path, plot_png=not args.no_plot):
            print(f"wrote {written}")


if __name__ == "__main__":
    main()
