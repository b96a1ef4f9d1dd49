"""Analysis of an A/B run: per-cell medians, the paired comparisons with their intervals, the
A/A spread and the verdicts (``paired.py``), the greedy check (``greedy_check.py``), parity and
provenance, gathered into one report dict (``render.py`` writes it as JSON, markdown and a PNG
plot)."""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import statistics

from . import paired
from .arms import AGAIN, CONTEXT_KEYS, PARITY_FLAGS, PARITY_KEYS, PHASES, SPEC_KEYS, Arm, chain_reference
from .greedy_check import greedy_check
from .stamp import host_stamp


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- cells


def levels_of(arms: list[Arm]) -> list[int]:
    return sorted({r["concurrency_requested"] for a in arms for r in a.runs})


def _runs_at(arm: Arm, concurrency: int) -> list[dict]:
    return [r for r in arm.runs if r["concurrency_requested"] == concurrency]


def summarise(arms: list[Arm], baseline: str, alternating: bool = False) -> list[dict]:
    """One row per (arm, level): the medians over its passes, with the tok/s interval."""
    rows = []
    for arm in arms:
        for conc in levels_of([arm]):
            runs = _runs_at(arm, conc)
            tok = [r["output_throughput"] for r in runs]
            interval = list(paired.median_interval(tok)) if len(tok) >= 2 else None
            row = {
                "arm": arm.name,
                "kind": arm.kind,
                "concurrency": conc,
                "num_prompts": runs[0]["num_prompts"],
                "passes": len(runs),
                "output_tok_s": _median(tok),
                "output_tok_s_interval": interval,
                "output_tok_s_min": min(tok),
                "output_tok_s_max": max(tok),
                "output_tok_s_passes": [round(t, 2) for t in tok],
                "median_tpot_ms": _median(r["median_tpot_ms"] for r in runs),
                "median_itl_ms": _median(r["median_itl_ms"] for r in runs),
                "median_ttft_ms": _median(r["median_ttft_ms"] for r in runs),
                "p99_ttft_ms": _median(r["p99_ttft_ms"] for r in runs),
                "accept_length": _median(r["accept_length"] for r in runs),
                "completed": sum(r["completed"] or 0 for r in runs),
            }
            phases = [r["phase_host_us"] for r in runs if r.get("phase_host_us")]
            if phases:  # ARM+phases: the median over the passes of each phase's host us per round
                names = list(dict.fromkeys(k for p in phases for k in p))
                row["phase_host_us"] = {k: _median(p.get(k, 0.0) for p in phases) for k in names}
            if alternating:
                by_start = {}
                for r in runs:
                    by_start.setdefault(r["start"], []).append(r["output_throughput"])
                medians = [statistics.median(v) for _, v in sorted(by_start.items())]
                row["start_tok_s"] = medians
                row["start_spread"] = max(medians) / min(medians) if len(medians) > 1 else None
            rows.append(row)
    base = {r["concurrency"]: r["output_tok_s"] for r in rows if r["arm"] == baseline}
    for row in rows:
        ref = base.get(row["concurrency"])
        row["vs_baseline"] = row["output_tok_s"] / ref if ref else None
    return rows


# --------------------------------------------------------------------------- paired comparisons


def throughput(run: dict) -> float | None:
    """A pass's output tokens a second: what a comparison's ratio is of."""
    return run["output_throughput"]


def decode_pace(run: dict) -> float | None:
    """A pass's decode pace, a request's tokens a millisecond after its first (``1 / TPOT``, the
    median over its requests): the decode steps' speed without the prefills' waits and ramps that
    tok/s holds. Not ``1 / ITL``: ``bench_serving`` spreads a chunk's gap evenly over its tokens,
    so the median over tokens of a speculative arm leans to its long rounds (a round of 8 tokens
    counts 8 times, one of 1 once): on the K2.6 rank the chain's median ITL was 1.2 ms against a
    TPOT of 3.8 ms."""
    tpot = run.get("median_tpot_ms")
    return 1.0 / tpot if tpot else None


