"""Report of :mod:`.k26_ab`: per prompt length, profile and concurrency, each arm's tok/s
against plain and the chain, the winner, and a plot."""

from __future__ import annotations

from pathlib import Path

from . import _stamp

LIVE_SERVICE = "live K2.6 service (8x RTX PRO 6000, TP-8, DDTree): 138.7 tok/s c1, 322 c4, 466 c8, 517 c10"
NOTES = [
    "One TP-8 rank on one GPU: per-GPU compute of the real service without its all-reduces "
    "(two per layer; modelled in bench_results/moe_tp8_allreduce_model.md) and with the full "
    "163,840-token LM head (the real rank holds 1/8 of it).",
    "Speculative arms run the replay drafter: real drafter forward and head, acceptance set by "
    "the profile (sglang_ddtree/bench/replay_profiles.py cites each).",
    f"Reference, other hardware and full model: {LIVE_SERVICE}.",
]


def _cells(results: dict) -> dict:
    """``{(len, profile, c): {arm: cell}}`` (plain's cells serve every profile)."""
    table: dict = {}
    profiles = results["args"]["profiles"]
    for arm in results["arms"]:
        for cell in arm.get("cells", []):
            if "concurrency" not in cell:
                continue
            for profile in profiles if cell["profile"] is None else [cell["profile"]]:
                table.setdefault((cell["prompt_len"], profile, cell["concurrency"]), {})[arm["arm"]] = cell
    return table


def rows(results: dict) -> list[list]:
    out = []
    for (length, profile, c), arms in sorted(_cells(results).items()):
        plain, chain = arms.get("plain"), arms.get("chain")
        best = max(arms, key=lambda a: arms[a]["tok_per_s"])
        for arm, cell in arms.items():
            out.append(
                [
                    length,
                    profile,
                    c,
                    arm,
                    cell["tok_per_s"],
                    cell["accept_length"],
                    cell["tpot_ms"],
                    cell["tok_per_s"] / plain["tok_per_s"] if plain else None,
                    cell["tok_per_s"] / chain["tok_per_s"] if chain else None,
                    "wins" if arm == best else "",
                ]
            )
    return out


def exactness(results: dict) -> list[list]:
    return [
        [arm["arm"], c["prompt_len"], c["profile"], c["identical_share"]]
        for arm in results["arms"]
        for c in arm.get("cells", [])
        if "identical_share" in c
    ]


def to_markdown(results: dict) -> str:
    arms = results["arms"]
    lines = [
        "# Kimi K2.6, one TP-8 rank on one GPU: plain vs chain vs DDTREE",
        "",
        *[f"- {n}" for n in NOTES],
    ]
    lines += ["", _stamp.stamp_markdown(results["stamp"]), "", "## Arms", ""]
    lines.append(
        _stamp.md_table(
            ["arm", "start s", "KV pool tokens", "skipped / error"],
            [
                [
                    a["arm"],
                    a.get("start_s"),
                    a.get("max_total_num_tokens"),
                    "; ".join(a.get("skipped", []))[:200],
                ]
                + ([a["error"][-200:]] if "error" in a else [])
                for a in arms
            ],
        )
    )
    lines += ["", "## Throughput", ""]
    header = [
        "prompt len",
        "profile",
        "conc",
        "arm",
        "tok/s",
        "accept len",
        "TPOT ms",
        "x plain",
        "x chain",
        "",
    ]
    lines.append(_stamp.md_table(header, rows(results)))
    lines += ["", "## Greedy outputs equal to plain (bf16; a difference is a near-tie or a defect)", ""]
    lines.append(_stamp.md_table(["arm", "prompt len", "profile", "identical share"], exactness(results)))
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(results)
    panels = sorted({(k[0], k[1]) for k in cells})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (length, profile) in zip(axes[0], panels):
        by_arm: dict = {}
        for (ln, pr, c), arms in cells.items():
            if (ln, pr) == (length, profile):
                for arm, cell in arms.items():
                    by_arm.setdefault(arm, []).append((c, cell["tok_per_s"]))
        for arm, points in sorted(by_arm.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=arm)
        ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title=f"prompt {length}, {profile}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(results: dict, out: Path, label: str) -> None:
    _stamp.write_json(out / f"{label}.json", results)
    (out / f"{label}.md").write_text(to_markdown(results))
    try:
        plot(results, out / f"{label}.png")
    except ImportError:
        pass
