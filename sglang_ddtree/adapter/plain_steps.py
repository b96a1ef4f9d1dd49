"""Width-1 steps of the online budget as SGLang's own decode steps (patches/0005).

A step the online budget runs at width 1 without the drafter is a decoding step
(``decode_step.py``), but inside SGLang's speculative frame it still pays what every spec-v2
step pays and plain decoding does not: the batch's full snapshot and restore around the worker,
the lengths relay (an event wait and a gather, a host copy where the attention needs host
lengths), the bonus relay, the accept lengths' copy to the host and their bookkeeping. A batch
whose ``spec_algorithm`` is none skips all of it: ``Scheduler.run_batch`` still calls the same
worker, then publishes ``seq_lens + 1``, relays the sampled tokens into the buffer the next
speculative step reads its bonus tokens from, and copies only the tokens; its result is
processed as plain decoding's.

So the worker chooses each step's width when the scheduler has prepared the step (an AROUND
hook on ``Scheduler.update_running_batch``, overlap only), and where the step is width 1
without the drafter and the host knows every request's length, hands the scheduler a
non-speculative batch for it (:meth:`PlainSteps.convert`). The host knows the lengths after a
step that emitted exactly one token per request (a decoding step or a plain one): under overlap
step N+1 is prepared before step N's result lands, and only such a step N leaves no unknown.
So the first width-1 step after a drafted one runs in the frame, the ones after it plainly.

What the conversion sets, per request, where the step's root sits (``L``: the committed length
plus the in-frame step still in flight):

* the batch's lengths are the prefix lengths ``L``, on the host and the device, as a speculative
  step's are; the scheduler publishes ``L + 1`` after the step, which is what the next
  speculative step reads back from the future map;
* the KV slot is the one the speculative reservation holds at ``L`` (the reservation, made by
  SGLang's speculative prepare before the conversion, holds two verify windows past the
  committed length); nothing is allocated, and ``kv_committed_len`` counts the root now, as
  plain decoding's allocation does (the reservation's top-up reads it);
* the draft input is parked and ``spec_algorithm`` set to none; before the scheduler touches
  the batch again (``Scheduler.get_next_batch_to_run``, the second hook) both are put back, so
  every filter, merge, memory check and retraction sees a speculative batch.

The worker runs the step as plain decoding's own (``DecodeStep._plain_step``): the target
worker's forward batch, forward and sampler, on the batch lent plain decoding's lengths (the
root counted: :attr:`PlainSteps.forward_lens`, copied with the prefix lengths) and each root's
reserved slot, in width 1's decode graphs, which also append the roots' drafter KV. So the
step's host work is plain decoding's, and its token is plain decoding's sampler's.

Plain steps are taken only where plain decoding's result path serves the batch as the frame
would: no grammar (its FSM advances in a different place), no log-probs or hidden states (the
result formats differ), no penalties (the worker keeps them per path, ``penalties.py``; SGLang's
sampler would apply its own, which a speculative batch does not keep), no HiSparse; SGLang's
overlap scheduler, tensor-parallel size 1 (the online budget's own condition), no disaggregated
serving; every root within the RoPE tables. Everything else runs in the frame as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils.common import is_pin_memory_available

from .request_features import penalised_rows


class ForwardLens(NamedTuple):
    """A plain step's lengths as plain decoding's forward takes them: each request's prefix
    and its root, on the device and the host, and their sum."""

    device: torch.Tensor
    host: torch.Tensor
    total: int


class PlainSteps:
    """Which width-1 steps leave the speculative frame, and the batch that left it (one per
    worker)."""

    def __init__(self, enabled: bool, last_position: int):
        self.enabled = enabled  # the online budget serves, and the environment did not turn them off
        self.last_position = last_position  # the last position the target's RoPE tables hold
        if enabled:
            _serving[0] = True
        self.rows: set | None = None  # the last step's requests, where it emitted one token each
        # That step's result where it ran in the speculative frame: its +1 reaches
        # kv_committed_len when the scheduler processes it, which may be before or after the next
        # step is prepared (an iteration that launches nothing processes it early).
        self.in_frame_result = None
        self.parked = None  # (batch, draft input, algorithm) of a batch running a plain step
        self.forward_lens: ForwardLens | None = None  # that step's lengths, its root counted
        self.future_map = None  # the scheduler's: a plain step's roots are in its token buffer
        self.steps = 0  # plain steps run

    def summary(self) -> dict:
        """For the stats log line."""
        return {"plain_steps": self.steps} if self.enabled else {}

    def ran(self, batch=None, in_frame_result=None) -> None:
        """The step just launched emitted one token per request of ``batch`` (None: it did not,
        or another batch ran); ``in_frame_result``: its result, where it ran in the frame."""
        self.rows = None if batch is None or not self.enabled else set(batch.reqs)
        self.in_frame_result = in_frame_result

    def allows(self, batch) -> bool:
        """Whether a width-1 step of ``batch`` may run as a plain decode step (module
        docstring)."""
        rows = self.rows
        if rows is None or batch.has_grammar or batch.return_logprob or batch.return_hidden_states:
            return False
        if getattr(batch, "hisparse_coordinator", None) is not None or penalised_rows(batch):
            return False
        return all(req in rows for req in batch.reqs)

    def convert(self, batch, future_map, queued_results) -> bool:
        """Make ``batch``, prepared as a speculative step, this step's plain one; False (the
        batch untouched) where a root would sit past the last position (the step stays in the
        frame, whose decoding step clamps it). ``queued_results``: the results the scheduler
        has not processed yet."""
        frame = self.in_frame_result
        pending = 1 if frame is not None and any(result is frame for result in queued_results) else 0
        lens = [int(req.kv.kv_committed_len) + pending for req in batch.reqs]
        if max(lens) > self.last_position:
            return False
        for req in batch.reqs:
            req.kv.kv_committed_len += 1  # the root, whose KV this step writes
        # The prefix lengths and the forward's (the root counted), in one copy; pinned, so the
        # copy to the device (on the scheduler's stream) leaves the host at once.
        pin = is_pin_memory_available(batch.device)
        host = torch.tensor([lens, [n + 1 for n in lens]], dtype=torch.int64, pin_memory=pin)
        prefix, forward = host.to(batch.device, non_blocking=True).unbind(0)  # (unbind: no __iter__)
        prefix_cpu, forward_cpu = host.unbind(0)
        total = sum(lens)
        batch.seq_lens_cpu, batch.seq_lens, batch.seq_lens_sum = prefix_cpu, prefix, total
        self.forward_lens = ForwardLens(forward, forward_cpu, total + len(lens))
        self.parked = (batch, batch.spec_info, batch.spec_algorithm)
        batch.spec_info = None
        batch.spec_algorithm = SpeculativeAlgorithm.NONE
        self.future_map = future_map
        return True

    def is_plain(self, batch) -> bool:
        """Whether ``batch`` is the one converted for this step."""
        return self.parked is not None and self.parked[0] is batch and batch.spec_info is None

    @property
    def algorithm(self):
        """The parked batch's speculative algorithm (its forward runs as the frame's would)."""
        return self.parked[2]

    def restore(self) -> None:
        """Give the batch that ran a plain step its speculative state back."""
        if self.parked is None:
            return
        batch, draft_input, algorithm = self.parked
        self.parked = None
        # As a step's next draft input comes back from a speculative step: not prepared yet (a
        # prefill's draft input merged into it has no reservation bound either).
        draft_input.nxt_kv_lens_cpu = draft_input.nxt_kv_lens_sum = None
        batch.spec_info, batch.spec_algorithm = draft_input, algorithm


# Whether this process's worker takes plain steps (set by it): until then every hook passes through.
_serving = [False]


def _ddtree_worker(scheduler):
    """The scheduler's DDTREE worker where it runs plain steps, else None."""
    if not _serving[0]:
        return None
    worker = getattr(scheduler, "draft_worker", None)
    plain = getattr(worker, "plain", None)
    if plain is None or not plain.enabled or not getattr(scheduler, "enable_overlap", False):
        return None
    # a disaggregated decode server runs its own loop, which may prepare a batch without the
    # hook that puts its speculative state back
    if getattr(scheduler, "disaggregation_mode", DisaggregationMode.NULL) != DisaggregationMode.NULL:
        return None
    return worker


