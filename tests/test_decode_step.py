"""The decoding step of ``--speculative-ddtree-budget auto`` at width 1 without the drafter
(``adapter/decode_step.py``), against what the round wrote at width 1.

End to end (greedy identity with plain, request features, the phase lines of its steps) it
runs through the real server: ``test_serving_online_budget.py`` and ``test_serving_features.py``.
Here: the drafter's KV append of a decoding step is the one the round's commit made at width 1
(same rows, slots and positions, every root committed); request features build the root-only
trees only where a feature reads them; the statistics count decoding steps."""

from __future__ import annotations

import types

import torch

from sglang_ddtree.adapter.decode_step import DecodeStep
from sglang_ddtree.adapter.kv_commit import KVCommitSteps
from sglang_ddtree.adapter.phases import RoundPhases
from sglang_ddtree.adapter.request_features import RequestFeatures
from sglang_ddtree.adapter.stats import TreeStats
from sglang_ddtree.config import DDTreeConfig


class _Plan:
    def __init__(self, slots):
        self.slots = slots


class _Worker(DecodeStep, KVCommitSteps):
    """What the two commits read of a worker; the append records what it was given."""

    def __init__(self, last_position: int):
        self.width, self._last_position, self.draft_kv_graphs = 1, last_position, None
        self.phase = RoundPhases(0, is_logging_rank=True)
        self.appends = []

    def _draft_write_ids(self, plan):
        return plan.slots

    def _append_target_hidden_to_draft_kv_by_loc(self, **kwargs):
        self.appends.append(kwargs)


def _written(call) -> dict[int, tuple]:
    """Slot -> (hidden row, position) of the rows an append writes (prefix-valid rows only)."""
    loc, hidden, positions = call["cache_loc"], call["target_hidden"], call["positions"]
    keep = torch.ones(len(loc), dtype=torch.bool)
    if call.get("commit_lens") is not None:  # a [bs, width] window: the first commit_lens columns
        bs = call["commit_lens"].shape[0]
        cols = torch.arange(len(loc) // bs).repeat(bs)
        keep = cols < call["commit_lens"].repeat_interleave(len(loc) // bs)
    return {int(s): (hidden[i].tolist(), int(positions[i])) for i, s in enumerate(loc) if keep[i]}


def test_a_decoding_step_writes_the_drafter_kv_the_round_wrote_at_width_1():
    bs, last = 3, 20
    worker = _Worker(last)
    hidden = torch.randn(bs, 5, generator=torch.Generator().manual_seed(0))
    prefix_lens = torch.tensor([4, 25, 9])  # the second request past its context
    plan = _Plan(torch.tensor([70, 71, 72]))
    output = types.SimpleNamespace(hidden_states=hidden)
    acceptance = types.SimpleNamespace(
        sources=torch.zeros(bs, 1, dtype=torch.int64), emitted=torch.ones(bs, dtype=torch.int32)
    )
    worker._commit_draft_kv(plan, output, acceptance, prefix_lens, False)  # the round at width 1
    worker._commit_root_draft_kv(plan, output, prefix_lens.clamp(max=last))  # the decoding step
    round_call, step_call = worker.appends
    assert _written(step_call) == _written(round_call)
    assert sorted(_written(step_call)) == [70, 71, 72]
    assert [p for _, p in _written(step_call).values()] == [4, 20, 9]


def _batch(penalised: list[bool], grammar: bool = False):
    def params(p):
        return types.SimpleNamespace(
            frequency_penalty=1.0 if p else 0.0,
            presence_penalty=0.0,
            repetition_penalty=1.0,
            min_new_tokens=0,
        )

    reqs = [types.SimpleNamespace(sampling_params=params(p)) for p in penalised]
    return types.SimpleNamespace(
        reqs=reqs, has_grammar=grammar, req_pool_indices=torch.arange(len(reqs)), sampling_info=None
    )


def test_features_build_root_trees_only_where_a_feature_reads_them():
    features = RequestFeatures(pool_rows=lambda: 8, vocab=16, device=torch.device("cpu"))
    made = []

    def trees():
        made.append(1)
        from sglang_ddtree.tree.types import Trees

        return Trees.root_only(torch.tensor([3, 4]), torch.tensor([5, 6]))

    plain = _batch([False, False])
    round_features = features.start_round(plain, trees)
    logits = torch.randn(2, 16)
    before = logits.clone()
    features.apply(plain, round_features, logits, grammar_barrier=None)
    features.finish_round(plain, round_features)
    assert made == [] and torch.equal(logits, before)  # nothing to adjust, no trees made

    penalised = _batch([True, False])
    features.on_prefill(types.SimpleNamespace(reqs=[]))  # nothing registered: no table yet
    assert features.start_round(penalised, trees).trees is None and made == []
    features.penalty_table._allocate()
    round_features = features.start_round(penalised, trees)
    assert made == [1] and round_features.trees is not None
    logits = torch.zeros(2, 16)
    features.apply(penalised, round_features, logits, grammar_barrier=None)
    features.finish_round(penalised, round_features)  # the root alone accepted
    assert features.penalty_table.counts[0, 3] == 1 and features.penalty_table.out_len[0] == 1
    assert features.penalty_table.counts[1].sum() == 0  # the unpenalised request is not tracked


def test_stats_count_decoding_steps_with_the_rounds():
    config = DDTreeConfig.from_spec_fields(17, 8, None)
    stats = TreeStats(config, interval=100, is_logging_rank=False)
    stats.record_decode_step(4)
    stats.record_decode_step(4)
    summary = stats.summary()
    assert summary["rounds"] == 2 and summary["decode_steps"] == 2 and summary["request_rounds"] == 8
    assert summary["tokens_per_round"] == 1.0 and summary["mean_tree_nodes"] == 0.0
    off = TreeStats(config, interval=0, is_logging_rank=False)
    off.record_decode_step(4)
    assert off.decode_steps == 1 and off.summary() == {"rounds": 0}  # counted, not summarised
