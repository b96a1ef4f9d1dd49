"""The online budget's choices on a modelled server: what its policy (probes, narrower widths,
width 1) gives up against fixed widths, with no GPU and no host noise.

    python -m lab.bench.online_budget_sim --model pair       # or k26-rank, k26-rank-code
    # -> results/<model>_<device>_online_budget_sim.{json,md} (the pair: pycode-4l)
    python -m lab.bench.online_budget_sim --model pair --trace results/pycode-4l_cpu_trace.json.gz
    # -> results/pycode-4l_<device>_online_budget_sim_trace.{json,md}: the pair's real draws

The served benchmark on the H200 (the A/B tool, ``python -m sglang_ddtree.ab``) cannot resolve
5% on the trained pair (its passes spread 1.15-2.75x, ``sglang_ddtree/ab/paired.py``). This runs the real
:class:`~sglang_ddtree.adapter.widths.StepWidths` (the timed cost table, the chooser, the
calibration, the probes) on a clock of its own, against a model of a pair's rounds:

* a round costs ``rest(bs, kind) + verify(bs, width)`` ms. ``pair``, the trained pair (bound
  by the host): ~4.3 ms of host work a tree round, 1 ms less for width 1 without the drafter
  (the rows its server priced at 6125f69), plus a fit of its start-up replays. ``k26-rank``,
  one TP-8 rank of Kimi K2.6 (bound by the device): its start-up replays at f9eaf01, plus ~1 ms
  a tree round and ~0.3 ms a width-1 round (what that server priced over them).
  ``k26-rank-code``, the same rank as K2.6 call 7 served it: that call's start-up replays (bs 1-64),
  the ``dflash-k25-code`` replay profile (every round the same log-probs, the chain accepting 5.4),
  outputs of 32-64 tokens. The replays are also the table's start-up costs;
* every request drafts from a context of its own (a drafter whose top token takes 0.5-0.85 of
  the mass on the pair, 0.35-0.7 on the rank, drawn per request; the profile's on
  ``k26-rank-code``), and accepts what the tree
  the step ran reaches, drawn from the same per-depth reach the prediction computes (the
  prediction is right: the calibration has nothing to correct). With ``--trace``, every request
  replays one continuation of a trace of a real drafter's draws instead: each step drafts the
  recorded log-probs at its offset (they vary from step to step, as served) and accepts what the
  recorded true tokens reach in the best-first tree of its width (the prediction is as right as
  that drafter's probabilities; the calibration corrects what it can). Its lengths are the
  trace's continuations;
* a closed loop of ``c`` requests in flight, as the A/B tool runs a level: each pass
  serves ``max(8, 2c)`` requests of 256 tokens +-50%; each admitted request's prefill is
  another batch between two steps (``interrupt``) that costs ``PREFILL_MS``.

Every arm serves the same requests and contexts; the fixed arms run one width at every step.
What this cannot show: what the online budget's own host work costs a server (its time here is
from warm caches, on the benchmark's host, with no device events: ``online_budget_host --cold``
and a served ``+phases`` arm say that), and any cost the model leaves out (the overlap scheduler;
on a MoE, served tokens that route otherwise than the replays' spread ids).

How its host work grows with load, though, shows here: the auto arm's ``start`` is timed on the
host's clock per step, and the steps that made a decision anew (not the last step's kept
width: :attr:`StepWidths.decided_anew`) are counted. Under load the batch's size changes at most
steps and walks through many rows of the table, whose cells are still unsettled, so every
verify is timed and moves a median, and the probe check and the choice are made again: on the
H100 the served `width choice` grew from 54 us at c=1 to 200-230 at c=32-64
(``results/pycode-4l_h100_budget_ab.md``), and here ``start``'s mean grows likewise while its
median stays.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lab.bench import _stamp
from lab.bench.draw_trace import FORMAT as TRACE_FORMAT
from lab.bench.draw_trace import read_json
from lab.bench.online_budget_host import GRAPH_BATCH_SIZES
from lab.bench.output_lens import output_lens
from lab.bench.replay_profiles import LOG_FLOOR
from lab.bench.trace_replay import resolve_offsets
from sglang_ddtree.adapter.widths import StepWidths
from sglang_ddtree.budget import TimedCostTable, candidate_widths
from sglang_ddtree.tree.accept import accept_walk_ref
from sglang_ddtree.tree.build import TopK, build_tree_from_topk
from sglang_ddtree.tree.expected_accept import reach_at_widths, reach_by_depth

DEPTH, TOP_K = 7, 64
PREFILL_MS = 8.0
STALL_MS = 5.0


@dataclass(frozen=True)
class Model:
    """A served pair's rounds, and its drafter's confidence."""

    name: str
    batch_sizes: tuple[int, ...]  # the captured graph sizes: the timed table's rows
    verify_ms: Callable[[int, int], float]  # (bs, width) -> the verify's device time
    rest_ms: Callable[[int, bool], float]  # (bs, drafted) -> the rest of the round
    top_logit: tuple[float, float]  # the range of a request's top-token logit over 63 N(0, 1)
    budget: int  # the auto arm's largest budget
    fixed: tuple[str, ...]  # the fixed budgets beside it
    concurrency: tuple[int, ...]
    profile: str | None = None  # a replay profile: every request drafts its log-probs (not top_logit's)
    output_len: int = 256  # each request's tokens: drawn from [output_len / 2, output_len * 1.5]
    range_ratio: float = 0.5


def pair_verify_ms(bs: int, width: int) -> float:
    """A fit of the trained pair's start-up replays at 6125f69."""
    if width == 1:
        return 0.13 + 0.0005 * bs
    return 0.29 + 0.001 * bs + 0.0000535 * bs * width