def _queued_results(scheduler) -> list:
    """The results of launched steps the overlap scheduler has not processed yet."""
    return [result for _, result in getattr(scheduler, "result_queue", ())]


def install() -> None:
    """The scheduler hooks (module docstring), registered with the plugin's other hooks: SGLang
    applies a target's hooks once, so a hook registered after another plugin's on the same target
    would never run. In a process whose worker takes no plain steps each costs a call and a
    check per step."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def update_running_batch(original, scheduler, batch, *args, **kwargs):
        batch = original(scheduler, batch, *args, **kwargs)
        worker = _ddtree_worker(scheduler)
        if worker is not None and batch is not None and not batch.is_empty():
            worker.schedule_decode(batch, scheduler.future_map, _queued_results(scheduler))
        return batch

    def get_next_batch_to_run(original, scheduler, *args, **kwargs):
        worker = _ddtree_worker(scheduler)
        if worker is not None:
            worker.plain.restore()
        return original(scheduler, *args, **kwargs)

    def process_batch_result_decode(original, processor, batch, *args, **kwargs):
        if _serving[0] and batch.spec_algorithm.is_none():  # a plain step of a DDTREE batch
            # SGLang's decode log divides by the speculative steps it counted since its last line,
            # which a plain step's result does not count: one token a request, no draft.
            bs = batch.batch_size()
            processor.metrics_reporter.update_spec_metrics(bs, num_correct_drafts=0, num_accept_tokens=bs)
        return original(processor, batch, *args, **kwargs)

    scheduler = "sglang.srt.managers.scheduler.Scheduler"
    HookRegistry.register(f"{scheduler}.update_running_batch", update_running_batch, HookType.AROUND)
    HookRegistry.register(f"{scheduler}.get_next_batch_to_run", get_next_batch_to_run, HookType.AROUND)
    processor = (
        "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    )
    HookRegistry.register(
        f"{processor}.process_batch_result_decode", process_batch_result_decode, HookType.AROUND
    )
