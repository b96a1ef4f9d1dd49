"""The trained pair's measured acceptance profile (``bench/pair_rank_profile.py``): the rank
count, the reach conditioning, the monotone fit, and the committed profile."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lab.bench import pair_rank_profile as prp
from lab.bench.replay_profiles import PROFILES, chain_accept_length, expected_accept_length


def test_pool_adjacent_violators_gives_the_closest_non_increasing_row():
    assert prp.pool_adjacent_violators([0.5, 0.1, 0.3, 0.2]) == pytest.approx([0.5, 0.2, 0.2, 0.2])
    assert prp.pool_adjacent_violators([0.1, 0.3]) == pytest.approx([0.2, 0.2])
    already = [0.6, 0.2, 0.2, 0.0]
    assert prp.pool_adjacent_violators(already) == already
    rng = np.random.default_rng(0)
    values = rng.random(40)
    fitted = prp.pool_adjacent_violators(values)
    assert all(a >= b for a, b in zip(fitted, fitted[1:])) and sum(fitted) == pytest.approx(values.sum())


def test_token_ranks_follow_the_top_k_order_with_ties_to_the_smaller_id():
    gen = torch.Generator().manual_seed(1)
    positions, depth, vocab, start = 6, 3, 12, 4
    logits = torch.randint(0, 4, (positions, depth, vocab), generator=gen).float()  # many ties
    tokens = torch.randint(0, vocab, (start + positions,), generator=gen)
    ranks = prp.token_ranks(logits, tokens, cap=5)
    for p in range(positions):
        for d in range(depth):
            t = start + p + 1 + d
            if t >= len(tokens):
                assert ranks[p, d] == -1
                continue
            order = sorted(range(vocab), key=lambda i: (-float(logits[p, d, i]), i))
            assert ranks[p, d] == min(order.index(int(tokens[t])), 5)


def test_rank_rows_count_a_depth_only_where_the_path_above_can_be_in_the_tree():
    ranks = np.array([[0, 1], [2, 0], [9, 0], [0, -1]])  # cap 4: the third position's depth 1 is out
    rows, counts = prp.rank_profile_rows(ranks, cap=4)
    assert counts == [4, 2]  # depth 2: the unreached third and the ended fourth are left out
    # depth 1 counted [0.5, 0, 0.25, 0], made non-increasing
    assert rows[0] == pytest.approx([0.5, 0.125, 0.125, 0.0]) and rows[1] == pytest.approx(
        [0.5, 0.5, 0.0, 0.0]
    )


def test_the_committed_profile_stands_in_for_the_pair():
    profile = PROFILES["pycode-4l-ranks"]
    assert profile.depth == 7
    for row in profile.probs:
        assert all(a >= b for a, b in zip(row, row[1:])) and sum(row) <= 1 + 1e-9
    report = json.loads((prp._stamp.REPO_ROOT / "results" / "pycode-4l_cpu_rank_profile.json").read_text())
    assert report["probs"] == [list(row) for row in profile.probs]  # the report is of the served profile
    assert chain_accept_length(profile) == pytest.approx(report["exact"]["chain"], rel=0.02)
    for budget in prp.BUDGETS:
        exact = report["exact"][f"tree-b{budget}"]
        assert expected_accept_length(profile, budget) == pytest.approx(exact, rel=0.06)
    # unlike the chain-calibrated profile, it gives seven nodes in a tree more than in a chain
    assert expected_accept_length(profile, 7) / chain_accept_length(profile) > 1.08
    assert expected_accept_length(PROFILES["pycode-4l"], 7) / 2.34 < 1.03


def test_the_tool_writes_a_profile_the_replay_can_serve(tmp_path):
    assert (
        prp.main(
            [
                "--prompts",
                "2",
                "--new-tokens",
                "8",
                "--out",
                str(tmp_path),
                "--profile-out",
                str(tmp_path / "new" / "p.json"),  # a folder that does not exist yet
            ]
        )
        == 0
    )
    written = json.loads((tmp_path / "new" / "p.json").read_text())
    report = json.loads((tmp_path / "pair_rank_profile_pycode-4l.json").read_text())
    assert written["probs"] == report["probs"] and len(written["probs"]) == 7
    assert report["positions"][0] == 2 * 7  # 8 new tokens: 7 anchors with a known next token each
    assert 1.0 <= report["exact"]["chain"] <= report["exact"]["tree-b64"]


def test_the_replay_serves_the_measured_profile_sorted_and_as_measured():
    from lab.bench.replay_profiles import RankSampler

    profile = PROFILES["pycode-4l-ranks"]
    k = 16
    sampler = RankSampler([profile], depth=7, k=k, device="cpu", seed=3)
    assert bool((sampler.log_probs[..., :-1] >= sampler.log_probs[..., 1:]).all())  # a top-k's order
    ranks = sampler.sample(torch.zeros(100_000, dtype=torch.int64), torch.arange(100_000, dtype=torch.int64))
    for d in (0, 3, 6):
        observed = torch.bincount(ranks[:, d], minlength=k + 1).double() / ranks.shape[0]
        wanted = torch.tensor(profile.probs[d][:k], dtype=torch.float64)
        assert torch.allclose(observed[:k], wanted, atol=5e-3), d
        assert float(observed[k]) == pytest.approx(1 - float(wanted.sum()), abs=5e-3)  # beyond the top-k
