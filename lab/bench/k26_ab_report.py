"""Report of :mod:`.k26_ab`: per prompt length, profile and concurrency, each arm's tok/s
against plain and the chain, the winner, and a plot."""

from __future__ import annotations

from pathlib import Path

from lab.bench import _stamp
from lab.bench.gpu_rounds_report import online_budget_section, online_budget_targets, profile_section
from lab.bench.k26_ab_same_trees import aa_spread, same_trees_section, time_ratio
from lab.bench.k26_arms import CHAIN_BUDGET, verify_width
from lab.bench.replay_profiles import PROFILES, expected_accept_length

LIVE_SERVICE = "live K2.6 service (8x RTX PRO 6000, TP-8, DDTree): 138.7 tok/s c1, 322 c4, 466 c8, 517 c10"
# The same hardware without speculation (another harness, a vLLM fork; ../shared/docs/anchors.md):
# 92.4 tok/s c1, 350.9 c8. As ratios, what the live DDTree service gains over no speculation.
LIVE_RATIOS = {1: 138.7 / 92.4, 8: 466 / 350.9}
NOTES = [
    "One TP-8 rank on one GPU: per-GPU compute of the real service without its all-reduces "
    "and with the full 163,840-token LM head (the real rank holds 1/8 of it).",
    "Speculative arms run the replay drafter: real drafter forward and head, acceptance set by "
    "the profile (lab/bench/replay_profiles.py cites each).",
    f"Reference, other hardware and full model: {LIVE_SERVICE}; as ratios over no speculation "
    "on that hardware (no-speculation numbers from another harness): "
    + ", ".join(f"{r:.2f}x at c{c}" for c, r in LIVE_RATIOS.items())
    + ".",
    "All-reduce (modelled, not measured; the model of results/kimi-k2.6_h200_tp8_allreduce_model.md): "
    "two per layer (attention output and MoE) over [tokens, 7168] bf16, t = 15 us + 2 x 7/8 x "
    "bytes / 370 GB/s, for the target's 61 layers at each forward's tokens (concurrency x verify "
    "width) and the drafter's 6 layers at concurrency x 8. `AR share` is that time over the "
    "measured round plus it; `tok/s +AR` the measured tok/s scaled by round / (round + AR).",
]

# The all-reduce model of results/kimi-k2.6_h200_tp8_allreduce_model.md (NCCL ring busBW on 8 GPUs
# over NVLink without SHARP; the latency term is an assumption).
AR_LATENCY_MS, AR_BUS_GB_S, TP, HIDDEN, TARGET_LAYERS, DRAFTER_LAYERS, DRAFT_BLOCK = (
    0.015,
    370.0,
    8,
    7168,
    61,
    6,
    8,
)


def allreduce_ms(tokens: int) -> float:
    """One modelled all-reduce of ``[tokens, hidden]`` bf16 across the TP-8 ranks."""
    return AR_LATENCY_MS + 2 * (TP - 1) / TP * tokens * HIDDEN * 2 / (AR_BUS_GB_S * 1e9) * 1e3


def profile_accept(arm: str, profile: str | None) -> float | None:
    """Tokens per round the arm's tree takes under the profile with a calibrated drafter (the
    replay drafter's log-probs are the profile's): 1 for plain, the top-1 chain of 7 for the
    chain, DDTree's best-first tree of ``B`` nodes for ``ddtree@B``; None for the online budget
    (its tree changes per step) and unknown profiles. Measured accept lengths sit below it by
    the last round of each request, cut by its output length."""
    arm = arm.partition("+")[0]
    if arm == "plain":
        return 1.0
    if profile not in PROFILES:
        return None
    if arm == "chain":
        return expected_accept_length(PROFILES[profile], CHAIN_BUDGET, topk=1)
    budget = arm.partition("@")[2]
    return expected_accept_length(PROFILES[profile], int(budget)) if budget.isdigit() else None


def round_allreduce_ms(arm: str, concurrency: int) -> float:
    """Modelled all-reduce time of one round of ``concurrency`` requests under TP-8."""
    ms = 2 * TARGET_LAYERS * allreduce_ms(concurrency * verify_width(arm))
    if arm != "plain":
        ms += 2 * DRAFTER_LAYERS * allreduce_ms(concurrency * DRAFT_BLOCK)
    return ms


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


