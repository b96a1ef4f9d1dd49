"""An A/B report written out: one file set per series (``<series>.json``, ``.md``, ``.png``), the
console summary; and ``python -m sglang_ddtree.ab.render REPORT.json`` to write a report's
markdown and PNG again."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .plot import plot
from .render_diagnostics import fmt as _fmt
from .render_diagnostics import md_phases, md_profiles
from .render_diagnostics import rows_in_order as _rows_in_order

COLUMNS = {
    "arm": "the server configuration (flags and environment in the Arms section)",
    "c": "bench_serving --max-concurrency: requests in flight at once",
    "prompts": "requests per pass (bench_serving --num-prompts)",
    "passes": "timed passes of the cell (repeats, times server starts in the alternating schedule)",
    "tok/s": "generated tokens per second over a pass, all requests together (bench_serving "
    "output_throughput): the median over the passes, with its 90% bootstrap interval",
    "min-max": "the slowest and fastest pass",
    "TPOT ms": "time per output token after the first, per request: the median over the passes of "
    "bench_serving's median_tpot_ms",
    "ITL ms": "inter-token latency: the median over the passes of bench_serving's median_itl_ms "
    "(a speculative round's tokens arrive together)",
    "TTFT ms": "time to first token, queueing included (median over the passes of median_ttft_ms)",
    "accept": "tokens committed per verify round (accepted drafts + the bonus token), from the "
    "server's /server_info over each pass alone (its statistics are reset after the warm-up); - for plain",
    "ratio": "the median over the pairs of passes of arm tok/s / reference tok/s (a pair: the same "
    "repeat, and in the alternating schedule the same start index), with its 90% bootstrap interval",
    "A/A spread": "the interval of the run's own A/A (ARM+again over ARM, a second server of the same "
    "arm) at that level, made symmetric around 1; the widest where there are several",
    "verdict": "wins / loses only where the ratio's interval excludes 1 and lies outside the A/A "
    "spread; else unresolved",
    "start spread": "alternating schedule: the fastest start's median tok/s over the slowest's, for "
    "the arm / its reference",
}


def _iv(interval, digits: int = 2) -> str:
    return f"[{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]" if interval else "-"


def ratio_text(row: dict) -> str:
    if row.get("ratio") is None:
        return "-"
    return f"{row['ratio']:.2f}x {_iv(row.get('interval'))}"


def markdown(report: dict) -> str:
    sections = (
        _md_alerts,
        _md_setup,
        _md_verdicts,
        _md_aa,
        _md_cells,
        md_phases,
        md_profiles,
        _md_greedy,
        _md_parity,
        _md_arms,
        _md_provenance,
    )
    title = report.get("series") or ", ".join(report["settings"]["arms"])
    lines = [f"# A/B {title}", ""]
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
        lines += [f"**left running: {', '.join(report['servers_left_running'])}**", ""]
    if report.get("skipped"):
        lines += [f"**{len(report['skipped'])} passes skipped** (Skipped, below).", ""]
    for name, why in (report.get("dropped") or {}).items():
        lines += [f"**{name} dropped (--keep-going)**:", "", "```", why.rstrip()[-3000:], "```", ""]
    lines += [f"Warning: {w}" for w in report["warnings"]] + ([""] if report["warnings"] else [])
    return lines


def _md_setup(report: dict) -> list[str]:
    s = report["settings"]
    info = s.get("dataset_info") or {}
    if s["dataset"] == "custom":
        data = f"{info.get('unique_prompts')} prompts ({info.get('prompt_kind')}) from `{info.get('source')}`"
    else:
        data = f"`{s['dataset']}` ({s['input_len']} input tokens, range ratio {s['range_ratio']})"
    levels = ", ".join(f"c={c}: {n} prompts" for c, n in zip(s["concurrency"], s["num_prompts"]))
    starts = f" x {s['starts']} starts" if s["schedule"] == "alternating" else ""
    return [
        f"Target `{s['model']}`, drafter `{s['drafter'] or '-'}` on {_hardware(report['stamp'])}.",
        f"Load: {data}; output {s['output_len']} tokens per request"
        + (f" (drawn from [{s['range_ratio']} x, 1 x])" if s.get("range_ratio", 1.0) != 1.0 else "")
        + f", seed {s['seed']}; {levels}; {s['repeats']} repeats{starts}.",
        f"Schedule **{s['schedule']}**: {s['schedule_reason']}."
        + (
            " Prelaunched: each next server started during the passes before it, held at its gate "
            "(before any GPU memory) until that server stopped."
            if s.get("prelaunch")
            else ""
        )
        + (
            f" Added to every arm: `{' '.join(s['schedule_added_args'])}`."
            if s.get("schedule_added_args")
            else ""
        ),
        f"Baseline `{s['baseline']}`" + (f"; chain `{s['chain']}`" if s.get("chain") else "") + ".",
        "",
    ]


def _md_verdicts(report: dict) -> list[str]:
    alternating = report["settings"]["schedule"] == "alternating"
    lines = ["## Verdicts", ""]
    if not report["comparisons"]:
        return lines + ["No pair of arms was measured at a common level.", ""]
    head = "| arm | vs | c | ratio [90%] | pairs | A/A spread | verdict |"
    rule = "|---|---|---|---|---|---|---|"
    if alternating:
        head, rule = head + " start spread |", rule + "---|"
    lines += [head, rule]
    for r in _in_order(report["comparisons"]):
        line = _comparison_line(r)
        if alternating:
            spreads = r.get("start_spread") or {}
            line += (
                " "
                + " / ".join(
                    f"{v:.2f}x" if v else "-" for v in (spreads.get(r["arm"]), spreads.get(r["reference"]))
                )
                + " |"
            )
        lines.append(line)
    reasons = sorted({r["why"] for r in report["comparisons"] if r["verdict"] == "unresolved"})
    if reasons:
        lines += ["", "Unresolved where: " + "; ".join(reasons) + "."]
    return lines + [""] + _md_online_budget(report) + _md_pace(report)


def _md_pace(report: dict) -> list[str]:
    """The same pairs by decode pace (``1 / TPOT``), each against the A/A spread of the pace."""
    pace = report.get("pace") or {}
    rows = pace.get("comparisons") or []
    if not rows:
        return []
    lines = [
        "### Decode pace (1 / TPOT)",
        "",
        "The same pairs by each pass's median time per output token after a request's first (a ratio above 1: "
        "the arm's requests decode faster): the decode steps' speed apart from the prefills' waits and ramps "
        "that tok/s holds. Its A/A spread is the A/A arm's, by the same measure.",
        "",
        "| arm | vs | c | pace ratio [90%] | pairs | A/A spread | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    return lines + [_comparison_line(r) for r in _in_order(rows)] + [""]


def _in_order(rows: list[dict]) -> list[dict]:
    """Comparison rows by what they compare against, then level, then arm."""
    return sorted(rows, key=lambda r: (r["against"], r["concurrency"], r["arm"]))


def _comparison_line(r: dict) -> str:
    """A comparison's row: arm, reference, level, ratio with its interval, pairs, A/A spread, verdict."""
    return (
        f"| {r['arm']} | {r['reference']} | {r['concurrency']} | {ratio_text(r)} | {r['pairs']} | "
        f"{_iv(r['aa_band'])} | **{r['verdict']}** |"
    )


