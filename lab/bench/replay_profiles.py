"""Acceptance profiles for the replay drafter, and the rank replacement it applies.

A profile gives, per draft depth ``d`` (1..7 for a block of 8), the probability ``q_d(r)``
that the target's true next token is the drafter's rank-``r`` candidate (``r`` < 64; the rest
of the mass is "not proposed"). The replay drafter makes each depth's top-k a calibrated
drafter's: the log-probs it reports are ``log q_d(r)`` and the true token sits at a rank drawn
from ``q_d``, independently per request, depth and round. For such a drafter the best-first
tree of ``B`` nodes (DDTree's) accepts on average ``1 + the sum of its B largest path
probabilities`` (:func:`expected_accept_length`), and a top-1 chain
``1 + sum_d prod_{i<=d} q_i(0)`` - which is how the profiles below are pinned to measured or
published accept lengths.

Profiles (conditional top-1 acceptance ``a`` is solved from the chain accept length; the
tail - true token at ranks 1..63 - carries ``TAIL_SHARE`` of the remaining mass, geometric with
ratio ``TAIL_DECAY``: an assumption, as no per-rank histogram is published):

* ``pycode-4l``: the project's trained pair through the real server on the CPU
  (``results/pycode-4l_cpu_acceptance.md``: chain 2.34 tokens/round, tree-b64 3.33);
* ``dflash-k25-code``: z-lab/Kimi-K2.5-DFlash model card, accept length 5.3-5.5 on GSM8K,
  MATH-500 and HumanEval at block 8 (5.4 used);
* ``dflash-k25-chat``: the same card, 3.7 on MT-Bench.

and one measured per rank: ``pycode-4l-ranks``, the trained pair's own histogram of where the
target's greedy token sits in the drafter's ranking per depth (:mod:`.pair_rank_profile`,
``results/pycode-4l_cpu_rank_profile.md``). It predicts the pair's exact chain within
1% and its trees of 7-64 nodes within 2-5% (below), where ``pycode-4l``'s assumed tail gives a
tree of 7 nodes 2.39 tokens a round against the pair's 2.76.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

RANKS = 64
TAIL_SHARE = 0.5
TAIL_DECAY = 0.7
LOG_FLOOR = math.log(1e-30)


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    probs: tuple[tuple[float, ...], ...]  # [depth][rank], each row sums to <= 1, non-increasing

    @property
    def depth(self) -> int:
        return len(self.probs)


def geometric_profile(name: str, source: str, top1: list[float], tail_share=TAIL_SHARE, decay=TAIL_DECAY):
    """Per depth: ``top1[d]`` at rank 0, ``tail_share x (1 - top1[d])`` over ranks 1..63."""
    weights = [decay**r for r in range(RANKS - 1)]
    total = sum(weights)
    rows = []
    for a in top1:
        tail = [tail_share * (1.0 - a) * w / total for w in weights]
        if tail[0] > a:  # a top-k is sorted: rank 0 must be the most likely
            raise ValueError(f"profile {name}: rank 1 ({tail[0]:.3f}) above rank 0 ({a:.3f})")
        rows.append(tuple([a, *tail]))
    return Profile(name, source, tuple(rows))


def chain_accept_length(profile: Profile) -> float:
    """Expected tokens per round of a top-1 chain (accepted drafts + the bonus token)."""
    total, survive = 1.0, 1.0
    for row in profile.probs:
        survive *= row[0]
        total += survive
    return total


def solve_top1(chain_accept: float, depth: int = 7) -> float:
    """The constant conditional top-1 acceptance whose chain accepts ``chain_accept``."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = 1.0 + sum(mid**d for d in range(1, depth + 1))
        lo, hi = (mid, hi) if value < chain_accept else (lo, mid)
    return (lo + hi) / 2


def expected_accept_length(profile: Profile, budget: int, topk: int | None = None) -> float:
    """``1 +`` the ``budget`` largest path probabilities of the tree (DDTree's best-first
    build over ``topk`` candidates per depth) for a calibrated drafter."""
    k = min(topk or RANKS, RANKS)
    probs = profile.probs
    heap = [(-probs[0][0], 0, 0, 1.0)]  # (-path prob, depth index, rank, parent prob)
    total = 0.0
    for _ in range(budget):
        if not heap:
            break
        neg, d, r, parent = heapq.heappop(heap)
        total += -neg
        if r + 1 < k:
            heapq.heappush(heap, (-parent * probs[d][r + 1], d, r + 1, parent))
        if d + 1 < len(probs):
            heapq.heappush(heap, (neg * probs[d + 1][0], d + 1, 0, -neg))
    return 1.0 + total