def pair_samples(arm: Arm, other: Arm, concurrency: int, value=throughput) -> tuple[list[float], list[int]]:
    """The paired ratios of ``arm`` over ``other`` at a level (pass ``(start, repeat)`` with the
    same pass of the other) of ``value`` (a pass's tok/s by default), and each pair's start (the
    bootstrap's groups)."""
    theirs = {(r["start"], r["repeat"]): value(r) for r in _runs_at(other, concurrency)}
    ratios, groups = [], []
    for r in sorted(_runs_at(arm, concurrency), key=lambda r: (r["start"], r["repeat"])):
        mine, ref = value(r), theirs.get((r["start"], r["repeat"]))
        if mine and ref:
            ratios.append(mine / ref)
            groups.append(r["start"])
    return ratios, groups


def compared_pairs(arms: list[Arm], baseline: str) -> list[tuple[str, str, str]]:
    """``(arm, reference, why)``: every arm against the baseline, every DDTREE arm against the
    chain (stock DFLASH where it runs) when that is not the baseline, the online budget against
    every fixed choice, and an arm against each of its variants; A/A arms apart."""
    names = [a.name for a in arms]
    chain = chain_reference(names)
    pairs = []
    for arm in arms:
        if arm.again or arm.name == baseline:
            continue
        pairs.append((arm.name, baseline, "baseline"))
    if chain and chain != baseline:
        for arm in arms:
            if arm.kind == "ddtree" and not arm.again:
                pairs.append((arm.name, chain, "chain"))
    # The online budget must never lose to a choice a user could have fixed: it is also
    # compared with every fixed width served (the chain and each fixed budget).
    compared = {(a, r) for a, r, _ in pairs}
    for arm in arms:
        if is_online_budget(arm):
            pairs += [
                (arm.name, ref, "fixed") for ref in fixed_choices(arms) if (arm.name, ref) not in compared
            ]
    # What an arm makes over its variant (another tree builder, a debugging switch): e.g.
    # ddtree@32 over ddtree@32+heapq, the GPU tree step over the host's heapq. The phase timer's
    # variant costs host time by design and is read for its phases, not its speed.
    for arm in arms:
        if arm.variant not in (None, AGAIN, PHASES) and arm.base != baseline:
            pairs.append((arm.base, arm.name, "variant"))
    return pairs


def is_online_budget(arm: Arm) -> bool:
    return arm.kind == "ddtree" and arm.variant is None and arm.base.startswith("ddtree@auto")


def fixed_choices(arms: list[Arm]) -> list[str]:
    """The arms a user could serve instead of the online budget: the chain, stock DFLASH and
    each fixed DDTREE budget (their diagnostic variants and A/A servers apart)."""
    return [
        a.name
        for a in arms
        if a.variant is None
        and (a.kind in ("chain", "dflash") or (a.kind == "ddtree" and not is_online_budget(a)))
    ]


def online_budget_against_best(rows: list[dict], cells: list[dict]) -> list[dict]:
    """Per online-budget arm and level: its comparison with the fastest (median tok/s) of the
    baseline and every fixed choice it was compared with, the reading of "never slower than
    the best of plain, chain and any fixed budget"."""
    speed = {(c["arm"], c["concurrency"]): c["output_tok_s"] for c in cells}
    out = []
    for arm, conc in dict.fromkeys((r["arm"], r["concurrency"]) for r in rows if r["against"] == "fixed"):
        mine = [r for r in rows if r["arm"] == arm and r["concurrency"] == conc]
        out.append(max(mine, key=lambda r: speed.get((r["reference"], conc)) or 0.0))
    return out


def aa_pairs(arms: list[Arm]) -> list[tuple[str, str]]:
    return [(a.name, a.base) for a in arms if a.again]


