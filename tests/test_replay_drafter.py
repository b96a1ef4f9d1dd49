"""The replay drafter (benchmarks at real shapes with a set acceptance profile).

Unit: the ranks it draws follow the requested per-depth distribution, the true token lands
at the drawn rank among the drafter's own candidates, and the profiles reproduce the accept
lengths they cite. Server: with the replay drafter a DDTREE server on the tiny pair emits
exactly the plain server's greedy tokens and accepts what the profile predicts."""

from __future__ import annotations

import json

import pytest
import torch

from lab.bench.replay_drafter import Recording, draw_keys, recorded_row
from lab.bench.replay_profiles import (
    PROFILES,
    RankSampler,
    chain_accept_length,
    expected_accept_length,
    geometric_profile,
    place_true_token,
)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_sampled_ranks_follow_the_profile_per_depth(k):
    profile = geometric_profile("t", "test", [0.9, 0.6, 0.3], tail_share=0.6, decay=0.5)
    other = geometric_profile("u", "test", [0.5, 0.5, 0.5])
    sampler = RankSampler([other, profile], depth=3, k=k, device="cpu", seed=1)
    keys = torch.arange(200_000, dtype=torch.int64)  # [n, depth], all of `profile`, one key each
    ranks = sampler.sample(torch.ones(200_000, dtype=torch.int64), keys)
    for d in range(3):
        observed = torch.bincount(ranks[:, d], minlength=k + 1).double() / ranks.shape[0]
        wanted = torch.tensor(list(profile.probs[d][:k]), dtype=torch.float64)
        wanted = torch.cat([wanted, (1 - wanted.sum()).view(1)])
        assert torch.allclose(observed, wanted, atol=4e-3), (d, observed[:5], wanted[:5])
    assert torch.allclose(sampler.log_probs[1].exp()[:, 0], torch.tensor([0.9, 0.6, 0.3]), atol=1e-6)
    assert bool((sampler.log_probs[..., :-1] >= sampler.log_probs[..., 1:]).all())  # sorted, as top-k is


def test_a_key_draws_the_same_ranks_in_any_batch_and_keys_draw_apart():
    """The draw of a request at a position is a function of its key (recorded row and
    position): the same in every batch it lands in, so every arm sees the same luck there."""
    profile = geometric_profile("t", "test", [0.6, 0.4, 0.2])
    sampler = RankSampler([profile], depth=3, k=8, device="cpu", seed=3)
    keys = draw_keys(torch.arange(64), torch.full((64,), 100))
    alone = torch.cat([sampler.sample(torch.zeros(1, dtype=torch.int64), keys[i : i + 1]) for i in range(64)])
    batched = sampler.sample(torch.zeros(64, dtype=torch.int64), keys.flip(0)).flip(0)
    assert torch.equal(alone, batched)
    assert len({tuple(r) for r in alone.tolist()}) > 16  # distinct keys do not share one draw
    moved = draw_keys(torch.arange(64), torch.full((64,), 101))  # the next position draws anew
    assert not torch.equal(sampler.sample(torch.zeros(64, dtype=torch.int64), moved), alone)


def test_true_token_at_its_rank_among_the_drafters_own_candidates():
    candidates = torch.tensor(
        [[10, 11, 12, 13, 14], [20, 99, 21, 22, 23], [30, 31, 32, 33, 99], [40, 99, 41, 42, 43]]
    )
    true_ids = torch.tensor([99, 99, 99, 99])
    ranks = torch.tensor([0, 3, 4, 1])  # k = 4: rank 4 = not proposed
    ids = place_true_token(candidates, true_ids, ranks, k=4)
    assert ids.tolist() == [
        [99, 10, 11, 12],  # absent from the drafter's list: inserted, the last candidate drops
        [20, 21, 22, 99],  # present at 1: moved to rank 3, never duplicated
        [30, 31, 32, 33],  # not proposed
        [40, 99, 41, 42],
    ]
    unknown = place_true_token(candidates, torch.tensor([-1, -1, -1, -1]), ranks, k=4)
    assert unknown.tolist() == candidates[:, :4].tolist()


