"""Sections of an A/B report's markdown: the cell helpers the report shares, and its diagnostic
tables, the phase timer's (``ARM+phases``) and the profiles' per-round summaries
(``--profile ARM@C``)."""

from __future__ import annotations

from .profiling import ALL_REDUCE


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def rows_in_order(report: dict) -> list[dict]:
    """Summary rows by concurrency, then in the order the arms were given."""
    arms = report["settings"]["arms"]
    return sorted(report["summary"], key=lambda r: (r["concurrency"], arms.index(r["arm"])))


def md_phases(report: dict) -> list[str]:
    """The cells of arms run with the DDTREE phase timer (``ARM+phases``)."""
    rows = [r for r in rows_in_order(report) if r.get("phase_host_us")]
    if not rows:
        return []
    names = list(dict.fromkeys(k for r in rows for k in r["phase_host_us"]))
    budget = [n for n in BUDGET_PHASES if n in names] if "round" in names else []
    lines = [
        "## Host time per round phase (us)",
        "",
        "Arms run with the DDTREE phase timer (`ARM+phases`: `SGLANG_DDTREE_PHASE_TIMES`): the worker's "
        "host time per step of a round, the mean over the rounds each pass logged (its warm-up's "
        "included), the median over the passes. `round` is the worker's whole round, `between rounds` "
        "the scheduler's time from one round's end to the next one's start; a step that waits for the "
        "GPU includes the wait. The timer costs host time itself: compare `ARM+phases` with `ARM` "
        "for the cost, not for the speed."
        + (
            " `online budget %` is the online budget's own host work (`width choice`, `width record`: "
            "choosing each step's width, recording its cost, predicting) as a share of `round`."
            if budget
            else ""
        ),
        "",
        "| arm | c | " + " | ".join(names + (["online budget %"] if budget else [])) + " |",
        "|---|---|" + "---|" * (len(names) + bool(budget)),
    ]
    for r in rows:
        phases = r["phase_host_us"]
        values = [fmt(phases.get(n)) for n in names] + (
            [fmt(_budget_share(phases, budget))] if budget else []
        )
        lines.append(f"| {r['arm']} | {r['concurrency']} | {' | '.join(values)} |")
    return lines + [""]


# The phases the online budget adds to a round (``adapter/worker.py``): the width choice and what
# the policy keeps of the step (its cost, and on predicting steps the next prediction).
BUDGET_PHASES = ("width choice", "width record")


def _budget_share(phases: dict[str, float], budget: list[str]) -> float | None:
    """The online budget's host work as a percentage of the worker's round (None: no round)."""
    round_us = phases.get("round")
    if not round_us:
        return None
    return 100.0 * sum(phases.get(n, 0.0) for n in budget) / round_us


PROFILE_HEAD = (
    "| arm | c | rounds | round us | GPU busy us | GPU idle us | launches | graph launches | syncs "
    "| all-reduce us | largest GPU parts (us) |"
)


def md_profiles(report: dict) -> list[str]:
    """``--profile ARM@C``: each profile's summary per round (``profiling.py``)."""
    profiled = [(a["name"], p) for a in report["arms"] for p in a.get("profiles") or []]
    if not profiled:
        return []
    lines = [
        "## Profiles (SGLang's torch profiler, per round)",
        "",
        "`--profile ARM@C`: after the arm's passes at level C, C requests decoding together under "
        "SGLang's profiler (no Python stacks) for up to "
        f"{report['settings'].get('profile_steps')} scheduler steps. A round is a target verify (or a "
        "plain decode); GPU busy is the union of kernel intervals, idle the rest of the round; "
        "syncs count host synchronisations and device-to-host copies.",
        "",
        PROFILE_HEAD,
        "|---" * 11 + "|",
    ]
    notes = []
    for name, p in profiled:
        if "error" in p:
            lines.append(f"| {name} | {p['concurrency']} | failed: {p['error'][:200]} |" + " - |" * 8)
            continue
        gpu = p.get("gpu_us_by_category") or {}
        top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(gpu.items(), key=lambda kv: -kv[1])[:4]) or "-"
        syncs = (
            p["host_syncs_per_round"] + p["device_to_host_copies_per_round"]
            if "host_syncs_per_round" in p
            else None
        )
        lines.append(
            f"| {name} | {p['concurrency']} | {p['rounds']} | {fmt(p['round_us'])} | "
            f"{fmt(p.get('gpu_busy_us'))} | {fmt(p.get('gpu_idle_us'))} | "
            f"{fmt(p.get('kernel_launches_per_round'))} | {fmt(p.get('graph_launches_per_round'))} | "
            f"{fmt(syncs)} | {fmt(gpu.get(ALL_REDUCE) if gpu else None)} | {top} |"
        )
        forwards = ", ".join(f"`{k}` x{v}" for k, v in (p.get("forwards") or {}).items())
        retried = f"; {p['max_new_tokens']} tokens a request" if "max_new_tokens" in p else ""
        cut = "; the requests ended before the profiler's steps" if p.get("cut_short") else ""
        notes.append(
            f"- {name} c={p['concurrency']}: {forwards or 'no forward names'}; trace `{p.get('trace')}`"
            + retried
            + cut
        )
        if p.get("phase_host_us"):
            gpu_phases = p.get("phase_gpu_us") or {}
            phases = ", ".join(
                f"{k} {v:.0f}" + (f" / GPU {gpu_phases[k]:.0f}" if k in gpu_phases else "")
                for k, v in p["phase_host_us"].items()
            )
            notes.append(f"  - phases (host us per round): {phases}")
    return lines + [""] + notes + [""]
