"""An A/B report's PNG: tok/s per concurrency per arm beside the paired ratio over the baseline,
the run's A/A spread shaded."""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, path: Path) -> Path | None:
    """Left: tok/s per concurrency per arm, with the 90% interval of each cell's median; right:
    the paired ratio over the baseline with its interval, and the A/A spread shaded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, s = report["summary"], report["settings"]
    if not rows:
        return None
    base = s["baseline"]
    concs = sorted({r["concurrency"] for r in rows})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = len(s["arms"])
    for i, arm in enumerate(s["arms"]):
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["concurrency"])
        if not mine:
            continue
        shift = 2 ** (0.06 * (i - (n - 1) / 2))  # arms side by side on the log axis
        xs = [r["concurrency"] * shift for r in mine]
        ys = [r["output_tok_s"] for r in mine]
        lo = [y - (r["output_tok_s_interval"] or [y, y])[0] for y, r in zip(ys, mine)]
        hi = [(r["output_tok_s_interval"] or [y, y])[1] - y for y, r in zip(ys, mine)]
        color = colors[i % len(colors)]
        style = ":" if arm.endswith("+again") else "-"
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=3, ls=style, color=color, label=arm)
        comp = sorted(
            (c for c in report["comparisons"] if c["arm"] == arm and c["reference"] == base),
            key=lambda c: c["concurrency"],
        )
        if comp:
            cx = [c["concurrency"] * shift for c in comp]
            cy = [c["ratio"] for c in comp]
            clo = [y - (c["interval"] or [y, y])[0] for y, c in zip(cy, comp)]
            chi = [(c["interval"] or [y, y])[1] - y for y, c in zip(cy, comp)]
            ax2.errorbar(
                cx, cy, yerr=[clo, chi], marker="o", ms=4, capsize=3, ls=style, color=color, label=arm
            )
    bands = {}
    for c in report["comparisons"]:
        if c.get("aa_band"):
            bands[c["concurrency"]] = c["aa_band"]
    for conc, (lo, hi) in bands.items():
        ax2.fill_between([conc / 1.3, conc * 1.3], lo, hi, color="gray", alpha=0.25, lw=0)
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    for a in (ax, ax2):
        if len(concs) > 1:
            a.set_xscale("log", base=2)
        a.set_xticks(concs)
        a.set_xticklabels([str(c) for c in concs])
        a.set_xlabel("concurrency (requests in flight)")
        a.grid(True, lw=0.3)
    ax.set_ylabel("output tok/s (median pass, 90% interval)")
    ax.set_ylim(bottom=0)
    ax2.set_ylabel(f"tok/s / {base} (median paired ratio, 90% interval)")
    title = f"A/B {report.get('series') or s.get('label')} ({s['schedule']})"
    if report["status"] != "ok":
        title += f" [{report['status'].upper()}]"
    fig.suptitle(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax2.set_title("grey: the run's A/A spread", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
