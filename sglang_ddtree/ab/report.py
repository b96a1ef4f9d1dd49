"""Analysis of an A/B run: summary, winners, greedy check, parity and provenance, gathered
into one report dict (``render.py`` writes it as JSON, markdown and a PNG plot)."""

from __future__ import annotations

import datetime as _dt
import json
import statistics

from .arms import CONTEXT_KEYS, PARITY_FLAGS, PARITY_KEYS, SPEC_KEYS, Arm
from .stamp import host_stamp


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
    baseline = settings["baseline"]
    rows = summarise(arms, baseline)
    report = {
        "tool": "sglang_ddtree.ab",
        "status": status,
        "error": error,
        "date": date.astimezone().isoformat(timespec="seconds"),
        "command": command,
        "stamp": {**host_stamp(), "commit": settings.get("commit_at_start") or "unknown"},
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
