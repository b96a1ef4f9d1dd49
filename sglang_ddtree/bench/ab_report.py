"""Report of an A/B run (``sglang_ddtree.bench.ab``): summary, winners, greedy check, parity,
provenance; written as JSON, markdown and a PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import subprocess
from pathlib import Path

from .ab_arms import PARITY_FLAGS, PARITY_KEYS, SPEC_KEYS, Arm

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


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- analysis


def summarise(arms: list[Arm], baseline: str) -> list[dict]:
    rows = []
    for arm in arms:
        for conc in sorted({r["concurrency_requested"] for r in arm.runs}):
            runs = [r for r in arm.runs if r["concurrency_requested"] == conc]
            tok = [r["output_throughput"] for r in runs]
            rows.append(
                {
                    "arm": arm.name,
                    "kind": arm.kind,
                    "concurrency": conc,
                    "num_prompts": runs[0]["num_prompts"],
                    "repeats": len(runs),
                    "output_tok_s": _median(tok),
                    "output_tok_s_min": min(tok),
                    "output_tok_s_max": max(tok),
                    "median_tpot_ms": _median(r["median_tpot_ms"] for r in runs),
                    "median_ttft_ms": _median(r["median_ttft_ms"] for r in runs),
                    "p99_ttft_ms": _median(r["p99_ttft_ms"] for r in runs),
                    "median_itl_ms": _median(r["median_itl_ms"] for r in runs),
                    "accept_length": _median(r["accept_length"] for r in runs),
                    "completed": sum(r["completed"] or 0 for r in runs),
                }
            )
    base = {r["concurrency"]: r["output_tok_s"] for r in rows if r["arm"] == baseline}
    for row in rows:
        ref = base.get(row["concurrency"])
        row["vs_baseline"] = row["output_tok_s"] / ref if ref else None
    return rows


def winners(rows: list[dict]) -> list[dict]:
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        group = sorted((r for r in rows if r["concurrency"] == conc), key=lambda r: -r["output_tok_s"])
        if len(group) < 2:
            continue
        best, second = group[0], group[1]
        if best["repeats"] < 2 or second["repeats"] < 2:
            verdict = "single run each: repeat (--repeats) to see the spread"
            clear = None
        elif best["output_tok_s_min"] > second["output_tok_s_max"]:
            verdict, clear = "clear: its slowest run beats the runner-up's fastest", True
        else:
            verdict, clear = "within the run-to-run spread", False
        out.append(
            {
                "concurrency": conc,
                "winner": best["arm"],
                "runner_up": second["arm"],
                "margin": best["output_tok_s"] / second["output_tok_s"] if second["output_tok_s"] else None,
                "clear": clear,
                "verdict": verdict,
            }
        )
    return out


def greedy_check(arms: list[Arm], baseline: str, prompts: list[str], tokens: int, allowed: bool) -> dict:
    checked = [a for a in arms if a.greedy is not None]
    result = {
        "prompts": prompts,
        "max_new_tokens": tokens,
        "arms_checked": [a.name for a in checked],
        "reference": None,
        "mismatches": [],
        "ok": True,
        "message": "",
    }
    if not prompts:
        result["message"] = "greedy check off (--check-prompts 0)"
        return result
    if len(checked) < 2:
        result["message"] = "fewer than two arms answered the greedy prompts: nothing to compare"
        return result
    ref = next((a for a in checked if a.name == baseline), checked[0])
    result["reference"] = ref.name
    for arm in checked:
        if arm is ref:
            continue
        for i, (want, got) in enumerate(zip(ref.greedy, arm.greedy)):
            if want == got:
                continue
            first = next((k for k, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
            result["mismatches"].append(
                {
                    "arm": arm.name,
                    "prompt_index": i,
                    "prompt": prompts[i],
                    "first_diff_token": first,
                    "reference_ids": want[first : first + 8],
                    "arm_ids": got[first : first + 8],
                }
            )
    n = len(prompts)
    if result["mismatches"]:
        result["ok"] = False
        parts = [
            f"{m['arm']} prompt {m['prompt_index']} diverges from {ref.name} at token {m['first_diff_token']}"
            for m in result["mismatches"]
        ]
        result["message"] = (
            f"GREEDY CHECK FAILED{' (allowed by --allow-greedy-mismatch)' if allowed else ''}: "
            + "; ".join(parts)
        )
    else:
        result["message"] = (
            f"identical token ids in {', '.join(a.name for a in checked)} "
            f"({n} prompts x {tokens} tokens, temperature 0)"
        )
    return result


def capacity_warnings(arms: list[Arm], concurrency: list[int]) -> list[str]:
    """Arms that cannot hold every request of a concurrency level at once (they queue the rest)."""
    out = []
    for arm in arms:
        rb = arm.readback
        cap = rb.get("effective_max_running_requests_per_dp")
        cap = cap * (rb.get("dp_size") or 1) if cap else rb.get("max_running_requests")
        above = [c for c in concurrency if cap and c > cap]
        if above:
            out.append(
                f"{arm.name} runs at most {cap} requests at once (max_running_requests as SGLang resolved it), "
                f"fewer than concurrency {', '.join(map(str, above))}: the rest queue. Pass "
                f"--server-args '--max-running-requests {max(above)}' to give every arm the same room."
            )
    return out


def _flags_given(arm: Arm, key: str) -> list[str]:
    return [
        f for f in PARITY_FLAGS.get(key, ()) if any(a == f or a.startswith(f + "=") for a in arm.server_args)
    ]


def parity(arms: list[Arm], context_keys) -> dict:
    read = [a for a in arms if a.readback]
    diffs, context = [], []
    for key in PARITY_KEYS:
        values = {a.name: a.readback.get(key) for a in read}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            reasons = {}
            for a in read:
                flags = _flags_given(a, key)
                reasons[a.name] = (
                    f"set by {', '.join(flags)}"
                    if flags
                    else "resolved by SGLang itself (no flag given here)"
                )
            diffs.append({"key": key, "values": values, "why": reasons})
    for key in context_keys:
        if key in PARITY_KEYS:
            continue
        values = {a.name: a.readback.get(key) for a in read}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            context.append({"key": key, "values": values, "expected": key in SPEC_KEYS})
    if len(read) < 2:
        message = "fewer than two arms started: nothing to compare"
    elif not diffs:
        message = "overlap scheduler, CUDA-graph and attention-backend settings are the same in every arm"
    else:
        message = "NOT AT PARITY: " + "; ".join(
            f"{d['key']}: " + ", ".join(f"{arm}={v!r} ({d['why'][arm]})" for arm, v in d["values"].items())
            for d in diffs
        )
    return {
        "ok": not diffs,
        "arms_read": [a.name for a in read],
        "settings": {key: {a.name: a.readback.get(key) for a in read} for key in PARITY_KEYS},
        "differences": diffs,
        "other_differences": context,
        "message": message,
    }


# --------------------------------------------------------------------------- provenance


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def hardware_stamp() -> dict:
    """Where and with what the numbers were measured. Called after every server has stopped."""
    from . import _stamp

    info = _stamp.stamp()
    cpu_model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    info["cpu_model"] = cpu_model
    info["cpu_count"] = os.cpu_count()
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    info["gpus"] = [line.strip() for line in smi.splitlines()] if smi else []
    from .. import __version__

    info["versions"] = {
        "sglang": _version("sglang"),
        "torch": _version("torch"),
        "sglang_ddtree": _version("sglang-ddtree") or __version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
    }
    return info


# --------------------------------------------------------------------------- report


def build_report(
    *,
    arms: list[Arm],
    settings: dict,
    status: str,
    error: str | None,
    command: list[str],
    date: _dt.datetime,
    allow_greedy_mismatch: bool,
    strict_parity: bool,
) -> dict:
    from .ab_arms import CONTEXT_KEYS

    baseline = settings["baseline"]
    rows = summarise(arms, baseline)
    report = {
        "tool": "sglang_ddtree.bench.ab",
        "status": status,
        "error": error,
        "date": date.astimezone().isoformat(timespec="seconds"),
        "command": command,
        "stamp": {**hardware_stamp(), "commit": settings.get("commit_at_start") or "unknown"},
        "settings": settings,
        "summary": rows,
        "winners": winners(rows),
        "greedy_check": greedy_check(
            arms, baseline, settings["check_prompts"], settings["check_tokens"], allow_greedy_mismatch
        ),
        "parity": parity(arms, CONTEXT_KEYS),
        "arms": [a.to_json() for a in arms],
        "servers_left_running": [a.name for a in arms if a.stopped is False],
        "warnings": capacity_warnings(arms, settings["concurrency"]),
    }
    report["parity"]["strict"] = strict_parity
    return report


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(report: dict) -> str:
    s, st = report["settings"], report["stamp"]
    base = s["baseline"]
    lines = [f"# A/B: {', '.join(s['arms'])} ({report['date']})", ""]
    if report["status"] != "ok":
        lines += [f"**{report['status'].upper()}**", "", "```", (report["error"] or "").rstrip(), "```", ""]
    gc = report["greedy_check"]
    if not gc["ok"]:
        lines += [f"**{gc['message']}**", ""]
    if not report["parity"]["ok"]:
        lines += [f"**{report['parity']['message']}**", ""]
    if report["servers_left_running"]:
        lines += [f"**servers left running: {', '.join(report['servers_left_running'])}**", ""]
    lines += [f"Warning: {w}" for w in report["warnings"]] + ([""] if report["warnings"] else [])
    target, drafter = s["model"], s["drafter"] or "-"
    hw = (
        ", ".join(st["gpus"])
        if st.get("gpus")
        else f"{st.get('cpu_model')} ({st.get('cpu_count')} cores, CPU)"
    )
    lines += [
        f"Target `{target}`, drafter `{drafter}` on {hw}. Dataset `{s['dataset']}`"
        + (f" (input {s['input_len']} tokens)" if s.get("input_len") else "")
        + f", output {s['output_len']} tokens per request, seed {s['seed']}, {s['repeats']} repeat(s); "
        f"baseline `{base}`.",
        "",
        "## Results",
        "",
        f"| arm | concurrency | prompts | output tok/s | min-max | vs {base} | TPOT ms | TTFT ms | accept length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(report["summary"], key=lambda r: (r["concurrency"], s["arms"].index(r["arm"]))):
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['num_prompts']} | {_fmt(r['output_tok_s'])} | "
            f"{_fmt(r['output_tok_s_min'])}-{_fmt(r['output_tok_s_max'])} | "
            f"{_fmt(r['vs_baseline'], 2) + 'x' if r['vs_baseline'] is not None else '-'} | "
            f"{_fmt(r['median_tpot_ms'])} | {_fmt(r['median_ttft_ms'])} | {_fmt(r['accept_length'], 2)} |"
        )
    lines += ["", "## Who wins", ""]
    if report["winners"]:
        for w in report["winners"]:
            margin = f"{w['margin']:.2f}x" if w["margin"] else "-"
            lines.append(
                f"- concurrency {w['concurrency']}: **{w['winner']}**, {margin} over {w['runner_up']} ({w['verdict']})"
            )
    else:
        lines.append("- no concurrency level has two arms measured")
    lines += ["", "## Greedy check", "", gc["message"] + ".", ""]
    for m in gc["mismatches"]:
        lines.append(
            f"- `{m['arm']}` prompt {m['prompt_index']} ({m['prompt'][:40]!r}): first different token {m['first_diff_token']}, "
            f"{gc['reference']} {m['reference_ids']} vs {m['arm_ids']}"
        )
    par = report["parity"]
    lines += ["## Parity (read back from each server's /server_info)", "", par["message"] + ".", ""]
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
    lines += ["## Arms", ""]
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
    if s.get("tiny") or "tiny-models" in str(s["model"]):
        lines += [
            "",
            "Note: the tiny models have random weights. Their drafter is almost never right (accept length "
            "about 1), so speculation can only cost time here: this run checks the tool end to end, not "
            "DDTree's speed.",
        ]
    lines += [
        "",
        "## Provenance",
        "",
        f"- command: `{' '.join(report['command'])}`",
        f"- hardware: {hw}" + (f"; CPU {st.get('cpu_model')}" if st.get("gpus") else ""),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in st["versions"].items()),
        f"- commit `{st.get('commit')}`, date {st.get('date_utc')}, host `{st.get('host')}`",
        f"- load: `{s['bench_module']}` (SGLang's bench_serving), cache flushed after each run's warm-up",
        "",
        "## Columns",
        "",
    ]
    lines += [f"- **{k}**: {v}." for k, v in COLUMNS.items()]
    return "\n".join(lines) + "\n"


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
    for r in sorted(
        report["summary"], key=lambda r: (r["concurrency"], report["settings"]["arms"].index(r["arm"]))
    ):
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] is not None else "-"
        out.append(
            f"{r['arm']:<14}{r['concurrency']:>5}{r['output_tok_s']:>10.1f}{ratio:>12}"
            f"{_fmt(r['median_tpot_ms']):>9}{_fmt(r['median_ttft_ms']):>9}{_fmt(r['accept_length'], 2):>8}"
        )
    for w in report["winners"]:
        margin = f"{w['margin']:.2f}x" if w["margin"] else "-"
        out.append(
            f"concurrency {w['concurrency']}: {w['winner']} wins, {margin} over {w['runner_up']} ({w['verdict']})"
        )
    out.append(f"greedy check: {report['greedy_check']['message']}")
    out.append(f"parity: {report['parity']['message']}")
    out += [f"warning: {w}" for w in report["warnings"]]
    if report["servers_left_running"]:
        out.append(f"SERVERS LEFT RUNNING: {', '.join(report['servers_left_running'])}")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Write an A/B report's markdown and PNG again from its JSON."
    )
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--no-plot", action="store_true")
    for path in parser.parse_args().json:
        for written in rerender(path, plot_png=not parser.parse_args().no_plot):
            print(f"wrote {written}")