def _md_online_budget(report: dict) -> list[str]:
    """Per level, the online budget against the fastest of the baseline and every fixed choice."""
    rows = report.get("online_budget") or []
    if not rows:
        return []
    lines = [
        "### The online budget against the fastest fixed choice",
        "",
        "Per level, the fastest (median tok/s) of the baseline, the chain and every fixed budget served, "
        "and the online budget's paired ratio to it.",
        "",
        "| arm | c | fastest fixed choice | ratio [90%] | A/A spread | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['reference']} | {ratio_text(r)} | {_iv(r['aa_band'])} | "
            f"**{r['verdict']}** |"
        )
    return lines + [""]


def _md_aa(report: dict) -> list[str]:
    lines = ["## A/A (a second server of the same arm)", ""]
    if not report["aa"]:
        return lines + [
            "No A/A arm in this run (name one with `+again`, e.g. `dflash+again`): no verdict can be "
            "given, as the spread between two servers of one configuration is unknown.",
            "",
        ]
    lines += ["| arm | of | c | ratio [90%] | pairs |", "|---|---|---|---|---|"]
    for r in report["aa"]:
        lines.append(f"| {r['arm']} | {r['of']} | {r['concurrency']} | {ratio_text(r)} | {r['pairs']} |")
    return lines + [""]