def test_profiles_reproduce_the_accept_lengths_they_cite():
    cited = {"pycode-4l": 2.34, "dflash-k25-code": 5.4, "dflash-k25-chat": 3.7}
    for name, chain in cited.items():
        profile = PROFILES[name]
        assert chain_accept_length(profile) == pytest.approx(chain, abs=1e-3)
        assert expected_accept_length(profile, budget=7, topk=1) == pytest.approx(chain, abs=1e-3)
        by_budget = [expected_accept_length(profile, b) for b in (8, 16, 32, 64)]
        assert by_budget == sorted(by_budget) and by_budget[0] > chain


def test_recording_lookup_by_prompt_and_position():
    recording = Recording([[1, 2, 3, 4, 5, 6], [7, 8, 9]], device="cpu")

    class Req:
        def __init__(self, ids):
            self.origin_input_ids = ids

    rows = torch.tensor([recording.row(Req([1, 2])), recording.row(Req([7])), recording.row(Req([5]))])
    assert rows.tolist() == [0, 1, -1]
    truth, roots = recording.truth(rows, torch.tensor([2, 1, 0]), depth=3)
    assert roots.tolist() == [3, 8, -1]
    assert truth.tolist() == [[4, 5, 6], [9, -1, -1], [-1, -1, -1]]


@pytest.mark.server
@pytest.mark.slow  # a benchmark-only drafter (two servers, ~6 min on 2 cores): `make test-slow`
def test_replay_ddtree_identical_to_plain_at_the_profiled_acceptance(tmp_path):
    from serving import COMMON, GREEDY, PROMPTS, output_ids, run_all, token_requests
    from transformers import AutoTokenizer

    from lab.models.tiny import build_tiny_models
    from sglang_ddtree.launch import ServerProcess, cpu_server_args

    models = build_tiny_models()
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    requests = token_requests(tokenizer, params={**GREEDY, "max_new_tokens": 48}, prompts=PROMPTS)
    plain = ServerProcess(
        cpu_server_args(models.target, COMMON),
        start_timeout=900,
        name="plain",
        log_path=tmp_path / "plain.log",
    )
    with plain:
        expected = output_ids(run_all(plain, requests))
    recording = tmp_path / "recording.json"
    recording.write_text(json.dumps({"sequences": [r["input_ids"] + o for r, o in zip(requests, expected)]}))
    budget, profile = 16, "dflash-k25-chat"
    args = cpu_server_args(models.target, [
        *COMMON, "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(models.drafter),
        "--speculative-ddtree-budget", str(budget),
    ])  # fmt: skip
    env = {
        "SGLANG_DDTREE_TEST_PLUGIN": "lab.bench.replay_drafter",
        "SGLANG_DDTREE_REPLAY_TOKENS": str(recording),
        "SGLANG_DDTREE_REPLAY_PROFILE": profile,
    }
    replay = ServerProcess(args, env=env, start_timeout=900, name="replay", log_path=tmp_path / "replay.log")
    with replay:
        results = run_all(replay, requests)
    assert output_ids(results) == expected
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    predicted = expected_accept_length(PROFILES[profile], budget)
    # ~110 rounds of random ranks; the last round of each request is cut at max_new_tokens
    assert tokens / rounds == pytest.approx(predicted, rel=0.2), (tokens / rounds, predicted)
    assert "DDTREE replay drafter active" in (tmp_path / "replay.log").read_text()


