"""The drafter KV append's graph path prepares what the eager append is given.

The CUDA capture itself runs on the GPU (``tests/gpu_server``: the graph arm's verify rounds per
request equal the eager-append arm's). Here a stand-in for a captured graph runs the same
append on the graph's buffers, so everything the replay reads is checked on CPU: the
committed rows and positions, the slots, the commit lengths (0 for the padded requests).
"""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.adapter.draft_kv_graphs import DraftKVGraphs, committed_rows, held_by_append


def _reference(hidden, sources, prefix_lens, width, last_position):
    bs = sources.shape[0]
    rows = torch.stack([hidden.view(bs, width, -1)[b, sources[b]] for b in range(bs)])
    positions = torch.stack([torch.arange(width) + int(p) for p in prefix_lens]).clamp(max=last_position)
    return rows, positions


def test_committed_rows_gather_the_accepted_nodes_at_their_positions():
    gen = torch.Generator().manual_seed(0)
    bs, width, last = 3, 5, 20
    hidden = torch.randn(bs * width, 6, generator=gen)
    sources = torch.randint(0, width, (bs, width), generator=gen)
    prefix_lens = torch.tensor([3, 18, 7])
    rows, positions = committed_rows(hidden, sources, prefix_lens, width, last)
    want_rows, want_positions = _reference(hidden, sources, prefix_lens, width, last)
    assert torch.equal(rows, want_rows) and torch.equal(positions, want_positions)
    assert positions.max() == last  # request 1 runs past the context: clamped


def _graphs(calls):
    graphs = DraftKVGraphs(
        lambda **kw: calls.append({k: v.clone() for k, v in kw.items()}),
        features=6, dtype=torch.float32, batch_sizes=[1, 2, 4], widths=[3, 5], last_position=20, device="cpu",
    )  # fmt: skip

    class Captured:  # replays what a capture of (bs, width) recorded: the append on the buffers
        def __init__(self, bs, width):
            self.replay = lambda: graphs._run(bs, width)

    graphs.graphs = {(b, w): Captured(b, w) for b in graphs.batch_sizes for w in graphs.widths}
    return graphs


def test_replay_reads_the_rounds_inputs_and_pads_with_empty_commits():
    calls = []
    graphs = _graphs(calls)
    gen = torch.Generator().manual_seed(1)
    bs, width = 3, 5
    hidden = torch.randn(bs * width, 6, generator=gen)
    sources = torch.randint(0, width, (bs, width), generator=gen)
    prefix_lens = torch.tensor([3, 18, 7])
    cache_loc = torch.arange(100, 100 + bs * width)
    commit_lens = torch.tensor([2, 5, 1], dtype=torch.int32)
    graphs.commit_lens.fill_(9)  # stale lengths of an earlier, larger round
    assert graphs.append(hidden, sources, prefix_lens, cache_loc, commit_lens)
    got = calls[-1]
    rows, positions = _reference(hidden, sources, prefix_lens, width, 20)
    assert got["commit_lens"].tolist() == [2, 5, 1, 0]  # replayed at bs 4; the padded request commits nothing
    assert got["cache_loc_2d"].shape == (4, width)
    assert torch.equal(got["target_hidden"][: bs * width], rows.reshape(bs * width, -1))
    assert torch.equal(got["positions"][: bs * width], positions.reshape(-1))
    assert torch.equal(got["cache_loc"][: bs * width], cache_loc)


def test_rounds_no_graph_covers_append_eagerly():
    calls = []
    graphs = _graphs(calls)
    five = torch.zeros(5, 3, dtype=torch.int64)
    assert not graphs.append(
        torch.randn(15, 6), five, torch.zeros(5), torch.zeros(15), torch.ones(5)
    )  # bs 5 > 4
    sources = torch.zeros(2, 4, dtype=torch.int64)
    assert not graphs.append(
        torch.randn(8, 6), sources, torch.zeros(2), torch.zeros(8), torch.ones(2)
    )  # width 4
    other_dtype = torch.randn(6, 6, dtype=torch.float64)
    assert not graphs.append(
        other_dtype, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2), torch.zeros(6), torch.ones(2)
    )
    assert calls == []


class _RegrowingHelper:
    """SGLang's fused KV helper as the graphs see it: stacked weights, and a workspace kept
    between calls that a call with more rows replaces (the old one freed)."""

    def __init__(self, features, device):
        self.weight = torch.full((features,), 2.0, device=device)
        self._proj_workspace = torch.zeros(1, features, device=device)

    def materialize(self, hidden, out, cache_loc):
        if hidden.shape[0] > self._proj_workspace.shape[0]:
            self._proj_workspace = torch.zeros(2 * hidden.shape[0], hidden.shape[1], device=hidden.device)
        rows = self._proj_workspace[: hidden.shape[0]]
        torch.mul(hidden, self.weight, out=rows)
        out[cache_loc] = rows