def _md_cells(report: dict) -> list[str]:
    base = report["settings"]["baseline"]
    alternating = report["settings"]["schedule"] == "alternating"
    head = f"| arm | c | prompts | passes | tok/s [90%] | min-max | vs {base} | TPOT ms | ITL ms | TTFT ms | accept |"
    rule = "|---|---|---|---|---|---|---|---|---|---|---|"
    if alternating:
        head, rule = head + " start spread |", rule + "---|"
    lines = ["## Cells", "", head, rule]
    for r in _rows_in_order(report):
        line = (
            f"| {r['arm']} | {r['concurrency']} | {r['num_prompts']} | {r['passes']} | "
            f"{_fmt(r['output_tok_s'])} {_iv(r['output_tok_s_interval'], 1)} | "
            f"{_fmt(r['output_tok_s_min'])}-{_fmt(r['output_tok_s_max'])} | "
            f"{_fmt(r['vs_baseline'], 2) + 'x' if r['vs_baseline'] is not None else '-'} | "
            f"{_fmt(r['median_tpot_ms'])} | {_fmt(r['median_itl_ms'])} | {_fmt(r['median_ttft_ms'])} | "
            f"{_fmt(r['accept_length'], 2)} |"
        )
        if alternating:
            line += f" {_fmt(r.get('start_spread'), 2)} |"
        lines.append(line)
    return lines + [""]


def _md_greedy(report: dict) -> list[str]:
    gc = report["greedy_check"]
    lines = ["## Greedy check", "", gc["message"] + ".", ""]
    for m in gc["mismatches"]:
        lines.append(
            f"- `{m['arm']}` prompt {m['prompt_index']} ({str(m['prompt'])[:40]!r}): first different token "
            f"{m['first_diff_token']}, {gc['reference']} {m['reference_ids']} vs {m['arm_ids']}"
            + _md_gap(m, gc)
        )
    return lines + ([""] if gc["mismatches"] else [])


def _md_gap(mismatch: dict, gc: dict) -> str:
    gap, reference = mismatch.get("gap"), gc["reference"]
    if not gc.get("reference_logprobs", True):  # absent from series written before it was kept
        return f" (margin unknown: {reference}'s log-probs were not recorded)" if gc["margin"] else ""
    if gap is None:
        return f" (the arm's token is not among {reference}'s two best there)" if "gap" in mismatch else ""
    return f" ({gap:.3g} nats below {reference}'s argmax: {'a near-tie' if mismatch['near_tie'] else 'a failure'})"


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


def _start_time(server: dict) -> str:
    """A server's start-up time; a prelaunched one's counts from its gate's opening."""
    held = server.get("held_seconds")
    return f"{server['start_seconds']} s" + (f" (held {held} s before)" if held is not None else "")


def _md_arms(report: dict) -> list[str]:
    lines = ["## Arms", ""]
    for a in report["arms"]:
        env = " ".join(f"{k}={v}" for k, v in a["env"].items())
        starts = [_start_time(s) for s in a.get("servers", []) if s.get("start_seconds") is not None]
        start = f", started in {', '.join(starts)}" if starts else ""
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
    if report.get("skipped"):
        lines += ["", "## Skipped", ""] + [f"- {s}" for s in report["skipped"]]
    return lines