def test_a_short_prompt_finds_its_own_recording_when_a_longer_one_begins_with_it():
    """Prompts tiled to several lengths from the same text (``lab.ab_k26``'s) begin with each
    other; the short prompt's recording is the shortest that extends it (the first K2.6 rank
    A/B reported 0 identical for every short prompt from this)."""
    from lab.ab_k26 import prompt_ids

    short, long = prompt_ids([[5, 6, 7], [8, 9]], 4, 0, 2), prompt_ids([[5, 6, 7], [8, 9]], 12, 0, 2)
    assert long[0][:4] == short[0]
    outputs = {tuple(p): [100 + len(p), i] for i, p in enumerate(short + long)}
    sequences = [p + outputs[tuple(p)] for p in short + long]
    for order in (sequences, sequences[::-1]):
        assert [recorded_row(order, p) for p in short] == [order.index(s) for s in sequences[:2]]
        for prompt in short + long:  # each prompt's own continuation
            assert order[recorded_row(order, prompt)][len(prompt) :] == outputs[tuple(prompt)]
    assert recorded_row(sequences, [42]) == -1


def test_replacement_reads_the_batch_from_the_device_tables_the_host_fills_once():
    """What the drafter's CUDA graph runs: rows from the pool-slot table (filled once per
    request, again when a request moves slot), the true token at the drawn rank for requests
    on their recording, the drafter's own candidates for the others."""
    from types import SimpleNamespace

    from lab.bench.replay_drafter import ReplayDrafter

    recording = Recording([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]], device="cpu")
    drafter = ReplayDrafter(recording, "dflash-k25-code", pool_rows=6)
    a = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=4), origin_input_ids=[1, 2])
    b = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=2), origin_input_ids=[9])
    c = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0), origin_input_ids=[77])  # not recorded
    drafter.register([a, b, c])
    assert drafter.row_of_slot.tolist() == [-1, -1, 1, -1, 0, -1]
    b.kv.req_pool_idx = 5  # retracted and scheduled again in another slot
    drafter.register([a, b])
    assert drafter.row_of_slot[5].item() == 1

    depth, k = 3, 4
    slots = torch.tensor([4, 5, 0])
    prefix_lens = torch.tensor([2, 1, 1])  # a's root is token 3, b's is 10; c is off the recording
    roots = torch.tensor([3, 10, 50])
    candidates = torch.arange(100, 100 + 3 * depth * (k + 1)).view(3 * depth, k + 1)
    log_probs, ids = drafter.replace(candidates, roots, prefix_lens, slots, depth, k)
    assert log_probs.shape == ids.shape == (3 * depth, k)
    ranks = drafter.sampler(depth, k).sample(
        torch.zeros(3, dtype=torch.int64), draw_keys(torch.tensor([0, 1, -1]), prefix_lens)
    )
    truth = {0: [4, 5, 6], 1: [11, 12, 13]}
    for request, true_tokens in truth.items():
        for d, token in enumerate(true_tokens):
            row, rank = ids[request * depth + d], int(ranks[request, d])
            assert (token in row.tolist()) == (rank < k)
            if rank < k:
                assert row[rank].item() == token
    assert torch.equal(ids[2 * depth :], candidates[2 * depth :, :k])  # off the recording: its own
    # a CUDA graph replays a padded batch (stale rows past the real ones): the real rows unchanged
    padded = drafter.replace(
        torch.cat([candidates, candidates[:depth]]),
        torch.cat([roots, roots[:1]]),
        torch.cat([prefix_lens, prefix_lens[:1]]),
        torch.cat([slots, torch.tensor([4])]),
        depth,
        k,
    )
    assert torch.equal(padded[1][: 3 * depth], ids) and torch.equal(padded[0][: 3 * depth], log_probs)
    drafter.count(roots, prefix_lens, slots)
    assert drafter._drift.tolist() == [2, 3]
    # one server, several profiles: each recorded row its own, requests off the recording the default
    per_sequence = Recording([[1, 2], [3, 4]], device="cpu", profiles=["pycode-4l", "dflash-k25-code"])
    both = ReplayDrafter(per_sequence, "dflash-k25-code", pool_rows=2)
    assert both.names == ["dflash-k25-code", "pycode-4l"]
    assert both.profile_of_row.tolist() == [1, 0, 0]