class _FusedWorker:
    def __init__(self, features, device):
        self._fused_kv_helper = _RegrowingHelper(features, device)
        self.pool = torch.zeros(64, features, device=device)

    def append(self, *, target_hidden, cache_loc, cache_loc_2d, positions, commit_lens):
        self._fused_kv_helper.materialize(target_hidden, self.pool, cache_loc)


def test_held_by_append_keeps_the_fused_paths_weights_and_its_workspace_of_now():
    worker = _FusedWorker(6, "cpu")
    workspace, weight = worker._fused_kv_helper._proj_workspace, worker._fused_kv_helper.weight
    held = held_by_append(worker.append)
    worker._fused_kv_helper.materialize(torch.ones(9, 6), worker.pool, torch.arange(9))  # a longer prefill
    worker._fused_kv_helper = None  # SGLang drops the helper after a failed eager call
    assert any(t is workspace for t in held) and any(t is weight for t in held)
    assert held_by_append(lambda **kw: None) == []  # the per-layer path keeps nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_replay_on_their_workspace_after_a_prefill_replaced_it():
    features, device = 6, "cuda"
    worker = _FusedWorker(features, device)
    graphs = DraftKVGraphs(
        worker.append, features, torch.float32, [1, 2], [3], last_position=60, device=device
    )
    graphs.capture()
    captured = worker._fused_kv_helper._proj_workspace
    worker.append(  # an eager prefill of more rows than any graph: the helper's workspace is replaced
        target_hidden=torch.ones(40, features, device=device), cache_loc=torch.arange(40, device=device),
        cache_loc_2d=None, positions=None, commit_lens=None,
    )  # fmt: skip
    assert worker._fused_kv_helper._proj_workspace is not captured
    assert any(t is captured for t in graphs.held)
    filler = [torch.full((4096, features), 7.0, device=device) for _ in range(64)]  # reuse freed memory
    hidden = torch.randn(6, features, device=device)
    sources = torch.tensor([[0, 1, 2], [2, 1, 0]], device=device)
    assert graphs.append(hidden, sources, torch.tensor([3, 9], device=device), torch.arange(50, 56, device=device),
                         torch.tensor([3, 3], dtype=torch.int32, device=device))  # fmt: skip
    torch.cuda.synchronize()
    rows, _ = committed_rows(hidden, sources, torch.tensor([3, 9], device=device), 3, 60)
    assert torch.equal(worker.pool[50:56], 2.0 * rows.reshape(6, -1))
    assert all(bool((f == 7.0).all()) for f in filler)


def test_a_decoding_steps_replay_commits_every_root_at_its_position():
    calls = []
    graphs = _graphs(calls)
    graphs.widths.append(1)
    graphs.graphs |= {(b, 1): type(graphs.graphs[(b, 3)])(b, 1) for b in graphs.batch_sizes}
    hidden = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([3, 20, 7])  # clamped by the step already
    cache_loc = torch.tensor([40, 41, 42])
    graphs.commit_lens.fill_(9)  # stale lengths of an earlier round
    assert graphs.append_roots(hidden, positions, cache_loc)
    got = calls[-1]
    assert got["commit_lens"].tolist() == [1, 1, 1, 0]  # replayed at bs 4
    assert got["cache_loc_2d"].shape == (4, 1)
    assert torch.equal(got["target_hidden"][:3], hidden)
    assert torch.equal(got["positions"][:3], positions) and torch.equal(got["cache_loc"][:3], cache_loc)
    assert not graphs.append_roots(torch.randn(5, 6), torch.zeros(5), torch.zeros(5))  # bs 5 > 4
    graphs.graphs = {k: v for k, v in graphs.graphs.items() if k[1] != 1}
    assert not graphs.append_roots(hidden, positions, cache_loc)  # no width-1 graph captured
    assert len(calls) == 1


def test_decoding_steps_write_their_commit_lengths_once_and_again_after_a_round():
    calls = []
    graphs = _graphs(calls)
    graphs.widths.append(1)
    graphs.graphs |= {(b, 1): type(graphs.graphs[(b, 3)])(b, 1) for b in graphs.batch_sizes}

    def decoding_step(bs):
        assert graphs.append_roots(torch.randn(bs, 6), torch.arange(bs), torch.arange(30, 30 + bs))
        return calls[-1]["commit_lens"].tolist()

    assert decoding_step(3) == [1, 1, 1, 0]
    assert decoding_step(3) == [1, 1, 1, 0]
    assert decoding_step(1) == [1]
    assert decoding_step(3) == [1, 1, 1, 0]
    # a round of width 3 writes its own commit lengths (row 1 commits nothing, padded row 2 too)
    assert graphs.append(torch.randn(6, 6), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 4]),
                         torch.arange(60, 66), torch.tensor([2, 0], dtype=torch.int32))  # fmt: skip
    assert calls[-1]["commit_lens"].tolist() == [2, 0]
    assert decoding_step(3) == [1, 1, 1, 0]  # the batch size of the steps before the round
    assert decoding_step(4) == [1, 1, 1, 1]
