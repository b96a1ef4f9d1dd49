"""The decode KV reservation in chunks (``adapter/reservation.py``) against SGLang's own
(``DFlashDraftInputV2.prepare_for_decode``), step by step on the same requests.

Both run on a batch of requests whose committed lengths advance as rounds accept; SGLang's
allocation call is replaced by one that records what it was asked and sets the requests'
``kv_allocated_len`` as the real one does. What every reader sees (the committed lengths, the
host bound of the lengths, the top-k summary, ``decode_batch_idx``) must be SGLang's at every
step; each request's allocation must cover SGLang's window and stay in its row; steps that
allocate must be rarer; without room for a chunk the allocation must be SGLang's exactly.

Through the real server, every DDTREE test runs this reservation (SGLang's strict idle leak
check after aborts, requests ending at the context limit at page sizes 1 and 16, width 1:
``test_serving_greedy.py``), and the width-1 server's stats count its top-ups
(``test_serving_online_budget.py``)."""

from __future__ import annotations

import random
import types

import pytest
import sglang.srt.speculative.dflash_info_v2 as dflash_info_v2
import torch

import sglang_ddtree.adapter.reservation as reservation
from sglang_ddtree.adapter.reservation import FREE_SLOTS_PER_TOP_UP, DDTreeDraftInput, Reservation

WIDTH = 9  # verify width: the window is 18 slots
ROW = 200  # req_to_token row length


class _Allocator:
    def __init__(self, page_size: int, free: int):
        self.page_size, self.free = page_size, free

    def available_size(self) -> int:
        return self.free


def _batch(page_size: int, committed: list[int], free: int, top_ks=None):
    reqs = [
        types.SimpleNamespace(
            kv=types.SimpleNamespace(kv_committed_len=c, kv_allocated_len=c),
            sampling_params=types.SimpleNamespace(top_k=(top_ks or [1] * len(committed))[i]),
            decode_batch_idx=0,
        )
        for i, c in enumerate(committed)
    ]
    batch = types.SimpleNamespace(
        reqs=reqs,
        device="cpu",
        token_to_kv_pool_allocator=_Allocator(page_size, free),
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(len(reqs), ROW, dtype=torch.int32)),
        tree_cache=None,
        req_pool_indices=torch.arange(len(reqs)),
        hisparse_coordinator=None,
        seq_lens_cpu=None,
        seq_lens_sum=None,
        calls=[],
    )
    batch.batch_size = lambda: len(batch.reqs)
    batch.maybe_evict_swa = lambda: None
    return batch


def _fake_alloc(
    tree_cache, req_to_token_pool, *, reqs, nxt_kv_lens_cpu, cur_kv_lens_cpu, num_needed_tokens, batch, **_
):
    """SGLang's allocation as the reservation sees it: the slots asked for, then the requests'
    ``kv_allocated_len`` (the real one's last loop)."""
    cur, nxt = cur_kv_lens_cpu.tolist(), nxt_kv_lens_cpu.tolist()
    assert num_needed_tokens == sum(nxt) - sum(cur) >= 0
    batch.calls.append((cur, nxt))
    if num_needed_tokens:
        batch.token_to_kv_pool_allocator.free -= num_needed_tokens
    for req, n in zip(reqs, nxt, strict=True):
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, n)


@pytest.fixture
def both(monkeypatch):
    monkeypatch.setattr(dflash_info_v2, "alloc_for_spec_decode", _fake_alloc)
    monkeypatch.setattr(reservation, "alloc_for_spec_decode", _fake_alloc)
    monkeypatch.setattr(
        dflash_info_v2, "get_spec", lambda: types.SimpleNamespace(speculative_num_draft_tokens=WIDTH)
    )


def _sglang_input():
    empty = torch.empty(0)
    return dflash_info_v2.DFlashDraftInputV2(
        topk_p=empty, topk_index=empty, bonus_tokens=empty, new_seq_lens=empty, hidden_states=empty
    )


def _run(page_size: int, free: int, steps: int, accept, committed=None, top_ks=None):
    """Both reservations over ``steps`` rounds; returns (ours, SGLang's) batches and ours."""
    committed = committed or [5, 17, 40, 63]
    ours, theirs = (_batch(page_size, committed, free, top_ks) for _ in range(2))
    policy = Reservation(WIDTH)
    rng = random.Random(0)
    for _ in range(steps):
        mine = DDTreeDraftInput.make(policy, torch.empty(0), torch.empty(len(committed)))
        mine.prepare_for_decode(ours)
        reference = _sglang_input()
        reference.prepare_for_decode(theirs)
        assert ours.seq_lens_cpu.tolist() == theirs.seq_lens_cpu.tolist()
        assert ours.seq_lens_sum == theirs.seq_lens_sum
        assert mine.nxt_kv_lens_cpu.tolist() == reference.nxt_kv_lens_cpu.tolist()
        assert mine.nxt_kv_lens_sum == reference.nxt_kv_lens_sum
        assert (mine.max_top_k, mine.uniform_top_k_value) == (
            reference.max_top_k,
            reference.uniform_top_k_value,
        )
        for a, b in zip(ours.reqs, theirs.reqs, strict=True):
            assert a.decode_batch_idx == b.decode_batch_idx
            assert b.kv.kv_allocated_len <= a.kv.kv_allocated_len <= ROW  # SGLang's window, in the row
            assert a.kv.kv_allocated_len % page_size == 0
        accepted = [accept(rng) for _ in committed]
        for reqs in (ours.reqs, theirs.reqs):
            for req, n in zip(reqs, accepted, strict=True):
                req.kv.kv_committed_len = min(req.kv.kv_committed_len + n, ROW - 2 * WIDTH - page_size + 1)
    return ours, theirs, policy


