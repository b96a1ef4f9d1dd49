"""A trace of a drafter's real draws: per (request, root offset), per depth, the top-k log-probs
and the rank at which the target's greedy token fell. Built from :mod:`.draw_recorder`'s rows
and the target's greedy continuation; served by :mod:`.trace_replay`.

Why one trace serves every budget: a DFlash drafter drafts a block's depths in parallel from the
context and the root, so its distributions at a root depend on neither the tree nor the budget,
and under greedy decoding the context is the target's greedy continuation whatever the budget.
So a draw is keyed by (prompt, root offset) alone; arms of different budgets root their rounds
at different offsets, and the trace is the union of every recorded arm's rounds.

Format (``ddtree-trace/1``; JSON, gzip where the name ends in ``.gz``, xz in ``.xz``: about two
thirds of gzip's size, which counts where a trace travels to the GPU beside the bundle)::

    {"format": "ddtree-trace/1", "depth": D, "topk": K, "decimals": 3, "summary": {...},
     "requests": [{"prompt": <hash>, "prompt_len": n, "length": <continuation tokens>,
                   "offsets": [o, ...],             # root offsets (root_pos - prompt_len), sorted
                   "logp": [[[lp, ...] x D], ...],  # per offset, per depth: its top-k log-probs
                   "rank": [[r, ...], ...]}]}       # per offset, per depth: the true token's rank, -1 none

``requests`` follow the continuation file's order (a replay maps its requests onto them by
order). A rank is -1 where the true token is not in the recorded top-k or lies past the
continuation. Rows of an arm whose output left the continuation (a bf16 near-tie decided
otherwise) are kept only before the point where it left, and counted.

    python -m lab.bench.draw_trace --continuation seqs.json --draws DIR [DIR ...] --out trace.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
from pathlib import Path

from lab.bench.draw_recorder import prompt_hash

FORMAT = "ddtree-trace/1"
DECIMALS = 3


# --------------------------------------------------------------------------- reading


def _opener(path: Path):
    name = str(path)
    return gzip.open if name.endswith(".gz") else lzma.open if name.endswith(".xz") else open


def read_json(path: Path):
    with _opener(path)(path, "rt") as f:
        return json.load(f)


def write_json(path: Path, data) -> None:
    with _opener(path)(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))


def read_draws(folder: Path) -> list[dict]:
    """Every row the recorder wrote in ``folder`` (all its processes)."""
    rows = []
    for path in sorted(folder.glob("draws-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def arm_sequences(folder: Path) -> list[list[int]] | None:
    """What the recorded arm emitted (``sequences.json`` beside its draws, written by the runner),
    or None (assumed to be the continuation)."""
    path = folder / "sequences.json"
    return read_json(path)["sequences"] if path.exists() else None


# --------------------------------------------------------------------------- building


def true_rank(ids: list[int], token: int | None) -> int:
    """Where ``token`` is in a depth's top-k ids (-1: not there, or unknown)."""
    return ids.index(token) if token is not None and token in ids else -1


def agreed_length(sequence: list[int], reference: list[int]) -> int:
    """How many leading tokens ``sequence`` shares with ``reference``."""
    n = 0
    for a, b in zip(sequence, reference):
        if a != b:
            break
        n += 1
    return n


