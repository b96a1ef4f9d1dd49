"""The trained pair's acceptance profile, measured: per depth, where the target's greedy token
sits in the drafter's ranking (the replay profile ``<pair>-ranks``).

The chain-calibrated profiles of :mod:`.replay_profiles` know one number, the chain's accept
length, and assume the rest (a constant top-1 per depth, a geometric tail). On the trained pair
that assumption is far off where it matters for trees: it gives a best-first tree of 7 nodes
2.39 tokens a round where the pair takes 2.71-2.76. This tool measures the histogram instead.

For each held-out prompt the target continues greedily (float32, the training code's models);
at every position of the continuation the drafter proposes its block from the target's features
(:func:`.pair_eval_replay.drafter_logits_along`), and at each depth ``d`` the rank of the
target's token in the drafter's depth-``d`` logits (descending, ties to the smaller id, as the
top-k) is counted over the positions where the tokens of every earlier depth ranked inside the
profile's 64 ranks (the true path can be in the tree). DFlash drafts a block's depths in
parallel from the anchor, so a depth's ranking does not depend on the tokens drafted above it,
which is the profile's model too. Each row is made non-increasing (pool-adjacent-violators:
the replayed top-k must stay sorted).

The profile's predictions (:func:`.replay_profiles.expected_accept_length`, a drafter whose
log-probs are the profile's) are written beside the exact tokens per round of the reference
round replayed on the same continuations (:func:`.pair_eval_replay.replay_rounds`), so the
file says how well the profile stands in for the pair.

    python -m lab.bench.pair_rank_profile            # ~1 min on 2 CPU cores

writes ``models/pairs/<pair>/rank_profile.json`` (read by :mod:`.replay_profiles`) and
``results/pair_rank_profile_<pair>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from lab.bench import _stamp
from lab.bench.pair_eval import DEFAULT_PAIR, load_pair
from lab.bench.pair_eval_replay import drafter_logits_along, load_models, replay_rounds
from lab.bench.pair_eval_serving import Arm
from lab.bench.replay_profiles import RANK_PROFILE_FILE, RANKS, Profile, expected_accept_length

BUDGETS = (7, 16, 32, 64)


def pool_adjacent_violators(values) -> list[float]:
    """The non-increasing sequence closest to ``values`` in squared error (equal weights)."""
    pools: list[list[float]] = []  # [mean, count]
    for v in values:
        pools.append([float(v), 1])
        while len(pools) > 1 and pools[-2][0] < pools[-1][0]:
            mean2, n2 = pools.pop()
            mean1, n1 = pools.pop()
            pools.append([(mean1 * n1 + mean2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, n in pools for _ in range(n)]


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor, cap: int = RANKS) -> np.ndarray:
    """Ranks ``[positions, depth]`` of ``tokens[p + d]`` (``tokens`` ``[length]``, the block of
    position p drafting ``p + 1 ..``) in ``logits`` ``[positions, depth, vocab]``: order by
    logit descending, ties to the smaller id; ``cap`` for a rank at or beyond it, -1 past the
    end of ``tokens``."""
    positions, depth, vocab = logits.shape
    start = len(tokens) - positions  # the first anchor
    ranks = np.full((positions, depth), -1, dtype=np.int64)
    ids = torch.arange(vocab)
    for d in range(depth):
        rows = torch.arange(max(0, positions - d - 1))  # the blocks whose depth d is in tokens
        true = tokens[start + rows + 1 + d]
        lg = logits[rows, d]
        own = lg.gather(1, true[:, None])
        above = (lg > own).sum(1) + ((lg == own) & (ids[None] < true[:, None])).sum(1)
        ranks[rows.numpy(), d] = above.clamp(max=cap).numpy()
    return ranks


def rank_profile_rows(ranks: np.ndarray, cap: int = RANKS) -> tuple[list[list[float]], list[int]]:
    """Per depth, the share of each rank ``0..cap-1`` among the positions whose earlier depths
    all ranked below ``cap`` (made non-increasing), and how many positions that was."""
    rows, counts = [], []
    reach = np.ones(len(ranks), dtype=bool)
    for d in range(ranks.shape[1]):
        known = reach & (ranks[:, d] >= 0)
        counts.append(int(known.sum()))
        hist = np.bincount(ranks[known, d], minlength=cap + 1)[:cap] / max(int(known.sum()), 1)
        rows.append(pool_adjacent_violators(hist))
        reach &= (ranks[:, d] >= 0) & (ranks[:, d] < cap)
    return rows, counts


@torch.no_grad()
def greedy_continuation(target, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy tokens after ``prompt`` (float32, a full forward per token)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        hidden, _ = target(torch.tensor([ids]))
        ids.append(int(target.logits(hidden[0, -1]).argmax()))
    return ids[len(prompt) :]


def measure(pair: dict, prompts: list[dict], new_tokens: int) -> dict:
    from tqdm import tqdm

    models = load_models(pair)
    target, block = models[1], models[0].block_size
    arms = [Arm("chain", block - 1, 1), *(Arm(f"tree-b{b}", b) for b in BUDGETS)]
    ranks, rounds = [], {arm.name: [] for arm in arms}
    for prompt in tqdm(prompts, desc="prompts", unit="prompt", dynamic_ncols=True):
        start = len(prompt["input_ids"])
        seq = torch.tensor(
            [prompt["input_ids"] + greedy_continuation(target, prompt["input_ids"], new_tokens)]
        )
        logits = drafter_logits_along(models, seq, start)  # one drafter pass: the ranks and the rounds
        ranks.append(token_ranks(logits, seq[0]))
        for arm in arms:
            rounds[arm.name] += replay_rounds(logits, seq[0].numpy(), start, arm)
    rows, counts = rank_profile_rows(np.concatenate(ranks))
    exact = {name: sum(r) / len(r) for name, r in rounds.items()}
    profile = Profile(f"{pair['name']}-ranks", "measured", tuple(tuple(r) for r in rows))
    predicted = {"chain": expected_accept_length(profile, block - 1, topk=1)}
    predicted |= {f"tree-b{b}": expected_accept_length(profile, b) for b in BUDGETS}
    return {"probs": rows, "positions": counts, "exact": exact, "predicted": predicted}


def markdown(data: dict) -> str:
    arms = list(data["exact"])
    lines = [
        f"# Measured acceptance profile of the trained pair `{data['pair']}`",
        "",
        f"{data['prompts']} held-out prompts, {data['new_tokens']} greedy tokens each (float32, the "
        "training code's models). Tokens per round: exact = the reference round replayed on the "
        "continuations; profile = a drafter whose log-probs are the profile's "
        "(`replay_profiles.expected_accept_length`), as the replay drafter serves it.",
        "",
        _stamp.stamp_markdown(data["stamp"]),
        "",
        _stamp.md_table(
            ["arm", "exact", "profile", "profile / exact"],
            [
                [a, data["exact"][a], data["predicted"][a], data["predicted"][a] / data["exact"][a]]
                for a in arms
            ],
        ),
        "",
        "## Per depth: the share of each rank (positions whose earlier depths ranked below 64)",
        "",
        _stamp.md_table(
            ["depth", "positions", "rank 0", "rank 1", "rank 2", "ranks 3-7", "ranks 8-63", "not in 64"],
            [
                [d + 1, n, r[0], r[1], r[2], sum(r[3:8]), sum(r[8:]), 1 - sum(r)]
                for d, (n, r) in enumerate(zip(data["positions"], data["probs"]))
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=DEFAULT_PAIR)
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: all)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="report folder (default: results)")
    p.add_argument("--profile-out", type=Path, default=None, help="default: the pair's rank_profile.json")
    args = p.parse_args(argv)
    pair = load_pair(args.pair)
    prompts = pair["prompts"][: args.prompts or None]
    data = {
        "pair": pair["name"],
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "stamp": _stamp.stamp(),
    }
    data |= measure(pair, prompts, args.new_tokens)
    profile_path = args.profile_out or args.pair / RANK_PROFILE_FILE
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile_path.write_text(
        json.dumps({k: data[k] for k in ("pair", "prompts", "new_tokens", "probs")}) + "\n"
    )
    name = f"pair_rank_profile_{pair['name']}"
    paths = _stamp.write_outputs(_stamp.results_dir(args.out), name, data, markdown(data))
    print(markdown(data))
    print("wrote " + ", ".join(str(x) for x in [profile_path, *paths]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