def _md_provenance(report: dict) -> list[str]:
    s, st = report["settings"], report["stamp"]
    return [
        "",
        "## Provenance",
        "",
        f"- command: `{st.get('command') or ' '.join(report['command'])}`",
        f"- device: {st.get('device_name')}; hardware: {_hardware(st)}"
        + (f"; CPU {st.get('cpu_model')}" if st.get("gpus") else ""),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in st["versions"].items()),
        f"- commit `{st.get('commit')}`, date {st.get('date_utc')}, host `{st.get('host')}`",
        f"- load: `{s['bench_module']}` (SGLang's bench_serving) through one kept-loaded worker "
        "(`sglang_ddtree.ab.bench_worker`); the prefix cache flushed after each pass's warm-up "
        f"({s['warmup_requests']} warm-up requests a pass)",
        f"- raw logs: `{s['raw_dir']}`",
        *[
            f"- merged from `{m['series']}` (commit `{m['commit']}`, {m['date']}, {m['status']}): `{m['command']}`"
            for m in s.get("merged_from", [])
        ],
        "- time: "
        + (", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report.get("timing", {}).items()) or "-"),
        "",
        "## Columns",
        "",
    ] + [f"- **{k}**: {v}." for k, v in COLUMNS.items()]


# --------------------------------------------------------------------------- files


def write_report(report: dict, out_dir: Path, stem: str, plot_png: bool = True) -> list[Path]:
    """``<stem>.json``, ``.md`` and ``.png`` in ``out_dir``, replacing an earlier run's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    png = out_dir / f"{stem}.png"
    png.unlink(missing_ok=True)  # a re-run replaces the whole set
    if plot_png and plot(report, png) is not None:
        paths["png"] = png
    report["files"] = {k: v.name for k, v in paths.items()}
    paths["md"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report, indent=1, default=str) + "\n")
    return list(paths.values())


def rerender(json_path: Path, plot_png: bool = True) -> list[Path]:
    """Write the markdown (and PNG) of a JSON report again, next to it."""
    report = json.loads(Path(json_path).read_text())
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
        f"{'arm':<18}{'c':>5}{'tok/s':>10}{'vs ' + base:>12}{'TPOT ms':>9}{'ITL ms':>8}{'TTFT ms':>9}{'accept':>8}",
    ]
    for r in _rows_in_order(report):
        ratio = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] is not None else "-"
        out.append(
            f"{r['arm']:<18}{r['concurrency']:>5}{r['output_tok_s']:>10.1f}{ratio:>12}"
            f"{_fmt(r['median_tpot_ms']):>9}{_fmt(r['median_itl_ms']):>8}{_fmt(r['median_ttft_ms']):>9}"
            f"{_fmt(r['accept_length'], 2):>8}"
        )
    out.append(f"schedule: {report['settings']['schedule']} ({report['settings']['schedule_reason']})")
    for r in report["aa"]:
        out.append(f"A/A {r['arm']} / {r['of']} c={r['concurrency']}: {ratio_text(r)}")
    for r in report["comparisons"]:
        out.append(
            f"{r['arm']} / {r['reference']} c={r['concurrency']}: {ratio_text(r)} "
            f"A/A {_iv(r['aa_band'])} -> {r['verdict']}"
        )
    out.append(f"greedy check: {report['greedy_check']['message']}")
    out.append(f"parity: {report['parity']['message']}")
    out += [f"warning: {w}" for w in report["warnings"]]
    if report.get("skipped"):
        out.append(f"skipped: {len(report['skipped'])} passes (past --time-limit)")
    for name, why in (report.get("dropped") or {}).items():
        out.append(f"DROPPED {name}: {why.splitlines()[0]}")
    if report["servers_left_running"]:
        out.append(f"LEFT RUNNING: {', '.join(report['servers_left_running'])}")
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