def pair_rest_ms(bs: int, drafted: bool) -> float:
    """The host's share of a tree round (the rows 6125f69's server priced); width 1 skips the drafter."""
    return 4.3 + 0.01 * bs - (0.0 if drafted else 1.0)


# The K2.6 rank's start-up replays at f9eaf01 (bs -> ms at widths 1, 2, 4, 8; auto7's log).
RANK_REPLAYS = {
    1: (6.777, 8.182, 8.362, 8.832), 2: (6.87, 8.338, 8.724, 10.05), 3: (6.904, 8.661, 9.694, 11.087),
    4: (7.211, 8.916, 10.278, 11.917), 5: (7.506, 9.701, 10.831, 12.463), 6: (7.52, 9.804, 10.842, 13.222),
    7: (7.63, 9.919, 11.31, 13.32), 8: (7.487, 10.04, 11.369, 13.925), 10: (8.308, 10.652, 12.05, 15.03),
    12: (8.406, 10.709, 12.745, 15.994), 14: (8.52, 11.123, 12.801, 16.882), 16: (8.588, 11.181, 13.455, 18.146),
    18: (9.322, 12.032, 14.5, 19.944), 20: (9.412, 12.148, 14.977, 21.076), 22: (9.225, 12.39, 15.191, 21.633),
    24: (9.423, 12.799, 15.933, 22.889), 26: (9.809, 12.92, 16.443, 24.154), 28: (9.838, 13.01, 16.831, 25.424),
    30: (9.844, 13.643, 17.783, 26.304), 32: (9.893, 13.717, 18.17, 27.438),
}  # fmt: skip


def replay_ms(replays: dict, bs: int, width: int) -> float:
    """The replay of the graph a batch of ``bs`` runs in (the smallest captured size holding it)."""
    row = min(size for size in replays if size >= bs)
    return replays[row][(1, 2, 4, 8).index(width)]


rank_verify_ms = functools.partial(replay_ms, RANK_REPLAYS)


# The same rank's start-up replays in K2.6 call 7 (ddtree@auto7's log, results/k26-rank_h200_ab_logs.tar.xz),
# up to bs 64: the call whose online budget lost 6% to the chain at c=32.
CALL7_REPLAYS = {
    1: (6.731, 8.194, 8.413, 8.855), 2: (6.833, 8.394, 8.772, 10.091), 3: (6.949, 8.719, 9.717, 11.07),
    4: (7.199, 8.937, 10.291, 11.863), 5: (7.517, 9.727, 10.812, 12.4), 6: (7.526, 9.78, 10.835, 13.186),
    7: (7.617, 9.947, 11.292, 13.254), 8: (7.473, 10.073, 11.341, 13.866), 10: (8.255, 10.658, 12.009, 14.923),
    12: (8.365, 10.716, 12.754, 15.998), 14: (8.486, 11.123, 12.783, 16.855), 16: (8.598, 11.176, 13.423, 18.157),
    18: (9.314, 12.079, 14.5, 19.953), 20: (9.338, 12.166, 14.936, 21.029), 22: (9.153, 12.413, 15.194, 21.671),
    24: (9.383, 12.829, 15.907, 22.901), 26: (9.787, 12.931, 16.402, 24.183), 28: (9.814, 12.971, 16.813, 25.389),
    30: (9.812, 13.579, 17.774, 26.298), 32: (9.845, 13.641, 18.142, 27.42), 40: (10.451, 14.982, 20.92, 32.708),
    44: (10.968, 15.639, 21.978, 27.4), 48: (11.175, 16.198, 23.082, 28.848), 52: (11.204, 16.781, 24.41, 31.914),
    56: (11.21, 17.309, 25.595, 33.748), 60: (11.784, 18.318, 26.723, 33.908), 64: (11.818, 18.953, 27.885, 36.001),
}  # fmt: skip


