"""The drafter KV append's graph path prepares what the eager append is given.

The CUDA capture itself runs on the GPU (``tests/gpu_server``: the graph arm's verify rounds per
request equal the eager-append arm's). Here a stand-in for a captured graph runs the same
append on the graph's buffers, so everything the replay reads is checked on CPU: the
committed rows and positions, the slots, the commit lengths (0 for the padded requests).
"""

from __future__ import annotations

import torch

from sglang_ddtree.adapter.draft_kv_graphs import DraftKVGraphs, committed_rows


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
