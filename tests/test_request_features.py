"""Per-path penalties and tree links against a token-by-token reference.

The reference is the plain server's arithmetic for one sequence (SGLang's
penalizers: frequency counts added one occurrence at a time, presence, the
additive sum applied first, then the repetition scaling, ``min_new_tokens``
banning the stop tokens), run once per tree slot on the text that slot's
logits follow: the output before the root, then the slot's own path.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.adapter.penalties import PenaltyTable, RowPenalties, apply_path_penalties
from sglang_ddtree.tree.paths import first_child_next_sibling, path_token_counts

VOCAB = 40


def random_trees(bs: int, width: int, seed: int, vocab: int = VOCAB):
    """Parents, tokens, depths and visibility for ``bs`` random trees, with
    padding slots after each tree and repeated tokens on purpose (small vocab)."""
    rng = random.Random(seed)
    parents = torch.full((bs, width), -1, dtype=torch.int64)
    tokens = torch.zeros((bs, width), dtype=torch.int64)
    depths = torch.zeros((bs, width), dtype=torch.int64)
    visibility = torch.zeros((bs, width, width), dtype=torch.bool)
    for b in range(bs):
        size = rng.randint(1, width)
        for i in range(width):
            visibility[b, i, i] = True
            tokens[b, i] = rng.randrange(vocab // 4)  # few distinct tokens: repeats on paths
            if 0 < i < size:
                parents[b, i] = rng.randrange(i)
                depths[b, i] = depths[b, parents[b, i]] + 1
                visibility[b, i] |= visibility[b, parents[b, i]]
    return parents, tokens, depths, visibility


def path_of(parents, b: int, i: int) -> list[int]:
    path = [i]
    while parents[b, path[-1]] >= 0:
        path.append(int(parents[b, path[-1]]))
    return path[::-1]


def reference_penalised(logits_row, text, frequency, presence, repetition, min_new, stops):
    """SGLang's penalizers on one sequence of output tokens ``text``."""
    cum_frequency = torch.zeros(VOCAB)
    cum_presence = torch.zeros(VOCAB)
    cum_scaling = torch.ones(VOCAB)
    for token in text:
        cum_frequency[token] += frequency
        cum_presence[token] = presence
        cum_scaling[token] = repetition
    additive = torch.zeros(VOCAB)
    additive.sub_(cum_frequency)
    additive.sub_(cum_presence)
    if len(text) < min_new:
        additive[stops] = float("-inf")
    out = logits_row + additive
    return torch.where(out < 0, out * cum_scaling, out / cum_scaling)


@pytest.mark.parametrize("seed", range(6))
def test_path_penalties_equal_token_by_token_reference(seed):
    bs, width = 3, 12
    parents, tokens, depths, visibility = random_trees(bs, width, seed)
    rng = random.Random(100 + seed)
    history = [[rng.randrange(VOCAB // 4) for _ in range(rng.randint(0, 6))] for _ in range(bs)]
    frequency = torch.tensor([0.5, 0.0, 1.25])
    presence = torch.tensor([0.0, 0.75, 1.5])
    repetition = torch.tensor([1.5, 1.0, 2.0])
    min_new = torch.tensor([0, 5, 30])
    stops = [[3], [], [1, 2]]
    counts = torch.zeros((bs, VOCAB))
    for b, text in enumerate(history):
        for token in text:
            counts[b, token] += 1
    stop_ids = torch.tensor([(s + [s[0]] * 2)[:2] if s else [0, 0] for s in stops])
    stop_valid = torch.tensor([[k < len(s) for k in range(2)] for s in stops])
    rows = RowPenalties(
        counts=counts,
        out_len=torch.tensor([len(h) for h in history]),
        frequency=frequency,
        presence=presence,
        repetition=repetition,
        min_new=min_new,
        stop_ids=stop_ids,
        stop_valid=stop_valid,
    )
    logits = torch.randn((bs, width, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3
    got = logits.clone()
    apply_path_penalties(got, rows, tokens, depths, path_token_counts(visibility, tokens))
    for b in range(bs):
        for i in range(width):
            if i > 0 and parents[b, i] < 0:
                continue  # padding slot
            text = history[b] + [int(tokens[b, j]) for j in path_of(parents, b, i)]
            want = reference_penalised(
                logits[b, i], text, frequency[b], presence[b], repetition[b], int(min_new[b]), stops[b]
            )
            assert torch.equal(got[b, i], want), (b, i)


def test_path_token_counts_count_repeats_along_the_path():
    parents = torch.tensor([[-1, 0, 1, 0]])
    tokens = torch.tensor([[5, 5, 7, 5]])
    visibility = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    counts = path_token_counts(visibility, tokens)
    assert counts[0, 2].tolist() == [2.0, 2.0, 1.0, 2.0]  # path 5 5 7
    assert counts[0, 3].tolist() == [2.0, 2.0, 0.0, 2.0]  # path 5 5 (slot 3's own token)
    assert parents.shape == tokens.shape


@pytest.mark.parametrize("seed", range(5))
def test_first_child_next_sibling_links_every_tree_slot_once(seed):
    bs, width = 4, 16
    parents, _, _, _ = random_trees(bs, width, seed)
    first_child, next_sibling = first_child_next_sibling(parents)
    for b in range(bs):
        children = {i: [j for j in range(width) if parents[b, j] == i] for i in range(width)}
        for i in range(width):
            kids = children[i]
            assert int(first_child[b, i]) == (kids[0] if kids else -1)
            for k, j in enumerate(kids):
                assert int(next_sibling[b, j]) == (kids[k + 1] if k + 1 < len(kids) else -1)
        assert int(next_sibling[b, 0]) == -1


def _req(row, output, **params):
    defaults = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "stop_token_ids": None,
    }
    return SimpleNamespace(
        kv=SimpleNamespace(req_pool_idx=row),
        output_ids=output,
        sampling_params=SimpleNamespace(**{**defaults, **params}),
        eos_token_ids={2},
        tokenizer=None,
    )


def test_penalty_table_counts_prefill_output_and_accepted_paths():
    table = PenaltyTable(lambda: 8, VOCAB, torch.device("cpu"))
    table.register([_req(3, [])])
    assert table.counts is None  # nothing allocated until a request needs it
    table.register([_req(5, [7, 7, 9], frequency_penalty=0.5, min_new_tokens=4), _req(3, [])])
    pool = torch.tensor([5, 3])
    rows = table.rows(pool)
    assert rows.counts[0, 7] == 2 and rows.counts[0, 9] == 1 and rows.out_len.tolist() == [3, 0]
    assert rows.frequency.tolist() == [0.5, 0.0] and rows.stop_ids[0, 0] == 2 and rows.stop_valid[0, 0]
    assert not rows.stop_valid[1].any()
    # the root (slot 0) and two accepted drafts become output; the bonus does not
    tokens = torch.tensor([[11, 12, 13, 14], [20, 21, 22, 23]])
    path = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]])
    table.advance(pool, rows, tokens, path, torch.tensor([2, 0]))
    after = table.rows(pool)
    assert after.counts[0, [11, 13, 14, 12]].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert after.counts[1, 20] == 1 and after.out_len.tolist() == [6, 1]
    # a reused pool row starts from the new request's own output
    table.register([_req(5, [])])
    assert table.rows(torch.tensor([5])).counts.sum() == 0
