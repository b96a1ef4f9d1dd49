"""Which DDTree budget to verify: the one that maximises accepted tokens per unit of verify time.

A verify step of ``streams`` requests with ``budget`` drafted tree nodes each runs one target
forward over ``M = streams * (budget + 1)`` tokens and costs ``cost(M)`` (a measured curve,
e.g. from ``python -m lab.bench.moe_verify``) plus whatever the step costs besides.
Each stream then commits ``tau(budget)`` tokens on average: the accepted drafted tokens plus
the bonus token.  For a DDTree built best-first from the drafter's node probabilities,
``tau(b) = 1 + sum of the b largest path probabilities``: a node is accepted exactly when the
target agrees with its whole path, and the b most probable nodes always form a tree (a child's
path probability never exceeds its parent's).

The step throughput is ``streams * tau(b) / step_ms(streams, b)``; ``best_budget`` returns the
budget that maximises it.  Everything here is pure Python (no torch, no GPU).

    python -m lab.budget_model --moe-json results/kimi-k2.6_h200_moe_verify.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONCURRENCIES = (1, 4, 16, 64)


# =========================================================================== inputs


@dataclass(frozen=True)
class CostCurve:
    """Verify time (ms) per target forward as a function of M tokens per forward.

    Piecewise linear in log2(M) between measured points; flat below the first point (a
    forward never costs less than the smallest measured one); linear in M beyond the last
    point, with the slope of the last segment (the compute-bound regime).
    """

    ms: tuple[int, ...]
    cost_ms: tuple[float, ...]

    def __post_init__(self):
        if len(self.ms) != len(self.cost_ms) or len(self.ms) < 2:
            raise ValueError("need at least two (M, cost) points of equal count")
        if any(b <= a for a, b in zip(self.ms, self.ms[1:])) or self.ms[0] < 1:
            raise ValueError("M must be positive and strictly increasing")
        if any(not (c > 0 and math.isfinite(c)) for c in self.cost_ms):
            raise ValueError("costs must be positive and finite")

    @classmethod
    def from_points(cls, points: dict[int, float] | Sequence[tuple[int, float]]) -> CostCurve:
        items = sorted(points.items() if isinstance(points, dict) else points)
        return cls(tuple(int(m) for m, _ in items), tuple(float(c) for _, c in items))

    def __call__(self, m: float) -> float:
        ms, cs = self.ms, self.cost_ms
        if m <= ms[0]:
            return cs[0]
        if m >= ms[-1]:
            slope = max(0.0, (cs[-1] - cs[-2]) / (ms[-1] - ms[-2]))
            return cs[-1] + slope * (m - ms[-1])
        i = bisect.bisect_right(ms, m)
        x0, x1 = math.log2(ms[i - 1]), math.log2(ms[i])
        f = (math.log2(m) - x0) / (x1 - x0)
        return cs[i - 1] + f * (cs[i] - cs[i - 1])

    def scaled(self, factor: float, add_ms: float = 0.0) -> CostCurve:
        """``factor * cost(M) + add_ms`` on the same points (e.g. x layers, + fixed work)."""
        return CostCurve(self.ms, tuple(factor * c + add_ms for c in self.cost_ms))

    @staticmethod
    def sum(curves: Sequence[tuple[CostCurve, float]]) -> CostCurve:
        """Weighted sum of curves, evaluated on the union of their points."""
        ms = sorted({m for c, _ in curves for m in c.ms})
        return CostCurve(tuple(ms), tuple(sum(w * c(m) for c, w in curves) for m in ms))


def acceptance_from_node_probs(node_probs: Sequence[float]) -> list[float]:
    """tau[b] for b = 0..n: expected tokens committed per step with the b most probable nodes."""
    probs = sorted((float(p) for p in node_probs), reverse=True)
    if any(not (0.0 <= p <= 1.0) for p in probs):
        raise ValueError("node (path) probabilities must lie in [0, 1]")
    tau = [1.0]
    for p in probs:
        tau.append(tau[-1] + p)
    return tau


def synthetic_node_probs(
    top1: float = 0.878, depth: int = 7, sibling_decay: float = 0.5, width: int = 6, n_nodes: int = 512
) -> list[float]:
    """Path probabilities of a labelled synthetic drafter, for when no measured curve is given.

    At every depth the target's next token is the drafter's k-th candidate with probability
    ``q_1 = top1`` and ``q_k = (1 - top1) (1 - d) d^(k - 2)`` (k = 2..width, d = sibling_decay),
    independently across depths, up to ``depth`` (the drafter's block minus its anchor).  A
    node's path probability is the product along its path.  The default top1 = 0.878 makes a
    7-token chain accept 5.3 tokens per step (bonus included): the published accept length
    of the Kimi-K2.5 DFlash drafter (block 8) on GSM8K/Math500/HumanEval.
    """
    if not (0 < top1 < 1 and 0 <= sibling_decay < 1 and depth >= 1 and width >= 1):
        raise ValueError("bad synthetic drafter parameters")
    q = [top1] + [(1 - top1) * (1 - sibling_decay) * sibling_decay**k for k in range(width - 1)]
    frontier, out = [1.0], []
    for _ in range(depth):
        children = sorted((p * qk for p in frontier for qk in q), reverse=True)[:n_nodes]
        out.extend(children)
        frontier = children
    return sorted(out, reverse=True)[:n_nodes]


# =========================================================================== the choice


@dataclass
class BudgetChoice:
    budget: int
    streams: int
    tokens_per_forward: int
    step_ms: float
    tau: float  # tokens committed per stream per step
    tokens_per_ms: float  # all streams
    per_stream_tokens_per_s: float
    table: list[dict] = field(default_factory=list, repr=False)


def best_budget(
    cost: Callable[[float], float],
    acceptance: Sequence[float] | Callable[[int], float],
    streams: int,
    budgets: Sequence[int] | None = None,
    step_overhead_ms: float = 0.0,
    extra_cost: Callable[[int, int], float] | None = None,
) -> BudgetChoice:
    """The budget maximising ``streams * tau(b) / (cost(streams (b + 1)) + overhead + extra(streams, b))``.

    cost: verify time (ms) of one forward over M tokens (e.g. a ``CostCurve``).
    acceptance: ``tau[b]``, expected tokens committed per stream per step for budget b
        (``acceptance_from_node_probs`` turns node probabilities into this), or a callable.
    streams: requests verified together (the batch).
    step_overhead_ms: per-step cost independent of M (drafter, sampling, scheduling).
    extra_cost: per-step cost depending on (streams, budget) beyond ``cost(M)``, e.g. attention.
    Ties go to the smaller budget.
    """
    if streams < 1:
        raise ValueError("streams must be >= 1")
    if callable(acceptance):
        tau_of = acceptance
        if budgets is None:
            raise ValueError("budgets are required with a callable acceptance")
    else:
        tau_list = list(acceptance)
        if not tau_list:
            raise ValueError("empty acceptance curve")
        tau_of = tau_list.__getitem__
        budgets = range(len(tau_list)) if budgets is None else budgets
        if max(budgets) >= len(tau_list):
            raise ValueError("a budget lies beyond the acceptance curve")
    table, best = [], None
    for b in sorted(set(int(x) for x in budgets)):
        if b < 0:
            raise ValueError("budgets must be >= 0")
        m = streams * (b + 1)
        t = cost(m) + step_overhead_ms + (extra_cost(streams, b) if extra_cost else 0.0)
        tau = float(tau_of(b))
        row = {"budget": b, "M": m, "step_ms": t, "tau": tau, "tokens_per_ms": streams * tau / t}
        table.append(row)
        if best is None or row["tokens_per_ms"] > best["tokens_per_ms"] * (1 + 1e-12):
            best = row
    return BudgetChoice(
        budget=best["budget"],
        streams=streams,
        tokens_per_forward=best["M"],
        step_ms=best["step_ms"],
        tau=best["tau"],
        tokens_per_ms=best["tokens_per_ms"],
        per_stream_tokens_per_s=1e3 * best["tau"] / best["step_ms"],
        table=table,
    )


def recommend(cost, acceptance, concurrencies: Sequence[int] = CONCURRENCIES, **kw) -> list[BudgetChoice]:
    """``best_budget`` at each concurrency (every active request is one verify stream)."""
    return [best_budget(cost, acceptance, c, **kw) for c in concurrencies]


# =========================================================================== whole-step cost from bench JSON


def allreduce_ms(nbytes: float, n_gpus: int = 8, bus_gbs: float = 370.0, latency_us: float = 15.0) -> float:
    """NCCL ring all-reduce model: ``alpha + 2 (n - 1) / n * bytes / busBW`` (ms).

    busBW 370 GB/s: NCCL's app-level NVLink4 bandwidth on 8x H100/H200 without NVLink SHARP
    (NVIDIA/nccl issues #1442, #1455); NVLS, which reaches ~475-480 GB/s, is off on our hosts.
    alpha: small-message latency, an assumption (LL protocol, CUDA graphs) to replace with a
    measurement from ``python -m lab.bench.moe_tp_allreduce``.
    """
    if n_gpus <= 1:
        return 0.0
    return latency_us / 1e3 + 2 * (n_gpus - 1) / n_gpus * nbytes / (bus_gbs * 1e9) * 1e3


def layer_cost_from_moe_json(
    res: dict,
    tp: int = 8,
    moe_layers: int = 60,
    dense_layers: int = 1,
    hidden: int = 7168,
    allreduce: Callable[[float], float] | None = None,
) -> CostCurve:
    """Verify cost of the MLP side of the whole model per forward, from moe_verify's JSON.

    Per MoE layer: router (replicated) + routed experts (shard FFN 2048/tp, with top-k
    combine) + shared expert (shard) + one all-reduce of [M, hidden] bf16; per dense layer:
    dense MLP shard + one all-reduce.  CUDA-graph timings.  Attention, its projections and
    its all-reduce are not in this curve (pass them as ``extra_cost``).
    """
    ffn = 2048 // tp
    moe = res["moe"][f"ffn{ffn}"]["rows"]
    shared = res["dense"][f"shared_ffn{ffn}"]["rows"]
    dense = res["dense"][f"dense_ffn{18432 // tp}"]["rows"]
    ar = allreduce or (lambda nbytes: allreduce_ms(nbytes, n_gpus=tp))
    pts = {}
    for r, s, d in zip(moe, shared, dense):
        m = r["M"]
        comm = ar(m * hidden * 2) if tp > 1 else 0.0
        per_moe = r["router_graph"] + r["core_combine_graph"] + s["graph"] + comm
        per_dense = d["graph"] + comm
        pts[m] = moe_layers * per_moe + dense_layers * per_dense
    return CostCurve.from_points(pts)


def attention_cost_from_mla_json(
    res: dict, heads: int, prefix: int, layers: int = 61
) -> Callable[[int, int], float]:
    """(streams, budget) -> ms of tree-verify attention over all layers, from the MLA JSON.

    Uses the split kernel's time at the measured prefix closest to ``prefix``, linear in
    batch size and in tree width between the measured points (and beyond, from the last two).
    """
    rows = [r for r in res["rows"] if r["heads"] == heads]
    if not rows:
        raise ValueError(f"no attention rows for {heads} heads")
    L = min({r["prefix"] for r in rows}, key=lambda x: abs(x - prefix))
    rows = [r for r in rows if r["prefix"] == L]
    per_tok = {}  # (bs, W) -> ms; attention time is close to linear in both at fixed prefix
    for r in rows:
        per_tok[(r["bs"], r["n_nodes"])] = r["split_ms"]

    def lin(xs: list[float], ys: list[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        i = max(1, min(len(xs) - 1, bisect.bisect_left(xs, x)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def cost(streams: int, budget: int) -> float:
        w = budget + 1
        by_w = {}
        for (bs, n), t in per_tok.items():
            by_w.setdefault(n, {})[bs] = t
        ws = sorted(by_w)
        at_w = []
        for n in ws:
            bss = sorted(by_w[n])
            at_w.append(lin([float(b) for b in bss], [by_w[n][b] for b in bss], float(streams)))
        return layers * lin([float(n) for n in ws], at_w, float(w))

    cost.prefix_used = L  # type: ignore[attr-defined]
    return cost


# =========================================================================== report / CLI


def render(choices: Sequence[BudgetChoice], title: str, notes: Sequence[str] = ()) -> str:
    lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + [""]
    lines += [
        "| concurrency (streams) | best budget | M = streams x (budget+1) | step ms | tokens/step/stream | "
        "tokens/s all streams | tokens/s per stream |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in choices:
        lines.append(
            f"| {c.streams} | {c.budget} | {c.tokens_per_forward} | {c.step_ms:.2f} | {c.tau:.2f} | "
            f"{1e3 * c.tokens_per_ms:.0f} | {c.per_stream_tokens_per_s:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(choices: Sequence[BudgetChoice], path: Path, title: str) -> Path | None:
    """Throughput vs budget, one line per stream count, best budget marked (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for c in choices:
        xs = [r["budget"] for r in c.table]
        ys = [1e3 * r["tokens_per_ms"] for r in c.table]
        (line,) = ax.plot(xs, ys, lw=1.2, label=f"{c.streams} streams (best budget {c.budget})")
        ax.plot([c.budget], [1e3 * c.tokens_per_ms], "o", color=line.get_color())
    ax.set_xscale("symlog", linthresh=8)
    ax.set_yscale("log")
    ax.set_xlabel("budget (drafted tree nodes per stream)")
    ax.set_ylabel("committed tokens / s, all streams")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Budget that maximises accepted tokens per unit verify time")
    ap.add_argument("--moe-json", default="results/kimi-k2.6_h200_moe_verify.json")
    ap.add_argument("--mla-json", default=None, help="add tree-verify attention from this JSON")
    ap.add_argument("--prefix", type=int, default=4096, help="prefix length for the attention term")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--overhead-ms", type=float, default=0.0, help="per-step cost besides the target forward")
    ap.add_argument("--node-probs", default=None, help="JSON list of node path probabilities")
    ap.add_argument("--top1", type=float, default=0.878, help="synthetic drafter: top-1 acceptance per depth")
    ap.add_argument("--depth", type=int, default=7, help="synthetic drafter: maximum depth")
    ap.add_argument("--max-budget", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    ap.add_argument("--png", action="store_true", help="with --out: also <out>.png (throughput vs budget)")
    args = ap.parse_args(argv)

    res = json.loads(Path(args.moe_json).read_text())
    cost = layer_cost_from_moe_json(res, tp=args.tp)
    if args.node_probs:
        probs = json.loads(Path(args.node_probs).read_text())
        src = f"node probabilities from {args.node_probs}"
    else:
        probs = synthetic_node_probs(args.top1, args.depth, n_nodes=args.max_budget)
        src = f"synthetic drafter (top-1 {args.top1}, depth {args.depth}; chain of {args.depth} accepts " + (
            f"{acceptance_from_node_probs([args.top1**d for d in range(1, args.depth + 1)])[-1]:.2f})"
        )
    tau = acceptance_from_node_probs(probs)[: args.max_budget + 1]
    extra, notes = None, []
    if args.mla_json:
        extra = attention_cost_from_mla_json(
            json.loads(Path(args.mla_json).read_text()), 8 if args.tp == 8 else 64, args.prefix
        )
        notes.append(f"attention: split tree-verify kernel at prefix {extra.prefix_used}, 61 layers")
    choices = recommend(cost, tau, args.concurrency, step_overhead_ms=args.overhead_ms, extra_cost=extra)
    notes = [
        f"verify cost: MLP side of all layers at TP-{args.tp} from {args.moe_json} "
        "(router + routed shard + shared shard + all-reduce model, 60 MoE + 1 dense layers, CUDA graphs)",
        f"acceptance: {src}",
        f"per-step overhead {args.overhead_ms} ms",
    ] + notes
    md = render(choices, "Budget model: best budget per concurrency", notes)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(
            json.dumps({"notes": notes, "choices": [asdict(c) for c in choices], "tau": tau}, indent=1) + "\n"
        )
        out.with_suffix(".md").write_text(md)
        if args.png:
            plot(choices, out.with_suffix(".png"), "; ".join(notes[1:2] + notes[3:]) or "budget model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
