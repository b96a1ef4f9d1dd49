"""Width 1's decode graphs append every root's drafter KV themselves (``draft_kv_graphs.py``:
the capture hook SGLang's graph runner calls at the end of a captured forward).

On the H200 the graphs and their replay are checked through the real server
(``tests/gpu_server``: the online budget's width-1 arm against the same arm with the eager append,
round for round, and against plain). Here, on the CPU: the hook writes what the decoding step's
own append writes (same slots, rows and positions; the padded rows only the sink), only in
runners marked for it; it is installed only where the two pools name a slot alike; and a step
whose forward replayed such graphs appends nothing more, while an eager forward still does."""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.mem_cache.kv_loc_plan import IdSpace, IdSpaceKind

from sglang_ddtree.adapter.decode_step import DecodeStep
from sglang_ddtree.adapter.draft_kv_graphs import DraftKVGraphs, root_append_hook, same_write_ids
from sglang_ddtree.adapter.kv_commit import KVCommitSteps
from sglang_ddtree.adapter.phases import RoundPhases
from sglang_ddtree.adapter.width_graphs import decode_mode_runner

FEATURES, LAST = 4, 30


class _Appends:
    """SGLang's append, recording what it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append({k: v.clone() for k, v in kwargs.items()})


def _written(call) -> dict[int, tuple]:
    """Slot -> (hidden row, position) of the rows an append writes (its prefix-valid rows)."""
    loc, hidden, positions = call["cache_loc"], call["target_hidden"], call["positions"]
    keep = torch.ones(len(loc), dtype=torch.bool)
    if call.get("commit_lens") is not None:
        bs = call["commit_lens"].shape[0]
        cols = torch.arange(len(loc) // bs).repeat(bs)
        keep = cols < call["commit_lens"].repeat_interleave(len(loc) // bs)
    return {int(s): (hidden[i].tolist(), int(positions[i])) for i, s in enumerate(loc) if keep[i]}


def _graphs(append) -> DraftKVGraphs:
    return DraftKVGraphs(append, FEATURES, torch.float32, [1, 2, 4, 8], [1, 4], LAST, "cpu")


def _captured_forward(bs: int, padded: int, seed: int = 0):
    """What a decode graph of ``padded`` rows holds while it replays a batch of ``bs``: the
    write ids (int32, the sink past the batch), positions and hidden states of its buffers."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.zeros(padded, dtype=torch.int32)
    loc[:bs] = torch.randperm(100, generator=g)[:bs].to(torch.int32) + 1
    positions = torch.zeros(padded, dtype=torch.int64)
    positions[:bs] = torch.randint(0, LAST + 1, (bs,), generator=g)
    hidden = torch.randn(padded, FEATURES, generator=g)
    forward_batch = types.SimpleNamespace(out_cache_loc=loc, positions=positions)
    return types.SimpleNamespace(hidden_states=hidden), forward_batch


def test_the_hook_writes_what_the_decoding_steps_append_writes():
    bs, padded = 3, 4
    out, forward_batch = _captured_forward(bs, padded)
    in_graph, eager = _Appends(), _Appends()
    hook = _graphs(in_graph).root_append_hook()
    hook(types.SimpleNamespace(appends_draft_kv=True), out, forward_batch, padded)
    (call,) = in_graph.calls
    written = _written(call)
    # the decoding step's own append (``_commit_root_draft_kv``) of the live rows
    eager(
        target_hidden=out.hidden_states[:bs],
        cache_loc=forward_batch.out_cache_loc[:bs].to(torch.int64),
        positions=forward_batch.positions[:bs],
    )
    live = _written(eager.calls[0])
    assert {slot: row for slot, row in written.items() if slot != 0} == live
    # the padded row writes only the sink
    assert set(written) - set(live) == {0}
    assert call["commit_lens"].tolist() == [1] * padded


def test_the_hook_leaves_runners_not_marked_alone():
    appends = _Appends()
    hook = _graphs(appends).root_append_hook()
    out, forward_batch = _captured_forward(2, 2)
    hook(types.SimpleNamespace(), out, forward_batch, 2)  # the start-up verify graphs
    hook(types.SimpleNamespace(appends_draft_kv=False), out, forward_batch, 2)
    assert appends.calls == []


