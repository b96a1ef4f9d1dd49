"""Tree-verify attention at Kimi K2.6 MLA decode shapes: naive masked attention vs prefix/tail split.

The two paths are in ``sglang_ddtree/kernels/mla_tree_attention.py``: (a) naive, scores over
prefix + tree with a materialised [bs, W, L + W] mask, in torch; (b) split, a Triton split-KV
pass over the prefix whose ``W x heads`` query rows share every K/V tile, a small masked pass
over the tree tail, and a log-sum-exp merge. This module makes the problems (random trees on
random latent caches) and runs the sweep.

Both are checked against a float32 reference on awkward sizes before anything is timed.
Reported per shape: time, bytes / time against the copy bandwidth measured in the same run,
FLOP / time against the measured bf16 matmul rate, and which of the two bounds the prefix.

    python -m lab.bench.mla_tree_attention          # -> results/mla_tree_attention.*
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from lab.bench.mla_tree_configs import config_lines, time_configs
from lab.bench.sglang_verify_attention import SGLangVerifyAttention, drafter_markdown, drafter_sweep
from sglang_ddtree.kernels.compare import relative_difference
from sglang_ddtree.kernels.mla_tree_attention import (
    CANDIDATE_CONFIGS,
    D_LATENT,
    D_QK,
    FLOPS_PER_QK_PAIR,
    SplitConfig,
    SplitTreeAttention,
    TreeVerifyProblem,
    naive_tree_attention,
)

# =========================================================================== trees


def random_tree_parents(n_nodes: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree over nodes 0..n-1 in topological order (parent[i] < i, root -1)."""
    parents = [-1]
    for i in range(1, n_nodes):
        # Favour recent nodes a little so that trees get deep paths as well as wide fans.
        lo = max(0, i - 8) if torch.rand((), generator=gen).item() < 0.6 else 0
        parents.append(int(torch.randint(lo, i, (), generator=gen).item()))
    return parents


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_problem(
    bs: int, prefix_len: int, n_nodes: int, heads: int, device="cuda", seed: int = 0
) -> TreeVerifyProblem:
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(bs, n_nodes, heads, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    kv_pool = torch.randn(bs * prefix_len, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    k_tree = torch.randn(bs, n_nodes, D_QK, device=device, dtype=torch.bfloat16, generator=dgen)
    kv_indptr = torch.arange(0, bs + 1, device=device, dtype=torch.int32) * prefix_len
    kv_indices = torch.arange(bs * prefix_len, device=device, dtype=torch.int32)
    masks = [ancestor_mask(random_tree_parents(n_nodes, gen)) for _ in range(bs)]
    tree_mask = torch.stack(masks).to(device=device, dtype=torch.int8)
    return TreeVerifyProblem(q, kv_pool, kv_indptr, kv_indices, k_tree, tree_mask)


# =========================================================================== accounting


def prefix_bytes(bs: int, prefix_len: int) -> int:
    """The fewest bytes the prefix pass must read: each request's latent cache once."""
    return bs * prefix_len * D_QK * 2


def io_bytes(bs: int, n_nodes: int, heads: int) -> int:
    """Queries + tree rows + mask in, outputs out (bf16)."""
    rows = n_nodes * heads
    return bs * (rows * D_QK * 2 + n_nodes * D_QK * 2 + n_nodes * n_nodes + rows * D_LATENT * 2)


def attention_flops(bs: int, prefix_len: int, n_nodes: int, heads: int) -> tuple[float, float]:
    """(prefix, tail) FLOPs, counting every (query row, key) pair of the dense score matrix."""
    rows = n_nodes * heads
    return float(bs * rows * prefix_len * FLOPS_PER_QK_PAIR), float(bs * rows * n_nodes * FLOPS_PER_QK_PAIR)


def roofline(bytes_: float, flops: float, copy_gbs: float, mm_tflops: float) -> dict:
    t_mem, t_mm = bytes_ / (copy_gbs * 1e9), flops / (mm_tflops * 1e12)
    return {"floor_ms": 1e3 * max(t_mem, t_mm), "bound": "memory" if t_mem >= t_mm else "compute"}


# =========================================================================== benchmark


def check(configs: Sequence[SplitConfig], sms: int, sglang: bool = False) -> list[dict]:
    """split == naive == float32 reference on awkward sizes; every output element written.
    ``sglang``: SGLang's own verify kernel is checked against the reference as well."""
    out = []
    for heads in (8, 64):
        for n_nodes in (1, 17, 33, 65):
            for L in (1000, 4097):
                p = make_problem(2, L, n_nodes, heads, seed=L + n_nodes + heads)
                ref = naive_tree_attention(p, fp32=True)
                naive = naive_tree_attention(p)
                if sglang:
                    e = relative_difference(SGLangVerifyAttention(p)(), ref)
                    out.append({"heads": heads, "n_nodes": n_nodes, "prefix": L, "config": "sglang",
                                "rel_err_split": e, "rel_err_naive": relative_difference(naive, ref), "ok": e < 1e-2})  # fmt: skip
                for cfg in configs:
                    att = SplitTreeAttention(p, cfg, sms)
                    att.out.fill_(float("nan"))
                    try:
                        got = att()
                        torch.cuda.synchronize()
                    except Exception as exc:  # a config the compiler cannot fit is reported, not fatal
                        out.append({"heads": heads, "n_nodes": n_nodes, "prefix": L, "config": cfg.label(),
                                    "error": f"{type(exc).__name__}: {str(exc)[:200]}", "ok": None})  # fmt: skip
                        print(f"[mla] check {cfg.label()}: {out[-1]['error']}", flush=True)
                        continue
                    finite = bool(torch.isfinite(got).all())
                    e_split, e_naive, e_sn = (
                        relative_difference(got, ref),
                        relative_difference(naive, ref),
                        relative_difference(got, naive),
                    )
                    ok = finite and e_split < 1e-2 and e_sn < 2e-2
                    out.append({"heads": heads, "n_nodes": n_nodes, "prefix": L, "config": cfg.label(),
                                "n_splits": att.n_splits, "rel_err_split": e_split, "rel_err_naive": e_naive,
                                "rel_split_vs_naive": e_sn, "all_written": finite, "ok": ok})  # fmt: skip
                    if not ok:
                        print(f"[mla] CHECK FAILED {out[-1]}", flush=True)
    return out


def _time(fn, reps_target_ms: float = 150.0) -> float:
    """Median ms per call: CUDA-graph replay, repetitions sized to about ``reps_target_ms``."""
    from lab.bench._stamp import time_eager, time_graph

    t0 = time_eager(fn, reps=1, warmup=1)["median_ms"]
    reps = int(max(3, min(30, reps_target_ms / max(t0, 1e-3))))
    try:
        return time_graph(fn, reps=reps, warmup=1)["median_ms"]
    except RuntimeError:
        return time_eager(fn, reps=reps, warmup=0)["median_ms"]


def tune(sms: int, heads_list, nodes_list, configs) -> dict:
    """Best prefix-kernel config per (heads, W) at one representative shape (bs 4, prefix 8k)."""
    best = {}
    for heads in heads_list:
        for n_nodes in nodes_list:
            p = make_problem(4, 8192, n_nodes, heads, seed=3)
            timings = {}
            for cfg in configs:
                try:
                    att = SplitTreeAttention(p, cfg, sms)
                    timings[cfg.label()] = _time(lambda att=att: att._launch_partial(False, False))
                except Exception as exc:  # out of resources and the like: skip the config
                    timings[cfg.label()] = None
                    print(
                        f"[mla] tune {cfg.label()} heads={heads} W={n_nodes}: {type(exc).__name__}",
                        flush=True,
                    )
            ok = {k: v for k, v in timings.items() if v is not None}
            label = min(ok, key=ok.get) if ok else configs[0].label()
            best[(heads, n_nodes)] = next(c for c in configs if c.label() == label)
            print(f"[mla] tune heads={heads} W={n_nodes}: {timings} -> {label}", flush=True)
    return best


def run_sweep(
    args, copy_gbs: float, mm_tflops: float, sms: int, into: dict | None = None, on_row=None
) -> dict:
    nodes_list = [b + 1 for b in args.budgets]
    t0 = time.time()
    checks = check(CANDIDATE_CONFIGS if args.check_all_configs else CANDIDATE_CONFIGS[:2], sms, args.sglang)
    done = [c for c in checks if c["ok"] is not None]
    print(f"[mla] checks: {sum(c['ok'] for c in done)}/{len(done)} ok ({time.time() - t0:.0f} s)", flush=True)
    best = tune(sms, args.heads, nodes_list, CANDIDATE_CONFIGS)
    rows = []
    res = {} if into is None else into
    res.update(checks=checks, tuned={f"H{h}_W{w}": c.label() for (h, w), c in best.items()}, rows=rows)
    for heads in args.heads:
        for n_nodes in nodes_list:
            for bs in args.bs:
                for L in args.prefix:
                    fl_pre, fl_tail = attention_flops(bs, L, n_nodes, heads)
                    if fl_pre > args.max_flops:
                        continue
                    p = make_problem(bs, L, n_nodes, heads, seed=bs * 7 + L)
                    cfg = best[(heads, n_nodes)]
                    att = SplitTreeAttention(p, cfg, sms)
                    r = {"heads": heads, "n_nodes": n_nodes, "budget": n_nodes - 1, "bs": bs, "prefix": L,
                         "config": cfg.label(), "n_splits": att.n_splits}  # fmt: skip
                    r["split_ms"] = _time(att)
                    r["prefix_ms"] = _time(lambda att=att: att._launch_partial(False, False))
                    if args.configs:
                        r.update(time_configs(p, args.configs, sms, _time))
                    r["tail_ms"] = _time(lambda att=att: att._launch_partial(True, False))
                    r["merge_ms"] = _time(att.combine)
                    if args.sglang:
                        r["sglang_ms"] = _time(SGLangVerifyAttention(p))
                    if heads == 8 and n_nodes in (1, 17) and L >= 8192:
                        # What bounds the prefix pass: the same launch with index arithmetic instead
                        # of the per-token gather through kv_indices (valid here: slots are consecutive).
                        r["prefix_contig_ms"] = _time(lambda att=att: att._launch_partial(False, True))
                        r["prefix_contig_bw_frac"] = (
                            prefix_bytes(bs, L) / (r["prefix_contig_ms"] / 1e3) / 1e9 / copy_gbs
                        )
                    naive_elems = bs * heads * n_nodes * (L + n_nodes)
                    r["naive_ms"] = _time(lambda p=p: naive_tree_attention(p)) if naive_elems <= args.max_naive_elems else None  # fmt: skip
                    pb = prefix_bytes(bs, L)
                    part = 2 * bs * (att.n_splits + 1) * att.rows * (D_LATENT * 2 + 4)
                    r.update(prefix_bytes=pb, io_bytes=io_bytes(bs, n_nodes, heads), partial_bytes=part,
                             prefix_flops=fl_pre, tail_flops=fl_tail)  # fmt: skip
                    r["prefix_gbs"] = pb / (r["prefix_ms"] / 1e3) / 1e9
                    r["prefix_bw_frac"] = r["prefix_gbs"] / copy_gbs
                    r["prefix_tflops"] = fl_pre / (r["prefix_ms"] / 1e3) / 1e12
                    r["prefix_mm_frac"] = r["prefix_tflops"] / mm_tflops
                    rf = roofline(pb, fl_pre, copy_gbs, mm_tflops)
                    r["prefix_floor_ms"], r["prefix_bound"] = rf["floor_ms"], rf["bound"]
                    r["prefix_roofline_frac"] = rf["floor_ms"] / r["prefix_ms"]
                    r["total_gbs"] = (pb + r["io_bytes"]) / (r["split_ms"] / 1e3) / 1e9
                    r["speedup_vs_naive"] = r["naive_ms"] / r["split_ms"] if r["naive_ms"] else None
                    rows.append(r)
                    if on_row:
                        on_row()
                    print(
                        f"[mla] H={heads:2d} W={n_nodes:2d} bs={bs:2d} L={L:5d} split {r['split_ms']:.3f} ms "
                        f"(prefix {r['prefix_ms']:.3f}: {100 * r['prefix_bw_frac']:.0f}% copy BW, "
                        f"{100 * r['prefix_mm_frac']:.0f}% mm, {r['prefix_bound']}-bound) naive "
                        + (f"{r['naive_ms']:.3f}" if r["naive_ms"] else "skipped"),
                        flush=True,
                    )
                    del att, p
    return res


def _sglang_check_lines(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    ok, worst = sum(c["ok"] for c in checks), max(c["rel_err_split"] for c in checks)
    return [
        f"SGLang's target-verify kernel (`extend_attention_fwd`, flat custom mask): {ok}/{len(checks)} "
        f"checks within 1e-2 of the reference, worst {worst:.1e}.",
        "",
    ]


def render_markdown(res: dict) -> str:
    from lab.bench._stamp import md_table, stamp_markdown

    sglang_checks = [c for c in res["checks"] if c.get("config") == "sglang"]
    done = [c for c in res["checks"] if c["ok"] is not None and c.get("config") != "sglang"]
    ok = sum(c["ok"] for c in done)
    worst = max(done, key=lambda c: c["rel_err_split"])
    out = [
        "# Tree-verify attention at Kimi K2.6 MLA shapes",
        "",
        stamp_markdown(res["stamp"]),
        "",
        f"Ceilings measured in this run: copy **{res['copy_gbs']:.0f} GB/s**, bf16 matmul "
        f"**{res['matmul_tflops']:.0f} TFLOP/s**. Absorbed MLA (576-wide latent+rope keys, 512-wide values), "
        f"W = budget + 1 tree nodes per request, ancestor mask; times are CUDA-graph medians.",
        "",
        f"Numerics: {ok}/{len(done)} checks pass (split vs float32 reference < 1e-2, split vs naive "
        f"< 2e-2, every element written); worst split error {worst['rel_err_split']:.1e} "
        f"(H={worst['heads']}, W={worst['n_nodes']}, L={worst['prefix']}), naive bf16 error up to "
        f"{max(c['rel_err_naive'] for c in done):.1e}"
        + (
            f"; {len(res['checks']) - len(done) - len(sglang_checks)} config(s) did not compile"
            if len(done) + len(sglang_checks) < len(res["checks"])
            else ""
        )
        + ".",
        "",
        *_sglang_check_lines(sglang_checks),
        "Tuned prefix-kernel configs: " + ", ".join(f"{k}: {v}" for k, v in res["tuned"].items()),
        "",
    ]
    for heads in sorted({r["heads"] for r in res["rows"]}):
        out += [
            f"## {heads} heads per GPU" + (" (TP-8 shard)" if heads == 8 else " (all heads on one GPU)"),
            "",
        ]
        rows = [
            [r["budget"], r["bs"], r["prefix"], r["split_ms"], r["prefix_ms"], r.get("tail_ms", "-"), r["merge_ms"],
             r["naive_ms"] if r["naive_ms"] else "-", f"{r['speedup_vs_naive']:.1f}x" if r["speedup_vs_naive"] else "-",
             f"{100 * r['prefix_bw_frac']:.0f}%", f"{100 * r['prefix_mm_frac']:.0f}%", r["prefix_bound"],
             f"{100 * r['prefix_roofline_frac']:.0f}%"]
            + ([r["sglang_ms"], f"{r['sglang_ms'] / r['split_ms']:.1f}x"] if "sglang_ms" in r else [])
            for r in res["rows"] if r["heads"] == heads
        ]  # fmt: skip
        sglang_cols = ["SGLang ms", "split vs SGLang"] if any("sglang_ms" in r for r in res["rows"]) else []
        out.append(md_table(
            ["budget", "bs", "prefix", "split ms", "prefix ms", "tail ms", "merge ms", "naive ms", "split speedup",
             "prefix of copy BW", "prefix of mm rate", "prefix bound", "prefix of roofline", *sglang_cols], rows))  # fmt: skip
        out.append("")
    out += config_lines(res["rows"])
    probe = [r for r in res["rows"] if "prefix_contig_ms" in r]
    if probe:
        header = [
            "budget",
            "bs",
            "prefix",
            "prefix ms (gather)",
            "of copy BW",
            "prefix ms (consecutive)",
            "of copy BW",
        ]
        table = [
            [r["budget"], r["bs"], r["prefix"], r["prefix_ms"], f"{100 * r['prefix_bw_frac']:.0f}%",
             r["prefix_contig_ms"], f"{100 * r['prefix_contig_bw_frac']:.0f}%"]
            for r in probe
        ]  # fmt: skip
        out += [
            "## What bounds the memory-bound prefix pass: gather vs consecutive slots (8 heads)",
            "",
            md_table(header, table),
            "",
        ]
    return "\n".join(out + drafter_markdown(res.get("drafter_rows") or []))


def plot(res: dict, path) -> object:
    """Prefix pass against its roofline (copy bandwidth or bf16 matmul rate, whichever binds)."""
    from lab.bench._stamp import plot_lines

    series = {}
    for r in res["rows"]:
        if r["bs"] != 16 and not (r["heads"] == 64 and r["bs"] == 4):
            continue
        key = f"H={r['heads']} bs={r['bs']} budget {r['budget']} ({r['prefix_bound']})"
        xs, ys = series.setdefault(key, ([], []))
        xs.append(r["prefix"])
        ys.append(100 * r["prefix_roofline_frac"])
    return plot_lines(
        path,
        series,
        title=f"Tree-verify prefix pass, % of its roofline floor ({res['stamp'].get('device')})",
        xlabel="prefix length",
        ylabel="% of roofline (max of bytes/copy BW, FLOP/matmul rate)",
        hlines={"70%": 70.0},
    )


def main(argv: Sequence[str] | None = None) -> int:
    from lab.bench import _stamp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="mla_tree_attention")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument(
        "--max-flops", type=float, default=2e12, help="skip shapes whose prefix pass exceeds this"
    )
    ap.add_argument("--max-naive-elems", type=float, default=1.1e9, help="skip naive above this score count")
    ap.add_argument("--check-all-configs", action="store_true")
    ap.add_argument(
        "--configs", nargs="+", default=[], choices=[c.label() for c in CANDIDATE_CONFIGS], metavar="LABEL",
        help="also time the prefix pass under each of these configs in every row (e.g. M64N64w8s2 M32N64w4s2)",
    )  # fmt: skip
    ap.add_argument(
        "--sglang", action="store_true", help="also check and time SGLang's own target-verify kernel"
    )
    ap.add_argument(
        "--drafter-shape", type=int, nargs=4, metavar=("BLOCK", "HEADS", "KV_HEADS", "HEAD_DIM"),
        help="also time SGLang's verify-mode attention at a DFlash drafter's shape (e.g. 8 8 1 128)",
    )  # fmt: skip
    args = ap.parse_args(argv)

    st = _stamp.stamp()
    copy_gbs = _stamp.copy_bandwidth_gbs()
    mm = _stamp.matmul_tflops()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"[mla] {st.get('device')}: copy {copy_gbs:.0f} GB/s, matmul {mm:.0f} TFLOP/s", flush=True)
    res = {"stamp": st, "copy_gbs": copy_gbs, "matmul_tflops": mm, "args": vars(args)}
    out_dir = _stamp.results_dir(args.out)
    run_sweep(
        args,
        copy_gbs,
        mm,
        sms,
        into=res,
        on_row=lambda: _stamp.write_json(out_dir / f"{args.name}.json", res),
    )
    if args.drafter_shape:
        res["drafter_rows"] = drafter_sweep(args.drafter_shape, args.bs, args.prefix, copy_gbs, _time)
    paths = _stamp.write_outputs(out_dir, args.name, res, render_markdown(res))
    png = plot(res, out_dir / f"{args.name}.png")
    print("[mla] wrote", [str(p) for p in paths + ([png] if png else [])], flush=True)
    return 0 if all(c["ok"] is not False for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
