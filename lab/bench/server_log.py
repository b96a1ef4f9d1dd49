"""What a served arm's log says: the online budget's widths (its own lines) and how requests
were batched into prefills (SGLang's lines at info), read back into the A/B reports."""

from __future__ import annotations

import ast
import re
from pathlib import Path


def online_budget_lines(log_path) -> list[str]:
    """The online budget's start-up cost table and its last width summary, from a server log
    (what the arm chose per batch size, and what its rounds cost)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except (OSError, TypeError):
        return []
    found = [line for line in text.splitlines() if "DDTREE online budget:" in line]
    startup = [line for line in found if "start-up round costs" in line][:1]
    summaries = [line for line in found if "width_steps" in line][-1:]
    return [line.split("DDTREE online budget:", 1)[1].strip() for line in startup + summaries]


# SGLang 0.5.23's line for each prefill batch (at --log-level info).
PREFILL_LINE = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


def prefill_batches(log_path) -> list[tuple[int, int, int]]:
    """(requests, new tokens, cached tokens) of every prefill batch the server logged so far."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    return [tuple(int(g) for g in m.groups()) for m in PREFILL_LINE.finditer(text)]


def prefill_summary(batches: list[tuple[int, int, int]]) -> dict:
    """How a cell's requests were prefilled: each prefill is a forward the running requests
    wait for (an eager one of 150-280 ms on the K2.6 rank whatever its length, 0fc9c47), so
    the number of batches, not the tokens, sets what prefills cost a cell."""
    requests = sum(b[0] for b in batches)
    return {
        "batches": len(batches),
        "requests": requests,
        "new_tokens": sum(b[1] for b in batches),
        "requests_per_batch": requests / len(batches) if batches else None,
    }


# The online budget logs its widths every this many steps in benchmarks (its default is 1000):
# the widths per cell or level are the differences of the lines logged around it.
WIDTH_LOG_STEPS = 50


def width_summary(log_path) -> dict | None:
    """The online budget's last logged width summary (cumulative counts), {} before its
    first line; None for a server without the online budget."""
    lines = online_budget_lines(log_path)
    if not lines:
        return None
    summaries = [line for line in lines if line.startswith("{")]
    return ast.literal_eval(summaries[-1]) if summaries else {}


def steps_between(before: dict, after: dict) -> dict[int, dict[int, int]]:
    """Steps per batch size and width between two cumulative width summaries (to within the
    log's interval of ``WIDTH_LOG_STEPS`` steps)."""
    old = before.get("width_steps_by_bs", {})
    between = {}
    for bs, steps in after.get("width_steps_by_bs", {}).items():
        diff = {w: n - old.get(bs, {}).get(w, 0) for w, n in steps.items()}
        if any(diff.values()):
            between[bs] = {w: n for w, n in diff.items() if n}
    return between