def test_the_hook_refuses_a_graph_wider_than_its_commit_lengths():
    hook = _graphs(_Appends()).root_append_hook()
    out, forward_batch = _captured_forward(9, 16)
    with pytest.raises(ValueError, match="16 rows"):
        hook(types.SimpleNamespace(appends_draft_kv=True), out, forward_batch, 16)


def _translator(write=None, key=(IdSpaceKind.FULL, None)):
    return types.SimpleNamespace(
        space=lambda kind: IdSpace(key=key, write=write) if kind == IdSpaceKind.FULL else None
    )


def test_same_write_ids_only_where_both_pools_name_a_slot_alike():
    def translate(ids):
        return ids

    assert same_write_ids(_translator(), _translator())  # both index virtual ids as they are
    shared = (IdSpaceKind.FULL, 7)
    assert same_write_ids(_translator(translate, shared), _translator(translate, shared))  # a fused draft
    assert not same_write_ids(_translator(translate, (IdSpaceKind.FULL, 7)), _translator())  # unified target
    assert not same_write_ids(_translator(), types.SimpleNamespace(space=lambda kind: None))


def _worker(graphs, draft_translator=None):
    return types.SimpleNamespace(
        draft_kv_graphs=graphs,
        model_runner=types.SimpleNamespace(kv_index_translator=_translator(), capture_tail_hooks=[]),
        draft_model_runner=types.SimpleNamespace(kv_index_translator=draft_translator or _translator()),
    )


def test_the_hook_is_installed_only_with_graphs_and_alike_pools():
    worker = _worker(_graphs(_Appends()))
    hook = root_append_hook(worker)
    assert hook is not None and worker.model_runner.capture_tail_hooks == [hook]
    for worker in (_worker(None), _worker(_graphs(_Appends()), _translator(lambda ids: ids, ("x", 1)))):
        assert root_append_hook(worker) is None and worker.model_runner.capture_tail_hooks == []


def test_width_ones_runner_is_marked_and_others_are_not():
    class Runner:
        pass

    assert decode_mode_runner(Runner, appends_draft_kv=True).appends_draft_kv is True
    assert decode_mode_runner(Runner).appends_draft_kv is False
    assert not hasattr(Runner, "appends_draft_kv")


class _Worker(DecodeStep, KVCommitSteps):
    """What the two commits read of a worker; the append records what it was given."""

    def __init__(self, runner):
        self.width, self._last_position, self.draft_kv_graphs = 4, LAST, None
        self.phase = RoundPhases(0, is_logging_rank=True)
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=runner)
        self.appends = _Appends()

    def _draft_write_ids(self, plan):
        return plan

    def _append_target_hidden_to_draft_kv_by_loc(self, **kwargs):
        self.appends(**kwargs)


@pytest.mark.parametrize(
    "runner, can_run_graph, width, appends",
    [
        (types.SimpleNamespace(appends_draft_kv=True), True, 1, False),  # the graph appended
        (types.SimpleNamespace(appends_draft_kv=True), False, 1, True),  # an eager forward
        (types.SimpleNamespace(appends_draft_kv=False), True, 1, True),  # graphs without the append
        (types.SimpleNamespace(), True, 1, True),  # a verify graph
        (types.SimpleNamespace(appends_draft_kv=True), True, 2, True),  # a tree: the commit's append
    ],
)
def test_a_round_appends_unless_its_decode_graphs_did(runner, can_run_graph, width, appends):
    bs, worker = 2, _Worker(runner)
    plan = torch.arange(bs * worker.width) + 40
    acceptance = types.SimpleNamespace(
        sources=torch.zeros(bs, width, dtype=torch.int64), emitted=torch.ones(bs, dtype=torch.int32)
    )
    output = types.SimpleNamespace(hidden_states=torch.randn(bs * width, FEATURES))
    worker._commit_draft_kv(plan, output, acceptance, torch.tensor([3, 5]), can_run_graph)
    assert len(worker.appends.calls) == int(appends)
    if width == 1:  # what a decoding step asks before its own append
        assert worker._roots_appended_in_graph(can_run_graph) == (not appends)


@pytest.mark.parametrize("appended", [True, False])
def test_a_decoding_step_appends_unless_its_decode_graphs_did(appended):
    worker = _Worker(types.SimpleNamespace(appends_draft_kv=True))
    output = types.SimpleNamespace(hidden_states=torch.randn(2, FEATURES))
    worker._commit_root_draft_kv(torch.tensor([40, 41]), output, torch.tensor([3, 5]), appended)
    assert len(worker.appends.calls) == int(not appended)