def comparisons(
    arms: list[Arm], baseline: str, cells: list[dict], value=throughput
) -> tuple[list[dict], list[dict]]:
    """The A/A rows and the comparison rows (median paired ratio, 90% interval, verdict) of
    ``value``: tok/s by default, :func:`decode_pace` for the decode pace."""
    by_name = {a.name: a for a in arms}
    spread = {(c["arm"], c["concurrency"]): c.get("start_spread") for c in cells}
    aa_rows = []
    for name, base in aa_pairs(arms):
        for conc in levels_of([by_name[name], by_name[base]]):
            ratios, groups = pair_samples(by_name[name], by_name[base], conc, value)
            if ratios:
                aa_rows.append(
                    {"arm": name, "of": base, "concurrency": conc, **paired.compare(ratios, groups)}
                )
    rows = []
    for name, ref, why in compared_pairs(arms, baseline):
        for conc in levels_of([by_name[name], by_name[ref]]):
            ratios, groups = pair_samples(by_name[name], by_name[ref], conc, value)
            if not ratios:
                continue
            result = paired.compare(ratios, groups)
            band = paired.aa_band([a["interval"] for a in aa_rows if a["concurrency"] == conc])
            verdict, reason = paired.verdict(result["interval"], result["pairs"], band)
            rows.append(
                {
                    "arm": name,
                    "reference": ref,
                    "against": why,
                    "concurrency": conc,
                    **result,
                    "aa_band": band,
                    "verdict": verdict,
                    "why": reason,
                    "start_spread": {name: spread.get((name, conc)), ref: spread.get((ref, conc))},
                }
            )
    return aa_rows, rows


def headline(rows: list[dict], cells: list[dict], baseline: str) -> list[dict]:
    """Per level: the fastest arm (median tok/s) against the baseline, with its verdict."""
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        mine = {r["arm"]: r for r in rows if r["concurrency"] == conc and r["reference"] == baseline}
        speed = {c["arm"]: c["output_tok_s"] for c in cells if c["concurrency"] == conc}
        if not mine:
            continue
        best = max(mine, key=lambda a: speed.get(a) or 0.0)
        out.append(mine[best])
    return out


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
    skipped: list[str] | None = None,
    dropped: dict[str, str] | None = None,
    load_generator: dict | None = None,
    timing: dict | None = None,
    stamp: dict | None = None,
) -> dict:
    baseline = settings["baseline"]
    alternating = settings.get("schedule") == "alternating"
    cells = summarise(arms, baseline, alternating)
    aa_rows, rows = comparisons(arms, baseline, cells)
    pace_aa, pace_rows = comparisons(arms, baseline, cells, decode_pace)
    if stamp is None:  # this host, now (the servers have stopped)
        stamp = {**host_stamp(), "commit": settings.get("commit_at_start") or "unknown"}
        stamp["device_name"] = settings.get("device_name")
    else:  # a merge keeps its first run's
        stamp = dict(stamp)
    stamp["command"] = shlex.join(command)
    report = {
        "tool": "sglang_ddtree.ab",
        "format": 2,
        "series": settings.get("series"),
        "status": status,
        "error": error,
        "date": date.astimezone().isoformat(timespec="seconds"),
        "command": command,
        "stamp": stamp,
        "settings": settings,
        "summary": cells,
        "aa": aa_rows,
        "comparisons": rows,
        "headline": headline(rows, cells, baseline),
        "online_budget": online_budget_against_best(rows, cells),
        # the same pairs by decode pace (1 / TPOT): the decode steps' speed apart from tok/s
        "pace": {"aa": pace_aa, "comparisons": pace_rows},
        "greedy_check": greedy_check(
            arms,
            baseline,
            settings["check_prompts"],
            settings["check_tokens"],
            allow_greedy_mismatch,
            settings.get("greedy_margin", 0.0),
        ),
        "parity": parity(arms, CONTEXT_KEYS),
        "arms": [a.to_json() for a in arms],
        "load_generator": load_generator or {},
        "servers_left_running": [
            f"{a.name}{' start ' + str(s['start'] + 1) if alternating else ''}"
            for a in arms
            for s in a.servers
            if s.get("stopped") is False
        ],
        "skipped": skipped or [],
        "dropped": dropped or {},
        "timing": timing or {},
        "warnings": capacity_warnings(arms, settings["concurrency"]),
    }
    if load_generator and load_generator.get("stopped") is False:
        report["servers_left_running"].append("the load generator")
    report["parity"]["strict"] = strict_parity
    return report
