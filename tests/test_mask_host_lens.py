"""The flat verify mask is sized on the host without reading the device: from the
scheduler's host lengths when it keeps them, else from the round's KV reservation."""

from types import SimpleNamespace

import torch

from sglang_ddtree.adapter.verify_input import prefix_lens_bound_cpu


def _batch(seq_lens, seq_lens_cpu=None):
    return SimpleNamespace(seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens_cpu)


def test_host_lengths_when_the_scheduler_keeps_them():
    host = torch.tensor([5, 9])
    got = prefix_lens_bound_cpu(
        _batch([5, 9], host), SimpleNamespace(nxt_kv_lens_cpu=torch.tensor([99, 99])), 64
    )
    assert got is host


def test_reservation_bounds_the_prefix_clamped_at_the_context():
    # Under overlap the host has no lengths; the reservation buffer may be longer than the batch.
    reserved = torch.tensor([21, 80, 7, 1000])
    got = prefix_lens_bound_cpu(_batch([5, 63, 7]), SimpleNamespace(nxt_kv_lens_cpu=reserved), 64)
    assert got.tolist() == [21, 64, 7]
    assert torch.all(got >= torch.tensor([5, 63, 7]))


def test_nothing_on_the_host():
    assert prefix_lens_bound_cpu(_batch([5]), SimpleNamespace(nxt_kv_lens_cpu=None), 64) is None
