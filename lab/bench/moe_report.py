"""The MoE verify-cost report (``moe_verify``'s JSON as markdown and a PNG), next to the
reference numbers it is read against."""

from __future__ import annotations

from pathlib import Path

# docs/anchors.md, "SGLang's INT4 Marlin MoE measured on our H200": M -> (full ms, shard ms).
ANCHOR_H200 = {
    1: (0.219, 0.229),
    4: (0.343, 0.219),
    8: (0.558, 0.210),
    16: (0.863, 0.237),
    32: (1.357, 0.315),
    64: (2.046, 0.405),
    128: (2.643, 0.487),
    256: (3.041, 0.555),
    512: (3.609, 0.639),
    1024: (6.027, 0.940),
}


# The seed system (RTX PRO 6000 Blackwell, one GPU, full size): M -> (ms, us/token).
SEED_BLACKWELL = {
    1: (0.151, 150.6),
    9: (1.180, 131.2),
    32: (3.171, 99.1),
    90: (5.189, 57.7),
    256: (7.018, 27.4),
    1024: (7.0, 6.85),
}


def render_markdown(res: dict) -> str:
    from lab.bench._stamp import md_table, stamp_markdown

    st = res["stamp"]
    out = [
        "# INT4 Marlin MoE verify cost at Kimi K2.6 shapes",
        "",
        stamp_markdown(st),
        "",
        f"Measured ceilings in this run: device-to-device copy **{res['copy_gbs']:.0f} GB/s** (read + write), "
        f"bf16 matmul **{res['matmul_tflops']:.0f} TFLOP/s**. SGLang kernel import {res['import_s']:.1f} s, "
        f"first calls (JIT load or compile) {res['jit_s']:.1f} s. Timings: median of {res['reps']} CUDA-event "
        "samples; *eager* = one call between events, host launch gaps included (how docs/anchors.md was "
        "measured); *graph* = CUDA-graph replay (what a served model sees).",
        "",
    ]
    for moe in res["moe"].values():
        sh = moe["shape"]
        out += [
            f"## Routed experts, expert FFN {sh['ffn']} ({'one GPU, full' if sh['ffn'] == 2048 else 'one TP-8 shard'})",
            "",
            f"E={sh['num_experts']}, top-{sh['top_k']}, hidden {sh['hidden']}, group {sh['group_size']}, uint4b8, "
            f"routing: {moe.get('routing', 'router')}; "
            f"{moe['expert_weight_bytes'] / 1e6:.2f} MB streamed per touched expert. Correctness against a float32 "
            "dequantised reference: "
            + ", ".join(f"M={c['M']} ({c['align_path']}) rel err {c['rel_err']:.1e} {'ok' if c['ok'] else 'FAILED'}" for c in moe["checks"]),
            "",
        ]  # fmt: skip
        rows = []
        for r in moe["rows"]:
            anchor = ANCHOR_H200.get(r["M"])
            a = anchor[0 if sh["ffn"] == 2048 else 1] if anchor and sh["ffn"] in (2048, 256) else None
            rows.append([
                r["M"], r["experts_touched"], r["align_path"], r["core_eager"], r["us_per_token_eager"],
                f"{a:.3f} ({r['core_eager'] / a:.2f}x)" if a else "-",
                r["core_graph"], r["us_per_token_graph"], r["weight_gbs_graph"], f"{100 * r['bw_frac_graph']:.0f}%",
                r["router_graph"], r["core_combine_graph"] - r["core_graph"], r["layer_graph"],
            ])  # fmt: skip
        out.append(md_table(
            ["M", "experts touched", "align", "core eager ms", "us/token", "anchor ms (ratio)", "core graph ms",
             "us/token", "weight GB/s", "of copy BW", "router ms", "combine ms", "layer graph ms"], rows))  # fmt: skip
        p = moe["plateau"]
        out += [
            "",
            f"Plateau M (first M within 20% of the M=512 time): eager **{p['eager']['plateau_m']}**, graph "
            f"**{p['graph']['plateau_m']}**; compute-bound onset (doubling M costs >= 1.5x): eager "
            f"{p['eager']['compute_bound_onset_m']}, graph {p['graph']['compute_bound_onset_m']}.",
            "",
        ]
    if res["dense"]:
        out += ["## bf16 dense MLPs (shared expert, first-layer dense MLP), graph replay", ""]
        names = list(res["dense"])
        ms = [r["M"] for r in res["dense"][names[0]]["rows"]]
        rows = [[m] + [res["dense"][n]["rows"][i]["graph"] for n in names] for i, m in enumerate(ms)]
        out.append(md_table(["M"] + [f"{n} ms" for n in names], rows))
        out += ["", "Weight bandwidth at M=1 (graph): " + ", ".join(
            f"{n} {res['dense'][n]['rows'][0]['weight_gbs_graph']:.0f} GB/s ({100 * res['dense'][n]['rows'][0]['bw_frac_graph']:.0f}%)"
            for n in names), ""]  # fmt: skip
    return "\n".join(out)


def plot(res: dict, path: Path) -> Path | None:
    from lab.bench._stamp import plot_lines

    series = {}
    for moe in res["moe"].values():
        f = moe["shape"]["ffn"]
        ms = [r["M"] for r in moe["rows"]]
        series[f"routed FFN {f}, eager"] = (ms, [r["core_eager"] for r in moe["rows"]])
        series[f"routed FFN {f}, graph"] = (ms, [r["core_graph"] for r in moe["rows"]])
    series["anchor FFN 2048 (eager)"] = (list(ANCHOR_H200), [v[0] for v in ANCHOR_H200.values()])
    series["anchor FFN 256 (eager)"] = (list(ANCHOR_H200), [v[1] for v in ANCHOR_H200.values()])
    return plot_lines(path, series, title=f"INT4 Marlin MoE per call, {res['stamp'].get('device')}",
                      xlabel="M (tokens per forward)", ylabel="ms per call", logy=True)  # fmt: skip