@pytest.mark.parametrize("page_size", [1, 16])
def test_width_1_steps_allocate_in_chunks_and_read_like_sglang(both, page_size):
    ours, theirs, policy = _run(page_size, free=10**6, steps=60, accept=lambda rng: 1)
    assert len(theirs.calls) == 60  # SGLang allocates at every step (a slot, or a page)
    assert policy.steps == 60 and policy.top_ups == len(ours.calls) <= 60 // 8, policy.summary()
    assert policy.chunked == policy.top_ups


def test_rounds_that_accept_more_allocate_less_often_too(both):
    ours, theirs, policy = _run(1, free=10**6, steps=60, accept=lambda rng: rng.randint(1, WIDTH))
    assert policy.top_ups <= len(theirs.calls) // 2, policy.summary()


def test_without_room_for_a_chunk_the_allocation_is_sglangs(both):
    # a pool whose free slots hold less than four top-ups with chunks: every top-up is the window
    ours, theirs, policy = _run(1, free=FREE_SLOTS_PER_TOP_UP * 4 * 2 * WIDTH, steps=30, accept=lambda rng: 2)
    assert policy.chunked == 0 and ours.calls == theirs.calls


def test_a_chunk_stops_at_the_end_of_the_row(both):
    # a request next to its row's end (committed 150: window to 176, its chunk of two pages
    # would reach 208): the chunk is cut at the row's last whole page, the window is not
    ours, _, policy = _run(16, free=10**6, steps=1, accept=lambda rng: 1, committed=[ROW - 2 * WIDTH - 32, 3])
    assert [r.kv.kv_allocated_len for r in ours.reqs] == [ROW // 16 * 16, 32 + 32] and policy.chunked == 1


def test_the_top_k_summary_is_sglangs(both):
    _run(1, free=10**6, steps=2, accept=lambda rng: 1, top_ks=[1, 1, 1, 1])
    _run(1, free=10**6, steps=2, accept=lambda rng: 1, top_ks=[20, 1, 5, 1])


def _kv_states(rng, page_size: int, n: int) -> list:
    """Requests as SGLang's memory check reads them: allocations at, short of, or past the reserve."""
    reqs = []
    for _ in range(n):
        committed = rng.randint(0, 400)
        allocated = committed + rng.choice([0, rng.randint(0, 3 * WIDTH), rng.randint(0, 4) * page_size])
        reqs.append(
            types.SimpleNamespace(
                kv=types.SimpleNamespace(kv_committed_len=committed, kv_allocated_len=allocated)
            )
        )
    return reqs


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_the_memory_checks_sum_is_sglangs(monkeypatch, page_size):
    """``slots_short`` against SGLang's own ``_new_tokens_required_next_decode_spec_v2``, term by
    term over requests that hold the reserve, fall short of it, or end mid-page."""
    from sglang.srt.managers import schedule_batch

    sglang_sum = getattr(
        schedule_batch.ScheduleBatch._new_tokens_required_next_decode_spec_v2,
        "__wrapped__",  # SGLang's own where the plugin's hooks were applied in this process
        schedule_batch.ScheduleBatch._new_tokens_required_next_decode_spec_v2,
    )
    rng = random.Random(page_size)
    short = 0
    for _ in range(400):
        reserve = rng.choice([2, 2 * WIDTH, 2 * 65])
        monkeypatch.setattr(schedule_batch, "get_alloc_reserve_per_decode", lambda r=reserve: r)
        reqs = _kv_states(rng, page_size, rng.randint(0, 12))
        expected = sglang_sum(None, reqs, page_size)
        assert reservation.slots_short(reqs, page_size, reserve) == expected
        short += expected > 0
    assert short > 100  # the sums were not all zero


def test_the_hook_sums_only_in_a_ddtree_process(monkeypatch, registered_hooks):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    reservation.install()
    ((target, hook),) = registered_hooks
    assert hasattr(ScheduleBatch, target.rsplit(".", 1)[1])  # the method SGLang calls still exists
    calls = []

    def original(batch, requests, page_size):
        calls.append(page_size)
        return -1

    reqs = _kv_states(random.Random(0), 16, 8)
    monkeypatch.setattr(reservation, "_serving", [False])
    assert hook(original, None, reqs, 16) == -1 and calls == [16]  # not serving DDTREE: SGLang's
    Reservation(WIDTH)  # the worker's reservation marks the process
    monkeypatch.setattr("sglang.srt.managers.schedule_batch.get_alloc_reserve_per_decode", lambda: 2 * WIDTH)
    assert hook(original, None, reqs, 16) == reservation.slots_short(reqs, 16, 2 * WIDTH) and calls == [16]
