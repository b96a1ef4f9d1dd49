"""The switch of width-1 steps to SGLang's own decode steps (``adapter/plain_steps.py``): which
steps may leave the speculative frame, where each request's root sits, and the way back. The
serving tests (``test_serving_online_budget.py``, ``test_serving_greedy.py``,
``test_serving_features.py``) run it through real servers; these pin the bookkeeping a server
rarely reaches, such as an in-frame step whose result the scheduler processed before the next
step was prepared (an iteration that launched nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_ddtree.adapter.plain_steps import PlainSteps


class Request:  # hashed by identity, as SGLang's Req
    def __init__(self, committed: int):
        self.kv = SimpleNamespace(kv_committed_len=committed)


request = Request


def batch_of(reqs, **features):
    draft_input = SimpleNamespace(
        nxt_kv_lens_cpu=torch.tensor([9] * len(reqs)), nxt_kv_lens_sum=9 * len(reqs)
    )
    fields = {"has_grammar": False, "return_logprob": False, "return_hidden_states": False}
    fields["sampling_info"] = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False))
    return SimpleNamespace(
        reqs=list(reqs),
        device="cpu",
        spec_info=draft_input,
        spec_algorithm=SpeculativeAlgorithm.DFLASH,
        seq_lens=None,
        seq_lens_cpu=None,
        seq_lens_sum=None,
        **{**fields, **features},
    )


@pytest.fixture
def plain():
    # the bookkeeping alone: no scheduler hooks installed
    return PlainSteps(enabled=False, last_position=1000)


def test_the_first_width_1_step_after_a_round_or_prefill_stays_in_the_frame(plain):
    batch = batch_of([request(10), request(20)])
    assert not plain.allows(batch)  # nothing ran yet
    plain.enabled = True
    plain.ran(batch, in_frame_result=object())
    assert plain.allows(batch)
    plain.ran(None)  # a round (or a prefill) ran: the host does not know the lengths
    assert not plain.allows(batch)


def test_only_the_requests_of_the_last_step_and_no_feature_whose_result_path_differs(plain):
    plain.enabled = True
    old = [request(10), request(20)]
    plain.ran(batch_of(old), in_frame_result=object())
    assert plain.allows(batch_of(old[1:]))  # a request finished: still known
    assert not plain.allows(batch_of(old + [request(5)]))  # a request joined
    for feature in ("has_grammar", "return_logprob", "return_hidden_states"):
        assert not plain.allows(batch_of(old, **{feature: True})), feature
    assert not plain.allows(batch_of(old, hisparse_coordinator=object()))
    # penalties are the worker's own, per path: plain decoding's sampler would apply SGLang's
    penalised = batch_of(old)
    penalised.sampling_info.penalizer_orchestrator.is_required = True
    for req in old:
        req.sampling_params = SimpleNamespace(
            frequency_penalty=0.5, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0
        )
    assert not plain.allows(penalised)


@pytest.mark.parametrize("queued", [True, False])
def test_each_root_sits_past_the_committed_length_and_its_in_frame_step(plain, queued):
    """After an in-frame decoding step the root is one past the committed length while that
    step's result waits in the queue, and at it once the result was processed (the +1 landed)."""
    plain.enabled = True
    reqs = [request(10), request(20)]
    frame_result = object()
    plain.ran(batch_of(reqs), in_frame_result=frame_result)
    if not queued:  # processed before this step was prepared
        for req in reqs:
            req.kv.kv_committed_len += 1
    batch = batch_of(reqs)
    draft_input = batch.spec_info
    plain.convert(batch, future_map="map", queued_results=[frame_result] if queued else [])
    assert batch.seq_lens_cpu.tolist() == [11, 21] and batch.seq_lens.tolist() == [11, 21]
    assert batch.seq_lens_sum == 32
    # the forward's lengths count the root, as plain decoding's after its prepare
    forward = plain.forward_lens
    assert forward.host.tolist() == [12, 22] and forward.device.tolist() == [12, 22] and forward.total == 34
    assert batch.spec_info is None and batch.spec_algorithm.is_none() and plain.is_plain(batch)
    # the root counted now; the in-frame step's +1 lands with its result (or landed): 12 and 22
    final = [req.kv.kv_committed_len + (1 if queued else 0) for req in reqs]
    assert final == [12, 22]
    plain.restore()
    assert batch.spec_info is draft_input and batch.spec_algorithm is SpeculativeAlgorithm.DFLASH
    assert draft_input.nxt_kv_lens_cpu is None  # unprepared, as a speculative step's next input
    assert not plain.is_plain(batch)


def test_a_plain_step_after_a_plain_step_starts_at_the_committed_length(plain):
    plain.enabled = True
    reqs = [request(10)]
    plain.ran(batch_of(reqs), in_frame_result=object())
    batch = batch_of(reqs)
    plain.convert(batch, future_map="map", queued_results=[])
    plain.restore()
    plain.ran(batch)  # the plain step launched: its root is counted already
    second = batch_of(reqs)
    plain.convert(second, future_map="map", queued_results=[object()])
    assert second.seq_lens_cpu.tolist() == [11] and reqs[0].kv.kv_committed_len == 12


def test_a_root_past_the_last_position_stays_in_the_frame(plain):
    """The frame's decoding step clamps such a root's position; a plain step would not."""
    plain.enabled, plain.last_position = True, 20
    reqs = [request(10), request(20)]
    plain.ran(batch_of(reqs), in_frame_result=object())
    batch = batch_of(reqs)
    assert plain.convert(batch, future_map="map", queued_results=[]) is True  # roots at 10 and 20
    plain.restore()
    plain.ran(batch)
    later = batch_of(reqs)  # now at 11 and 21
    assert plain.convert(later, future_map="map", queued_results=[]) is False
    assert later.spec_info is not None and later.seq_lens is None and not plain.is_plain(later)
    assert [req.kv.kv_committed_len for req in reqs] == [11, 21]  # untouched