def with_allreduce(arm: str, cell: dict) -> tuple[float, float]:
    """(modelled all-reduce share of the round, tok/s with it added to every round)."""
    ar = round_allreduce_ms(arm, cell["concurrency"])
    return ar / (cell["round_ms"] + ar), cell["tok_per_s"] * cell["round_ms"] / (cell["round_ms"] + ar)


def rows(results: dict) -> list[list]:
    out = []
    graph_max_bs = results.get("args", {}).get("graph_max_bs")
    for (length, profile, c), arms in sorted(_cells(results).items()):
        # Above the largest captured batch every arm decodes eagerly (launch-bound on 61 layers).
        eager = graph_max_bs is not None and c > graph_max_bs
        plain, chain = arms.get("plain"), arms.get("chain")
        best = max(arms, key=lambda a: arms[a]["tok_per_s"])
        for arm, cell in arms.items():
            share, with_ar = with_allreduce(arm, cell)
            plain_ar = with_allreduce("plain", plain)[1] if plain else None
            out.append(
                [
                    length,
                    profile,
                    c,
                    arm,
                    cell["tok_per_s"],
                    cell["accept_length"],
                    profile_accept(arm, profile),
                    cell["tpot_ms"],
                    cell.get("ttft_ms"),
                    cell.get("itl_ms"),
                    cell["tok_per_s"] / plain["tok_per_s"] if plain else None,
                    cell["tok_per_s"] / chain["tok_per_s"] if chain else None,
                    share,
                    with_ar,
                    with_ar / plain_ar if plain_ar else None,
                    cell.get("tok_per_s_spread"),
                    ", ".join(n for n, on in (("wins", arm == best), ("eager", eager)) if on),
                ]
            )
    return out


def verdicts(results: dict) -> list[str]:
    """Per prompt length, profile and concurrency: which arm wins and by how much, the best
    DDTREE budget against plain and the chain, and plainly where DDTREE loses."""
    lines, cells = [], _cells(results)
    aa = aa_spread(cells)  # two servers that built the same trees: how far two starts differ
    for (length, profile, c), arms in sorted(cells.items()):
        best = max(arms, key=lambda a: arms[a]["tok_per_s"])
        # arm variants (``+suffix``) are comparisons, not candidates for the best budget
        trees = {a: cell for a, cell in arms.items() if a.startswith("ddtree@") and "+" not in a}
        text = f"prompt {length}, {profile}, c={c}: {best} wins"
        others = sorted(((cell["tok_per_s"], a) for a, cell in arms.items() if a != best), reverse=True)
        if others:
            margin = arms[best]["tok_per_s"] / others[0][0]
            text += (
                f" ({margin:.2f}x the next arm{_within_spread(margin, aa, arms[best], arms[others[0][1]])})"
            )
        if trees:
            tree = max(trees, key=lambda a: trees[a]["tok_per_s"])
            for baseline in ("plain", "chain"):
                if baseline in arms:
                    ratio = trees[tree]["tok_per_s"] / arms[baseline]["tok_per_s"]
                    text += f"; {tree} {ratio:.2f}x {baseline}{_decode_ratio(trees[tree], arms[baseline])}"
                    text += _loses(ratio, aa)
            if c in LIVE_RATIOS:
                text += f"; live service {LIVE_RATIOS[c]:.2f}x no speculation"
        lines.append(text)
    return lines


def _loses(ratio: float, aa: float) -> str:
    """Said plainly where DDTREE loses, and whether the loss is inside the call's A/A spread."""
    if ratio >= 1:
        return ""
    return " (DDTREE LOSES, inside this call's A/A spread)" if 1 / ratio <= aa else " (DDTREE LOSES)"


def _decode_ratio(cell: dict, baseline: dict) -> str:
    """The decode speed of ``cell`` over ``baseline`` by ITL (net of each request's TTFT): the
    part of a tok/s margin that speculation moves, where a short request's prefill (100-230 ms
    against 0.3-0.6 s of decoding at c=1 on the K2.6 rank) can swing tok/s either way."""
    ratio = time_ratio(cell, baseline, "itl_ms")
    return "" if ratio is None else f" (decode {ratio:.2f}x by ITL)"