def _chain_profile(name: str, source: str, chain_accept: float, depth: int = 7) -> Profile:
    return geometric_profile(name, source, [solve_top1(chain_accept, depth)] * depth)


PAIRS = Path(__file__).resolve().parents[1] / "models" / "pairs"
RANK_PROFILE_FILE = "rank_profile.json"  # in a pair's folder, written by :mod:`.pair_rank_profile`


def measured_profile(pair: str) -> Profile:
    """The pair's measured rank histogram (``models/pairs/<pair>/rank_profile.json``, written by
    :mod:`.pair_rank_profile`) as the profile ``<pair>-ranks``."""
    path = PAIRS / pair / RANK_PROFILE_FILE
    data = json.loads(path.read_text())
    source = f"{path.name} of {pair}: {data['prompts']} prompts x {data['new_tokens']} greedy tokens"
    return Profile(f"{pair}-ranks", source, tuple(tuple(row) for row in data["probs"]))


PROFILES = {
    p.name: p
    for p in (
        measured_profile("pycode-4l"),
        _chain_profile("pycode-4l", "results/pycode-4l_cpu_acceptance.md: chain 2.34 tokens/round", 2.34),
        _chain_profile(
            "dflash-k25-code", "z-lab/Kimi-K2.5-DFlash card: 5.3-5.5 GSM8K/MATH-500/HumanEval", 5.4
        ),
        _chain_profile("dflash-k25-chat", "z-lab/Kimi-K2.5-DFlash card: 3.7 MT-Bench", 3.7),
    )
}


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (odd multipliers below 2**31, so the products
    stay inside int64); the result is in ``[0, 2**32)``."""
    x = x & 0xFFFFFFFF
    for multiplier in (0x7FEB352D, 0x2C1B3C6D):
        x = x ^ (x >> 16)
        x = (x * multiplier) & 0xFFFFFFFF
    return x ^ (x >> 16)


class RankSampler:
    """Device tables of some profiles for a top-``k`` of ``depth`` levels."""

    def __init__(self, profiles: list[Profile], depth: int, k: int, device, seed: int = 0):
        probs = torch.zeros((len(profiles), depth, k + 1), dtype=torch.float64)
        for p, profile in enumerate(profiles):
            for d in range(depth):
                row = profile.probs[min(d, profile.depth - 1)]
                kept = list(row[:k]) + [0.0] * max(0, k - len(row))
                probs[p, d, :k] = torch.tensor(kept, dtype=torch.float64)
        probs[..., k] = (1.0 - probs[..., :k].sum(-1)).clamp_min(0.0)  # the true token not proposed
        self.cdf = probs.cumsum(-1).to(torch.float32).to(device)
        self.cdf[..., -1] = 1.0 + 1e-6  # every draw lands in a bucket
        self.log_probs = probs[..., :k].clamp_min(1e-30).log().to(torch.float32).to(device)
        self.k, self.depth, self.seed = k, depth, seed

    def sample(self, profile_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Ranks ``[bs, depth]`` (``k`` = not proposed), one draw per request and depth, each
        request from its profile (``profile_ids`` ``[bs]``). The draws are a hash of ``keys``
        ``[bs]`` (int64 in ``[0, 2**32)``), the seed and the depth: no generator state, so the
        same key draws the same ranks in every batch, and a CUDA graph can capture them."""
        depths = torch.arange(1, self.depth + 1, device=keys.device, dtype=torch.int64)
        bits = mix32(mix32(keys[:, None] ^ self.seed) ^ (depths * 0x9E3779B1 & 0xFFFFFFFF))
        u = (bits >> 8).to(torch.float32)[..., None] / float(1 << 24)  # [bs, depth, 1] in [0, 1)
        return (u >= self.cdf[profile_ids]).sum(-1)


def place_true_token(candidates: torch.Tensor, true_ids: torch.Tensor, ranks: torch.Tensor, k: int):
    """``candidates`` ``[n, k+1]`` (the drafter's own top-(k+1)), ``true_ids`` ``[n]`` (-1:
    unknown), ``ranks`` ``[n]`` -> ids ``[n, k]``: the true token at its rank (none where the
    rank is ``k`` or the token unknown), the drafter's other candidates in order around it."""
    is_true = candidates == true_ids[:, None]
    others = candidates.gather(1, torch.argsort(is_true.to(torch.int8), dim=1, stable=True))
    ranks = torch.where(true_ids >= 0, ranks, torch.full_like(ranks, k))
    j = torch.arange(k, device=candidates.device)[None, :]
    source = j - (j > ranks[:, None]).to(j.dtype)
    ids = others.gather(1, source)
    return torch.where(j == ranks[:, None], true_ids[:, None], ids)
