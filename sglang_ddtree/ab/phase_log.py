"""Host time per round phase, read from a DDTREE server's log: the ``ARM+phases`` variant.

A DDTREE server run with ``SGLANG_DDTREE_PHASE_TIMES=N`` logs the worker's host time per step of
the round, the mean over its last ``N`` rounds, every ``N`` rounds (``adapter/phases.py``):
``DDTREE phase host us/round: {'draft forward': 812.4, ..., 'round': 2210.3}``. The engine reads
the lines a pass added to the server's log and keeps their mean per phase with the pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ..config import ENV_PHASE_TIMES

PHASE_LINE = "DDTREE phase host us/round:"


def timed(env: dict[str, str]) -> bool:
    """Whether a server with this environment logs its phase times."""
    value = str(env.get(ENV_PHASE_TIMES, "")).strip()
    return value.isdigit() and int(value) > 0


def phase_lines(text: str) -> list[dict[str, float]]:
    """Every phase line of a log (text), oldest first: phase -> host us per round."""
    lines = []
    for line in text.splitlines():
        _, found, tail = line.partition(PHASE_LINE)
        if not found:
            continue
        try:
            value = ast.literal_eval(tail.strip())
        except (ValueError, SyntaxError):
            continue  # a line cut by the log's rotation or an interleaved write
        if isinstance(value, dict):
            lines.append(value)
    return lines


def phase_means(text: str) -> dict[str, float] | None:
    """The mean per phase over the lines of ``text`` (a phase a line lacks did not run in its
    rounds: 0 there); None without a line."""
    lines = phase_lines(text)
    if not lines:
        return None
    names = list(dict.fromkeys(name for line in lines for name in line))
    return {name: round(sum(line.get(name, 0.0) for line in lines) / len(lines), 1) for name in names}


def log_size(path) -> int:
    try:
        return Path(path).stat().st_size
    except (OSError, TypeError):
        return 0


def read_since(path, offset: int) -> str:
    """What a log gained after ``offset`` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except (OSError, TypeError):
        return ""
