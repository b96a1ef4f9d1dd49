"""One report of several K2.6-rank A/B calls.

A full sweep (plain, chain, DDTREE at four budgets, two prompt lengths, two acceptance profiles,
concurrency 1-32) does not fit one device job, so it is served over several calls of
``k26_ab``, each with its own plain arm. Every ratio here is taken inside its call: a DDTREE
arm against the plain and chain arms served in the same call (plain's own tok/s moved up to
1.8x between calls of the same code). The summary lists, per prompt length, profile and
concurrency, each call's best DDTREE arm with those ratios; the greedy-identity checks of every
call follow, then each call's own report.

    python -m lab.bench.k26_ab_merge results/k26_rank_ab_4k_h200.json \\
        results/k26_rank_ab_auto_h200.json --label k26-rank_h200_ab_calls
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.bench import _stamp
from lab.bench.k26_ab_report import NOTES, _cells, exactness, to_markdown


def best_tree_rows(calls: list[tuple[str, dict]]) -> list[list]:
    """``[len, profile, c, call, best DDTREE arm, tok/s, accept, x plain, x chain, eager]``;
    arm variants (``+suffix``) are comparisons, not candidates. ``eager``: above the call's
    captured batch sizes every arm decoded eagerly (launch-bound plain decoding)."""
    out = []
    for name, results in calls:
        graph_max_bs = results.get("args", {}).get("graph_max_bs")
        for (length, profile, c), arms in _cells(results).items():
            trees = {a: cell for a, cell in arms.items() if a.startswith("ddtree@") and "+" not in a}
            if not trees:
                continue
            best = max(trees, key=lambda a: trees[a]["tok_per_s"])
            tok_s = trees[best]["tok_per_s"]
            over = [tok_s / arms[b]["tok_per_s"] if b in arms else None for b in ("plain", "chain")]
            eager = "eager" if graph_max_bs is not None and c > graph_max_bs else ""
            out.append([length, profile, c, name, best, tok_s, trees[best]["accept_length"], *over, eager])
    return sorted(out, key=lambda r: (r[0], r[1], r[2], r[3]))


def arm_ratio_rows(calls: list[tuple[str, dict]]) -> tuple[list[int], list[list]]:
    """Every speculative arm over its own call's plain, one column per concurrency:
    ``(concurrencies, [[len, profile, arm, call, x plain at each c (None: not served)]])``."""
    cells = [(name, key, arms) for name, results in calls for key, arms in _cells(results).items()]
    concurrencies = sorted({c for _, (_, _, c), _ in cells})
    table: dict = {}
    for name, (length, profile, c), arms in cells:
        if "plain" not in arms:
            continue
        for arm, cell in arms.items():
            if arm != "plain":
                row = table.setdefault((length, profile, arm, name), {})
                row[c] = cell["tok_per_s"] / arms["plain"]["tok_per_s"]
    rows = [[*key, *(ratios.get(c) for c in concurrencies)] for key, ratios in table.items()]
    return concurrencies, sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3]))


def to_merged_markdown(calls: list[tuple[str, dict]]) -> str:
    lines = ["# Kimi K2.6, one TP-8 rank on one GPU: every call of the A/B", "", *[f"- {n}" for n in NOTES]]
    lines += ["- Ratios are taken inside each call (its own plain and chain arms).", "", "## Calls", ""]
    calls_table = [
        [name, r["stamp"].get("commit"), r["stamp"].get("date_utc"), ", ".join(a["arm"] for a in r["arms"])]
        for name, r in calls
    ]
    lines += [_stamp.md_table(["call", "commit", "date", "arms"], calls_table), ""]
    lines += ["## The best DDTREE budget per cell (x plain, x chain: same call)", ""]
    header = [
        "prompt len",
        "profile",
        "conc",
        "call",
        "best DDTREE",
        "tok/s",
        "accept len",
        "x plain",
        "x chain",
        "",
    ]
    lines += [_stamp.md_table(header, best_tree_rows(calls)), ""]
    concurrencies, ratio_rows = arm_ratio_rows(calls)
    lines += ["## Every arm over plain (same call), per concurrency", ""]
    ratio_header = ["prompt len", "profile", "arm", "call", *(f"c={c}" for c in concurrencies)]
    lines += [_stamp.md_table(ratio_header, ratio_rows), ""]
    identity = [[name, *row] for name, r in calls for row in exactness(r)]
    lines += ["## Greedy outputs equal to plain, every call", ""]
    lines += [_stamp.md_table(["call", "arm", "prompt len", "profile", "identical share"], identity), ""]
    for name, results in calls:
        body = (
            to_markdown(results)
            .replace("\n#", "\n##")
            .replace("# Kimi K2.6", f"## Call {name}: Kimi K2.6", 1)
        )
        for note in NOTES:  # said once, at the top
            body = body.replace(f"- {note}\n", "")
        lines += [body]
    return "\n".join(lines) + "\n"


def plot(calls: list[tuple[str, dict]], path: Path) -> Path | None:
    """Best DDTREE / plain per concurrency, a line per (prompt length, profile, call); cells
    that ran eagerly are left out."""
    series: dict = {}
    for length, profile, c, name, _, _, _, x_plain, _, eager in best_tree_rows(calls):
        if x_plain is not None and not eager:
            series.setdefault(f"{length} {profile} {name}", ([], []))
            series[f"{length} {profile} {name}"][0].append(c)
            series[f"{length} {profile} {name}"][1].append(x_plain)
    if not series:
        return None
    return _stamp.plot_lines(
        path, series, title="best DDTREE / plain, K2.6 rank (CUDA-graph cells)", xlabel="concurrency", ylabel="x plain",
        hlines={"plain": 1.0},
    )  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="k26_ab JSON files, one per call")
    p.add_argument("--out", default="results")
    p.add_argument("--label", required=True)
    args = p.parse_args(argv)
    calls = [(Path(f).stem, json.loads(Path(f).read_text())) for f in args.results]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _stamp.write_json(out / f"{args.label}.json", {"calls": {name: r for name, r in calls}})
    (out / f"{args.label}.md").write_text(to_merged_markdown(calls))
    plot(calls, out / f"{args.label}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