call7_verify_ms = functools.partial(replay_ms, CALL7_REPLAYS)


def rank_rest_ms(bs: int, drafted: bool) -> float:
    """What f9eaf01's server priced over the replays: ~1 ms a tree round (the drafter, the host
    between rounds), ~0.3 ms a width-1 round."""
    return 1.0 if drafted else 0.3


MODELS = {
    "pair": Model("pair", GRAPH_BATCH_SIZES, pair_verify_ms, pair_rest_ms, (4.2, 6.6), 64, ("16", "32", "64"),
                  (1, 4, 8, 16, 32, 64)),
    # the drafter less sure (top token ~0.35-0.7: 2.4-2.7 tokens a round, as pycode-4l-ranks)
    "k26-rank": Model("k26-rank", tuple(RANK_REPLAYS), rank_verify_ms, rank_rest_ms, (4.0, 5.6), 7, ("1", "3", "7"),
                      (1, 4, 8, 16, 32)),
    # K2.6 call 7 as served: its replays, the dflash-k25-code profile (the chain accepts 5.4), 64-token
    # outputs from [32, 64] (range 0.5 of 64, as the A/B tool draws them)
    "k26-rank-code": Model("k26-rank-code", tuple(CALL7_REPLAYS), call7_verify_ms, rank_rest_ms, (0.0, 0.0), 7,
                           ("1", "3", "7"), (1, 8, 32, 64), profile="dflash-k25-code", output_len=48,
                           range_ratio=1 / 3),
}  # fmt: skip


def round_ms(model: Model, bs: int, width: int, drafted: bool) -> tuple[float, float]:
    """(the rest of the round, its verify) in ms."""
    return model.rest_ms(bs, drafted), model.verify_ms(bs, width)


@dataclass
class Request:
    """A request of a modelled drafter: the same proposal at every step, and what a step
    accepts drawn from the reach that proposal predicts (the prediction is right)."""

    length: int
    log_probs: torch.Tensor  # [depth, k] its drafter's proposals (one context a request)
    reach: np.ndarray  # [widest, depth]: row w - 1, P(accepted >= d) at the tree of verify width w
    made: int = 0

    def proposal(self) -> torch.Tensor:
        return self.log_probs

    def accepted(self, width: int, draw: float, chain: bool = False) -> int:
        """Drafts accepted from the step's tree of ``width - 1`` nodes (``chain``: the
        drafter's top-1 at every depth instead)."""
        reach = torch.exp(torch.cumsum(self.log_probs[:, 0], 0)).numpy() if chain else self.reach[width - 1]
        return int((reach > draw).sum())


@dataclass
class TraceRequest:
    """A request replaying one continuation of a trace of real draws: each step drafts the
    trace's log-probs at the request's offset, and accepts what the recorded true tokens reach
    in the tree of the step's width (so the prediction is as right as the real drafter's)."""

    length: int
    draws: TraceDraws
    row: int  # the trace request it replays
    made: int = 0

    def proposal(self) -> torch.Tensor:
        return self.draws.log_probs(self.row, self.made)

    def accepted(self, width: int, draw: float, chain: bool = False) -> int:
        return self.draws.accepted(self.row, self.made, 0 if chain else width)