def _within_spread(margin: float, aa: float, *cells: dict) -> str:
    """A note when a margin is no larger than the spread of either cell's timed passes (the
    fastest over the slowest) or than the call's A/A spread (``k26_ab_same_trees``): the two
    arms' order is not settled by the run."""
    spread = max((cell.get("tok_per_s_spread") or 1.0) for cell in cells)
    if margin <= spread:
        return f", within the passes' spread {spread:.2f}x"
    return f", within this call's A/A spread {aa:.2f}x" if margin <= aa else ""


def exactness(results: dict) -> list[list]:
    return [
        [arm["arm"], c["prompt_len"], c["profile"], c["identical_share"]]
        for arm in results["arms"]
        for c in arm.get("cells", [])
        if "identical_share" in c
    ]


def _gpu_memory(arm: dict) -> str | None:
    usage = arm.get("memory_usage")
    if not isinstance(usage, dict):
        return None
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in usage.items())


def _requests_note(args: dict) -> str:
    """How long each request was: tok/s, TPOT and round ms are wall-clock over whole requests
    (their prefills included)."""
    spread = args.get("output_len_spread") or 0.0
    length = args.get("output_len", "?")
    if spread:
        drawn = f"drawn per request from +-{spread:.0%} around a mean of {length} (the same in every arm)"
    else:
        drawn = f"{length} for every request (plain requests run in lockstep: bench/output_lens.py)"
    return (
        f"Greedy requests, output tokens {drawn}; tok/s, TPOT and round ms are wall time over whole "
        "requests, prefills included."
    )


def to_markdown(results: dict) -> str:
    arms = results["arms"]
    lines = [
        "# Kimi K2.6, one TP-8 rank on one GPU: plain vs chain vs DDTREE",
        "",
        *[f"- {n}" for n in NOTES],
        f"- {_requests_note(results.get('args') or {})}",
    ]
    lines += ["", _stamp.stamp_markdown(results["stamp"]), "", "## Arms", ""]
    lines.append(
        _stamp.md_table(
            ["arm", "start s", "KV pool tokens", "GPU memory (GB)", "skipped / error"],
            [
                [
                    a["arm"],
                    a.get("start_s"),
                    a.get("max_total_num_tokens"),
                    _gpu_memory(a),
                    "; ".join([*a.get("skipped", []), *([a["error"][-200:]] if "error" in a else [])])[:300],
                ]
                for a in arms
            ],
        )
    )
    lines += ["", "## Who wins", ""] + [f"- {v}" for v in verdicts(results)]
    lines += ["", "## Throughput", ""]
    header = ["prompt len", "profile", "conc", "arm", "tok/s", "accept len", "accept (profile)", "TPOT ms"]
    header += ["TTFT ms", "ITL ms", "x plain", "x chain", "AR share"]
    header += ["tok/s +AR", "x plain +AR", "spread", ""]
    lines.append(_stamp.md_table(header, rows(results)))
    lines += [
        "",
        "## Greedy outputs equal to plain (in float32 a difference is a defect; in bf16 a near-tie or a defect)",
        "",
    ]
    lines.append(_stamp.md_table(["arm", "prompt len", "profile", "identical share"], exactness(results)))
    lines += online_budget_goals(results)
    lines += online_budget_section(results)
    lines += widths_by_cell(results)
    lines += prefills_by_cell(results)
    lines += same_trees_section(_cells(results))
    lines += profile_section(results)
    lines += start_profile_section(results)
    return "\n".join(lines) + "\n"


# Rows of a request-start timeline in the report (its JSON keeps them all).
START_ROWS = 24