class TraceBuilder:
    """The union of arms' rows on one continuation (``sequences``: prompt + output each)."""

    def __init__(self, sequences: list[list[int]], topk: int):
        self.sequences, self.topk = sequences, topk
        self.records: list[dict[int, tuple[list, list]]] = [{} for _ in sequences]
        self.prompt_lens: list[int | None] = [None] * len(sequences)
        self.counts = {"rows": 0, "kept": 0, "unknown_prompt": 0, "past_end": 0, "off_continuation": 0}
        self._index: dict[tuple[str, int], int] = {}

    def request_of(self, prompt: str, prompt_len: int) -> int:
        """The continuation holding this prompt (the shortest that extends it), -1 none."""
        key = (prompt, prompt_len)
        if key not in self._index:
            found = [
                i
                for i, s in enumerate(self.sequences)
                if len(s) > prompt_len and prompt_hash(s[:prompt_len]) == prompt
            ]
            self._index[key] = min(found, key=lambda i: len(self.sequences[i]), default=-1)
        return self._index[key]

    def add_arm(self, rows: list[dict], emitted: list[list[int]] | None = None) -> None:
        """One arm's rows; ``emitted``: its own output sequences (rows past the point where one
        left the continuation are dropped)."""
        agreed: dict[int, int] = {}  # request -> tokens the arm's sequence shares with it
        for row in rows:
            self.counts["rows"] += 1
            request = self.request_of(row["prompt"], row["prompt_len"])
            if request < 0:
                self.counts["unknown_prompt"] += 1
                continue
            sequence = self.sequences[request]
            if request not in agreed:
                agreed[request] = self._agreed(emitted, request, row["prompt_len"])
            if row["root_pos"] >= len(sequence):  # a last round past max_new_tokens
                self.counts["past_end"] += 1
                continue
            if row["root_pos"] >= agreed[request] or sequence[row["root_pos"]] != row["root"]:
                self.counts["off_continuation"] += 1
                continue
            self.counts["kept"] += 1
            self._keep(request, row)

    def _agreed(self, emitted: list[list[int]] | None, request: int, prompt_len: int) -> int:
        sequence = self.sequences[request]
        if emitted is None:
            return len(sequence)
        prompt = sequence[:prompt_len]
        own = [s for s in emitted if s[:prompt_len] == prompt]
        return agreed_length(min(own, key=len), sequence) if own else 0

    def _keep(self, request: int, row: dict) -> None:
        self.prompt_lens[request] = row["prompt_len"]
        offset = row["root_pos"] - row["prompt_len"]
        kept = self.records[request].get(offset)
        if kept is not None and len(kept[0][0]) >= len(row["logp"][0]):
            return  # the same draw from another arm: keep the widest top-k
        sequence, k = self.sequences[request], self.topk
        truth = [
            sequence[p] if p < len(sequence) else None
            for p in range(row["root_pos"] + 1, row["root_pos"] + 1 + len(row["ids"]))
        ]
        logp = [[round(x, DECIMALS) for x in depth[:k]] for depth in row["logp"]]
        ranks = [true_rank(ids[:k], token) for ids, token in zip(row["ids"], truth)]
        self.records[request][offset] = (logp, ranks)

    def trace(self, source: dict | None = None) -> dict:
        requests = []
        for i, sequence in enumerate(self.sequences):
            offsets = sorted(self.records[i])
            n = self.prompt_lens[i] or 0
            requests.append(
                {
                    "prompt": prompt_hash(sequence[:n]) if n else None,
                    "prompt_len": n,
                    "length": len(sequence) - n if n else 0,
                    "offsets": offsets,
                    "logp": [self.records[i][o][0] for o in offsets],
                    "rank": [self.records[i][o][1] for o in offsets],
                }
            )
        depth = max((len(r["rank"][0]) for r in requests if r["rank"]), default=0)
        topk = max((len(d) for r in requests for lp in r["logp"] for d in lp), default=0)
        trace = {"format": FORMAT, "depth": depth, "topk": topk, "decimals": DECIMALS}
        trace["summary"] = {**self.counts, **rank_summary(requests, depth)}
        trace["source"] = source or {}
        trace["requests"] = requests
        return trace


def rank_summary(requests: list[dict], depth: int) -> dict:
    """Per depth, the share of records whose true token is the top-1 / in the top-k."""
    top1, in_topk, known = [0] * depth, [0] * depth, [0] * depth
    for request in requests:
        for ranks in request["rank"]:
            for d, r in enumerate(ranks):
                known[d] += 1
                top1[d] += r == 0
                in_topk[d] += r >= 0

    def share(counts):
        return [round(x / max(n, 1), 4) for x, n in zip(counts, known)]

    records = sum(len(r["offsets"]) for r in requests)
    return {"records": records, "top1_share": share(top1), "in_topk_share": share(in_topk)}


def build_trace(sequences: list[list[int]], arms: list[tuple], topk: int = 64, source=None) -> dict:
    """The trace of ``arms`` on the continuation ``sequences``: each arm is its rows and its own
    emitted sequences (None: assumed to be the continuation)."""
    builder = TraceBuilder(sequences, topk)
    for rows, emitted in arms:
        builder.add_arm(rows, emitted)
    return builder.trace(source)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--continuation", type=Path, required=True, help='{"sequences": [prompt + output]}')
    p.add_argument("--draws", type=Path, nargs="+", required=True, help="one recorder folder per arm")
    p.add_argument("--topk", type=int, default=64, help="ranks kept per depth")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    sequences = read_json(args.continuation)["sequences"]
    arms = [(read_draws(folder), arm_sequences(folder)) for folder in args.draws]
    source = {"arms": [folder.name for folder in args.draws]}
    trace = build_trace(sequences, arms, args.topk, source)
    write_json(args.out, trace)
    print(json.dumps(trace["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