class TraceDraws:
    """A trace (``lab.bench.draw_trace``) read as the served replay reads it
    (``lab.bench.trace_replay``): an offset without a record of its own takes the nearest earlier
    record, its depths shifted, the depths past the record not proposed."""

    def __init__(self, trace: dict):
        if trace.get("format") != TRACE_FORMAT:
            raise ValueError(f"not a {TRACE_FORMAT} trace: {trace.get('format')!r}")
        if int(trace["depth"]) != DEPTH:  # a narrower top-k is padded with the floor, as served
            raise ValueError(f"the trace drafts {trace['depth']} depths, not {DEPTH}")
        self.requests = [self._read(request) for request in trace["requests"]]
        self._ranks = np.tile(np.arange(TOP_K, dtype=np.int64), (DEPTH, 1))  # a node's token: its rank
        self._read_draws: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._accepted: dict[tuple[int, int, int], int] = {}

    @staticmethod
    def _read(request: dict) -> dict:
        records = len(request["offsets"])
        logp = np.full((records, DEPTH, TOP_K), LOG_FLOOR, dtype=np.float32)
        for index, per_depth in enumerate(request["logp"]):
            for depth, row in enumerate(per_depth):
                logp[index, depth, : min(len(row), TOP_K)] = row[:TOP_K]
        at, shift = resolve_offsets(request["offsets"], request["length"])
        return {
            "length": request["length"],
            "logp": logp,
            "rank": np.asarray(request["rank"]),
            "at": at,
            "shift": shift,
        }

    def __len__(self) -> int:
        return len(self.requests)

    def length(self, row: int) -> int:
        return self.requests[row]["length"]

    def _draws(self, row: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """The log-probs ``[depth, k]`` and the true tokens' ranks ``[depth]`` (-1: not
        proposed) a step rooted at ``offset`` of trace request ``row`` drafts (read once: the
        step's proposal and its acceptance read the same)."""
        key = (row, offset)
        if key not in self._read_draws:
            self._read_draws[key] = self._resolve(self.requests[row], offset)
        return self._read_draws[key]

    @staticmethod
    def _resolve(request: dict, offset: int) -> tuple[np.ndarray, np.ndarray]:
        record = request["at"][offset] if offset < request["length"] else -1
        if record < 0:
            return np.full((DEPTH, TOP_K), LOG_FLOOR, dtype=np.float32), np.full(DEPTH, -1)
        depths = np.arange(DEPTH) + request["shift"][offset]
        inside, depths = depths < DEPTH, np.minimum(depths, DEPTH - 1)
        logp = np.where(inside[:, None], request["logp"][record, depths], LOG_FLOOR).astype(np.float32)
        ranks = np.where(inside, request["rank"][record, depths], -1)
        return logp, np.where(ranks < TOP_K, ranks, -1)

    def log_probs(self, row: int, offset: int) -> torch.Tensor:
        return torch.from_numpy(self._draws(row, offset)[0])

    def accepted(self, row: int, offset: int, width: int) -> int:
        """The drafts accepted from the best-first tree of ``width - 1`` nodes (0: the chain of
        top-1 picks): the reference accept walk along the true tokens (a DFlash drafter drafts
        each depth apart, so the true token below any node of depth ``d`` has rank ``ranks[d]``)."""
        logp, ranks = self._draws(row, offset)
        if not width:
            return int(np.cumprod(ranks == 0).sum())
        key = (row, offset, width)
        if key not in self._accepted:
            tree = build_tree_from_topk(TopK(logp, self._ranks), width - 1)
            tokens = np.concatenate([[-1], tree.node_tokens])  # a node's token is its rank
            truth = np.append(ranks, -1)[np.concatenate([[0], tree.depths])]  # below each node
            walk = accept_walk_ref(tokens[None], tree.parents[None], np.array([len(tokens)]), truth[None])
            self._accepted[key] = int(walk.accept_lens[0])
        return self._accepted[key]


def make_requests(n: int, widths, seed: int, model: Model, draws: TraceDraws | None = None) -> list:
    """``n`` requests of ``model``'s output lengths, each drafting from a context of its own (or
    all from ``model``'s replay profile); with ``draws``, ``n`` of the trace's continuations
    (the seed picks which, cycling)."""
    if draws is not None:
        rows = [(seed * n + i) % len(draws) for i in range(n)]
        # its prefill makes a continuation's first token (offset 0 roots the first step)
        return [TraceRequest(draws.length(row) - 1, draws, row) for row in rows]
    rng = torch.Generator().manual_seed(seed)
    confidence = random.Random(seed)
    profile = profile_log_probs(model.profile) if model.profile else None
    requests = []
    for length in output_lens(n, model.output_len, model.range_ratio, seed):
        log_probs = profile
        if log_probs is None:
            logits = torch.randn(DEPTH, TOP_K, generator=rng)
            logits[:, 0] += confidence.uniform(
                *model.top_logit
            )  # (4.2, 6.6): the top token's share ~0.5-0.85
            log_probs = torch.log_softmax(logits, -1).sort(-1, descending=True).values
        every_width = range(1, widths[-1] + 1)
        reach = reach_at_widths(reach_by_depth(log_probs[None], widths[-1] - 1), every_width).numpy()
        requests.append(Request(length, log_probs, reach))
    return requests


def profile_log_probs(name: str) -> torch.Tensor:
    """[depth, k] a replay profile's per-depth log-probs (every round the same, as the replay drafter)."""
    from lab.bench.replay_profiles import PROFILES

    probs = torch.tensor(PROFILES[name].probs, dtype=torch.float32)[:DEPTH, :TOP_K]
    return probs.clamp_min(1e-30).log()


@dataclass(frozen=True)
class Noise:
    """The host's unevenness: each round's rest times a lognormal factor (``jitter``, its
    sigma), and a share of rounds stalled by ``STALL_MS`` (a collection, a scheduler hiccup)."""

    jitter: float = 0.0
    stall_share: float = 0.0

    def apply(self, rest_ms: float, rng: np.random.Generator) -> float:
        if self.jitter:
            rest_ms *= float(np.exp(rng.normal(0.0, self.jitter)))
        if self.stall_share and rng.random() < self.stall_share:
            rest_ms += STALL_MS
        return rest_ms


class Clock:
    def __init__(self):
        self.s = 0.0

    def __call__(self) -> float:
        return self.s

    def advance(self, ms: float) -> None:
        self.s += ms / 1e3


def arm_width(arm: str) -> int | None:
    """The verify width an arm runs at every step (None: the online budget chooses)."""
    if arm == "auto":
        return None
    if arm == "plain":
        return 1
    if arm == "chain":
        return DEPTH + 1
    return int(arm) + 1  # DDTREE@B verifies B + 1 slots


class Server:
    """One arm: ``auto`` (the online budget's step loop), ``plain`` (width 1, never drafting),
    ``chain`` (the drafter's top-1 at every depth) or a budget ``B`` (DDTREE@B at every step)."""

    def __init__(self, model: Model, widths, arm: str, seed: int, noise: Noise | None = None):
        self.model, self.widths, self.arm, self.fixed = model, tuple(widths), arm, arm_width(arm)
        self.clock = Clock()
        self.accept_rng = np.random.default_rng(seed)
        self.noise = noise or Noise()
        self.noise_rng = np.random.default_rng(seed + 1)
        self.width_steps: dict[int, int] = {}
        self.start_s: list[float] = []  # auto: each step's ``start``, host seconds
        self.decided = 0  # auto: the steps whose decisions were made anew (not the last step's)
        self.steps = None
        if self.fixed is None:
            startup = [[model.verify_ms(bs, w) for w in widths] for bs in model.batch_sizes]
            table = TimedCostTable(model.batch_sizes, widths, startup)
            self.steps = StepWidths(widths, table, DEPTH, lambda w: w, clock=self.clock)
            self._propose = self.steps.watch(lambda hidden, k: (self._log_probs, None))
        self._log_probs = None

    def prefill(self) -> None:
        """A request's prefill: another batch between two decode steps."""
        if self.steps is not None:
            self.steps.interrupt(joined=1)
        self.clock.advance(PREFILL_MS)

    def _start(self, bs: int) -> int:
        """The online budget's width for this step, its host time and whether it decided anew."""
        began = time.perf_counter()
        width = self.steps.start(bs)
        self.start_s.append(time.perf_counter() - began)
        self.decided += self.steps.decided_anew
        return width

    def decode(self, running: list[Request]) -> int:
        """One decode step of the running requests: the tokens it commits."""
        bs = len(running)
        width = self.fixed if self.steps is None else self._start(bs)
        drafted = self.arm != "plain" if self.steps is None else not self.steps.skips_draft
        if self.steps is not None and drafted:
            self._log_probs = torch.cat([r.proposal() for r in running])
            self._propose(None, TOP_K)
        rest, verify = round_ms(self.model, bs, width, drafted)
        rest = self.noise.apply(rest, self.noise_rng)
        self.clock.advance(rest / 2)
        if self.steps is not None:
            self.steps.verify_started()
        self.clock.advance(verify)
        if self.steps is not None:
            self.steps.verify_finished()
        self.clock.advance(rest / 2)
        draws = self.accept_rng.random(bs)
        chain = self.arm == "chain"
        accepted = [r.accepted(width, u, chain) if drafted else 0 for r, u in zip(running, draws)]
        if self.steps is not None:
            self.steps.finish(torch.tensor(accepted))
        self.width_steps[width] = self.width_steps.get(width, 0) + 1
        made = 0
        for request, a in zip(running, accepted):
            step_tokens = min(a + 1, request.length - request.made)
            request.made += step_tokens
            made += step_tokens
        return made


def serve_pass(server: Server, requests: list[Request], concurrency: int) -> int:
    """A closed loop of ``concurrency`` requests in flight until every request has its tokens."""
    waiting, running, made = list(requests), [], 0
    while waiting or running:
        while waiting and len(running) < concurrency:
            running.append(waiting.pop(0))
            server.prefill()
        made += server.decode(running)
        running = [r for r in running if r.made < r.length]
    return made


def run_arm(model: Model, arm: str, concurrency: int, passes: int, seed: int, noise=None, draws=None) -> dict:
    """One arm over ``passes`` passes (the first a warm-up, as the served benchmark runs):
    its tokens per ms over the timed passes, and its steps per width in all (``draws``: the
    requests replay a trace's continuations)."""
    widths = candidate_widths(model.budget)
    server = Server(model, widths, arm, seed, noise)
    tokens = ms = 0.0
    for index in range(passes):
        requests = make_requests(max(8, 2 * concurrency), widths, seed + index, model, draws)
        began = server.clock.s
        made = serve_pass(server, requests, concurrency)
        if index:
            tokens, ms = tokens + made, ms + (server.clock.s - began) * 1e3
    result = {"tok_per_ms": tokens / ms, "width_steps": dict(sorted(server.width_steps.items()))}
    if server.steps is not None:
        result["probe_steps"] = int(server.steps.cost.probed_steps.sum())
        result["decided_steps"] = server.decided
        result["start_us"] = {  # the host's clock: not deterministic, unlike the rest
            "mean": statistics.mean(server.start_s) * 1e6,
            "median": statistics.median(server.start_s) * 1e6,
        }
    return result


def run(args) -> dict:
    model = MODELS[args.model]
    noise = Noise(args.rest_jitter, args.stall_share)
    fixed = args.fixed or ["plain", "chain", *model.fixed]
    concurrency = args.concurrency or list(model.concurrency)
    config = {**vars(args), "fixed": fixed, "concurrency": concurrency, "budget": model.budget}
    widths = candidate_widths(model.budget)
    trace = read_json(Path(args.trace)) if args.trace else None
    draws = TraceDraws(trace) if trace else None
    config["trace_pair"] = trace.get("source", {}).get("pair") if trace else None
    results = {"stamp": _stamp.stamp(), "config": config, "widths": list(widths), "levels": []}
    for c in concurrency:
        level = {"concurrency": c, "arms": {}}
        for arm in ["auto", *fixed]:
            level["arms"][arm] = run_arm(model, arm, c, args.passes, args.seed, noise, draws)
        best = max(fixed, key=lambda a: level["arms"][a]["tok_per_ms"])
        level["best_fixed"] = best
        level["auto_over_best"] = level["arms"]["auto"]["tok_per_ms"] / level["arms"][best]["tok_per_ms"]
        results["levels"].append(level)
        print(
            f"[online_budget_sim] {model.name} c={c}: auto / {arm_label(best)} {level['auto_over_best']:.3f}",
            flush=True,
        )
    return results


def arm_label(arm: str) -> str:
    return arm if arm in ("auto", "plain", "chain") else f"DDTREE@{arm}"


def to_markdown(results: dict) -> str:
    rows = []
    fixed = results["config"]["fixed"]
    for level in results["levels"]:
        auto = level["arms"]["auto"]
        steps = sum(auto["width_steps"].values())
        widest = auto["width_steps"].get(results["widths"][-1], 0)
        rows.append(
            [
                level["concurrency"],
                auto["tok_per_ms"],
                *(f"{auto['tok_per_ms'] / level['arms'][arm]['tok_per_ms']:.3f}" for arm in fixed),
                arm_label(level["best_fixed"]),
                f"{level['auto_over_best']:.3f}",
                f"{auto['probe_steps']} / {steps}",
                f"{auto['width_steps'].get(1, 0)} / {steps}",
                f"{widest} / {steps}",
                f"{auto['decided_steps']} / {steps}",
                f"{auto['start_us']['mean']:.1f} / {auto['start_us']['median']:.1f}",
            ]
        )
    config = results["config"]
    return "\n".join(
        [
            "# The online budget's policy on a modelled server (no GPU)",
            "",
            _stamp.stamp_markdown(results["stamp"]),
            "",
            f"`auto{config['budget']}` against {', '.join(map(arm_label, config['fixed']))} on the model of "
            f"`{config['model']}` (the module docstring)"
            + (
                f", every request replaying a continuation of `{config['trace']}`"
                if config.get("trace")
                else ""
            )
            + f": {config['passes'] - 1} timed passes after "
            "a warm-up per arm and concurrency, the same requests in every arm. Tokens per ms are the "
            "model's; a ratio is auto's tokens per ms over the arm's: what the policy (probes, "
            "narrower widths, width 1) gives up or gains. `decided anew`: auto's steps that made "
            "their probe check or choice again (not the last step's kept width); `start us`: the "
            "mean / median host time of auto's `start` on this host from warm caches (its growth "
            "with load, not what a server pays: the module docstring). "
            + (
                f"Each round's rest times a lognormal factor of sigma {config['rest_jitter']:g}; "
                f"{config['stall_share']:.0%} of rounds stalled {STALL_MS:g} ms."
                if config["rest_jitter"] or config["stall_share"]
                else "No noise: every round costs what the model says."
            ),
            "",
            _stamp.md_table(
                [
                    "conc",
                    "auto tok/ms",
                    *(f"auto / {arm_label(arm)}" for arm in fixed),
                    "best other",
                    "auto / best",
                    "probe steps",
                    "width 1",
                    "widest",
                    "decided anew",
                    "start us (mean / median)",
                ],
                rows,
            ),
        ]
    )


# the series a model's results belong to (results/README.md): the trained pair is pycode-4l
SERIES = {"pair": "pycode-4l"}


def series_name(args, device: str, trace_pair: str | None = None) -> str:
    """``<model>_<device>_online_budget_sim`` (``_trace``: on a trace's draws, ``_trace-<drafter>``
    on a trace of the pair served with another drafter; ``_noisy``: with noise): a re-run
    replaces its series."""
    other = (trace_pair or SERIES["pair"]).removeprefix(SERIES["pair"]).lstrip("-")
    trace = f"_trace{'-' + other if other else ''}" if args.trace else ""
    noisy = "_noisy" if args.rest_jitter or args.stall_share else ""
    return f"{SERIES.get(args.model, args.model)}_{device}_online_budget_sim{trace}{noisy}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", choices=sorted(MODELS), default="pair", help="whose rounds (the module docstring)"
    )
    p.add_argument(
        "--fixed",
        nargs="+",
        default=None,
        help="the arms beside auto: budgets, plain, chain (default: plain, chain and the model's budgets)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="(default: the model's)")
    p.add_argument("--passes", type=int, default=6, help="passes per arm and level, the first a warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rest-jitter", type=float, default=0.0, help="sigma of each round's lognormal rest factor"
    )
    p.add_argument("--stall-share", type=float, default=0.0, help=f"share of rounds stalled {STALL_MS:g} ms")
    p.add_argument(
        "--trace",
        default=None,
        help="a trace of real draws (lab.bench.draw_trace, e.g. results/pycode-4l_cpu_trace.json.gz): "
        "every request replays one of its continuations instead of the model's drafter",
    )
    p.add_argument("--out", default=None, help="results folder (default: results)")
    args = p.parse_args(argv)
    if args.passes < 2:
        p.error("--passes must be >= 2 (the first warms up)")
    results = run(args)
    name = series_name(args, _stamp.device_slug(results["stamp"]), results["config"]["trace_pair"])
    for path in _stamp.write_outputs(_stamp.results_dir(args.out), name, results, to_markdown(results)):
        print(path)
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