def start_profile_section(results: dict) -> list[str]:
    """Each profiled request start (``--start-profile-arms``): its TTFT and its timeline."""
    lines = []
    for arm in results["arms"]:
        for i, profile in enumerate(arm.get("start_profiles") or []):
            beside = f" beside {profile['load']} decoding" if profile.get("load") else ", from idle"
            lines += ["", f"### {arm['arm']}, request {i + 1}{beside}", ""]
            if "error" in profile:
                lines.append(f"- {profile['error']}")
                continue
            lines += [
                f"- TTFT (SGLang's stamp): {_fmt_ms(profile.get('ttft_ms'))}; trace `{profile['trace']}`",
                "",
            ]
            rows = [
                [
                    r["at_ms"],
                    r["what"],
                    r["host_ms"],
                    *(r.get(key, "") for key in ("gpu_at_ms", "gpu_ms", "launches", "graph_launches")),
                    ", ".join(f"{name[:48]} {ms:.1f}" for name, ms in r.get("top_kernels", [])),
                ]
                for r in profile["timeline"][:START_ROWS]
            ]
            header = [
                "at ms",
                "forward or wait",
                "host ms",
                "GPU at ms",
                "GPU ms",
                "launches",
                "graph launches",
                "largest kernels (GPU ms)",
            ]
            lines.append(_stamp.md_table(header, rows))
    if not lines:
        return []
    intro = (
        "One request at a time, from an idle server or beside requests already decoding, under the "
        "torch profiler through its prefill and first rounds (no Python stacks). Times from the "
        "first forward's host start; "
        "a forward with hundreds of launches and no graph launch ran eagerly."
    )
    return ["", "## Request start (profiled)", "", intro, *lines]


def _fmt_ms(ms) -> str:
    return "-" if ms is None else f"{ms:.1f} ms"


def online_budget_goals(results: dict) -> list[str]:
    """Issue 18's goals per prompt length and profile, for calls with an online-budget arm:
    within 5% of the best fixed budget of the same call and of plain, at every concurrency."""
    by_set: dict = {}
    for (length, profile, c), arms in _cells(results).items():
        for arm, cell in arms.items():
            by_set.setdefault((length, profile), {}).setdefault(arm, {})[c] = cell
    rows = [
        [length, profile, *row]
        for (length, profile), levels in sorted(by_set.items())
        for row in online_budget_targets(levels)
    ]
    if not rows:
        return []
    header = ["prompt len", "profile", "ratio", "measured", "goal", "met"]
    return ["", "## Online budget: the goals (same call)", "", _stamp.md_table(header, rows)]


def widths_by_cell(results: dict) -> list[str]:
    """The online budget's steps per batch size and width in each cell (warm-up included)."""
    rows = [
        [
            arm["arm"],
            cell["prompt_len"],
            cell["profile"],
            cell["concurrency"],
            _steps(cell["width_steps_by_bs"]),
        ]
        for arm in results["arms"]
        for cell in arm.get("cells", [])
        if "width_steps_by_bs" in cell
    ]
    if not rows:
        return []
    header = ["arm", "prompt len", "profile", "conc", "steps: bs -> {width: steps}"]
    return ["", "## Online budget: widths chosen per cell", "", _stamp.md_table(header, rows)]


def prefills_by_cell(results: dict) -> list[str]:
    """How each cell's requests were batched into prefills (from the server log; warm-up
    included)."""
    rows = [
        [
            arm["arm"],
            cell["prompt_len"],
            cell["profile"],
            cell["concurrency"],
            cell["prefills"]["batches"],
            cell["prefills"]["requests"],
            cell["prefills"]["requests_per_batch"],
            cell["prefills"]["new_tokens"],
        ]
        for arm in results["arms"]
        for cell in arm.get("cells", [])
        if cell.get("prefills", {}).get("batches")
    ]
    if not rows:
        return []
    header = [
        "arm",
        "prompt len",
        "profile",
        "conc",
        "prefill batches",
        "requests",
        "per batch",
        "new tokens",
    ]
    intro = (
        "Every prefill is a forward the running requests wait for, so the batches, not the tokens, "
        "set what prefills cost a cell (SGLang's prefill lines at info; warm-up included)."
    )
    return ["", "## Prefill batches per cell", "", intro, "", _stamp.md_table(header, rows)]


def _steps(by_bs: dict) -> str:
    return "; ".join(
        f"{bs}: " + ", ".join(f"{w}x{n}" for w, n in sorted(ws.items())) for bs, ws in sorted(by_bs.items())
    )


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
