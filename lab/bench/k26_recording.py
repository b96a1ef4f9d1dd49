"""Plain's greedy continuations on the K2.6 rank: the replay drafter's truth (its acceptance
follows them) and the reference every speculative arm's greedy outputs must equal."""

from __future__ import annotations

import json
from pathlib import Path

from lab.bench.replay_drafter import recorded_row


def load_recording(path: Path, sets: dict, output_len: int) -> dict:
    """A plain recording written by an earlier call (``<label>_work/recording.json``), checked
    to hold every prompt of ``sets`` with at least ``output_len`` tokens after it: the replay
    drafter's truth and the identity reference, where the target's weights are the same
    (the rank's dummy weights are seeded)."""
    recording = json.loads(path.read_text())
    for prompts in sets.values():
        for prompt in prompts:
            row = recorded_row(recording["sequences"], prompt)
            if row < 0 or len(recording["sequences"][row]) - len(prompt) < output_len:
                raise ValueError(f"--recording {path}: no continuation of {output_len} tokens for a prompt")
    return recording


def same_share(outputs: list[list[int]], prompts: list[list[int]], sequences: list[list[int]]) -> float:
    """Share of ``outputs`` equal to the recorded continuation of their prompt."""
    rows = [recorded_row(sequences, p) for p in prompts]
    same = [row >= 0 and out == sequences[row][len(p) :] for out, p, row in zip(outputs, prompts, rows)]
    return sum(same) / len(same)
