"""The decode KV reservation of a DDTREE batch, topped up in chunks.

Before every decode step SGLang's speculative scheduler calls
``batch.spec_info.prepare_for_decode(batch)`` on the draft input the worker returned at the step
before. DFlash's (``DFlashDraftInputV2``) reserves a window of two verify widths past each
request's committed length (``2W`` slots, page-aligned: the round in flight, whose accepted
length the host does not know yet, and the next one), and it does so at every step: four passes
over the requests, five scratch tensors made for the new object, two host-to-device copies, the
allocator and the ``req_to_token`` kernel, even when a request needs one slot. A step of the
online budget at width 1 consumes one slot a request, so that is every step.

:class:`DDTreeDraftInput` keeps the same window but tops it up in chunks: a request whose
allocation falls short of its window gets the window plus a chunk (``2W`` more), so the steps in
between allocate nothing and do one pass over the requests. Every value the scheduler and the
worker read is what DFlash's method gives: the committed lengths (``seq_lens_cpu``), the window's
end as the host bound of the lengths (``nxt_kv_lens_cpu``), the top-k summary, the requests'
``decode_batch_idx``. Only ``kv_allocated_len`` runs ahead.

The chunk is memory the scheduler's check before the step (``check_decode_mem``) does not count:
it asks for the window alone. So a chunk is taken only where the pool's free slots hold four
times what the top-up takes, chunk included, and never past a request's ``req_to_token`` row;
otherwise the request gets its window alone, as from DFlash. The slots past the committed length
are freed with the request (SGLang frees everything allocated, ``kv_allocated_len``), retracted
with it, and counted by SGLang's idle leak check like DFlash's own reservation. A top-up runs on
the scheduler's stream (SGLang's optional plan stream, ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM``,
is not used), and under HiSparse the reservation is DFlash's window alone.

SGLang's check before the step sums, per request, the page-aligned slots its allocation lacks for
the reserve (``ScheduleBatch._new_tokens_required_next_decode_spec_v2``), two ``ceil_align`` calls a
request even where the allocation already holds the reserve, as it does for nearly every request
of a DDTREE batch between top-ups. :func:`install` gives that sum to :func:`slots_short`, which
skips those requests: the same total, with less host work a step at every batch size
(``patches/0006``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.utils.common import ceil_align, is_pin_memory_available

# A chunk is taken only while the pool's free slots hold this many times the top-up.
FREE_SLOTS_PER_TOP_UP = 4


class Reservation:
    """The worker's reservation policy and its counters (shared by every draft input it makes)."""

    def __init__(self, num_draft_tokens: int):
        self.window = 2 * int(num_draft_tokens)  # what DFlash reserves past the committed length
        self.chunk = self.window  # how far past the window a top-up reaches
        self.steps = 0  # decode steps prepared
        self.top_ups = 0  # of them, steps that allocated
        self.chunked = 0  # top-ups that took the chunk (the rest: the window alone)
        self._empty_extras: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        _serving[0] = True

    def empty_extras(self, bs: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The draft input's ``(topk_p, topk_index, hidden_states)`` of ``bs`` requests: DDTREE
        relays none of them, so each is ``[bs, 0]``, made once per size (nothing writes into a
        tensor without elements; filtering and merging make new ones)."""
        key = (bs, device)
        extras = self._empty_extras.get(key)
        if extras is None:
            extras = self._empty_extras[key] = (
                torch.empty((bs, 0), device=device, dtype=torch.float32),
                torch.empty((bs, 0), device=device, dtype=torch.int64),
                torch.empty((bs, 0), device=device, dtype=torch.float16),
            )
        return extras

    def prepare(self, draft_input: DDTreeDraftInput, batch) -> None:
        """``DFlashDraftInputV2.prepare_for_decode``'s reservation and host values (module
        docstring), allocating only for requests whose window is not held yet."""
        bs = batch.batch_size()
        if bs == 0:
            return
        batch.maybe_evict_swa()
        page = batch.token_to_kv_pool_allocator.page_size
        committed, bounds, allocated, short, top_ks = [], [], [], [], set()
        for i, req in enumerate(batch.reqs):
            kv = req.kv
            done = int(kv.kv_committed_len)
            bound = -(-(done + self.window) // page) * page
            committed.append(done)
            bounds.append(bound)
            allocated.append(kv.kv_allocated_len)
            if kv.kv_allocated_len < bound:
                short.append(i)
            top_ks.add(int(req.sampling_params.top_k))
            req.decode_batch_idx += 1
        self.steps += 1
        if short:
            self._top_up(batch, short, bounds, allocated, page)
        draft_input.max_top_k = max(1, *top_ks)
        draft_input.uniform_top_k_value = top_ks.pop() if len(top_ks) == 1 else None
        # Seed committed; overlap's resolve overwrites it with the published value (as DFlash).
        batch.seq_lens_cpu = torch.tensor(committed, dtype=torch.int64)
        batch.seq_lens_sum = sum(committed)
        draft_input.nxt_kv_lens_cpu = torch.tensor(bounds, dtype=torch.int32)
        draft_input.nxt_kv_lens_sum = sum(bounds)

    def _top_up(self, batch, short: list[int], bounds: list[int], allocated: list[int], page: int) -> None:
        """Allocates the ``short`` requests' windows, with a chunk each where the pool has room."""
        row_end = int(batch.req_to_token_pool.req_to_token.shape[1]) // page * page
        chunk = -(-self.chunk // page) * page
        targets = list(allocated)
        for i in short:
            targets[i] = bounds[i]
        chunked = list(targets)
        for i in short:  # the window's end is within the row (patches/0004); the chunk may not be
            chunked[i] = max(bounds[i], min(bounds[i] + chunk, row_end))
        held = sum(allocated)
        needed, with_chunks = sum(targets) - held, sum(chunked) - held
        allocator = batch.token_to_kv_pool_allocator
        roomy = allocator.available_size() >= FREE_SLOTS_PER_TOP_UP * with_chunks
        # HiSparse binds reserved slots to its own pages: its reservation stays DFlash's.
        if with_chunks > needed and roomy and getattr(batch, "hisparse_coordinator", None) is None:
            targets, needed, self.chunked = chunked, with_chunks, self.chunked + 1
        self.top_ups += 1
        pin = is_pin_memory_available(batch.device)
        cur_cpu = torch.tensor(allocated, dtype=torch.int32, pin_memory=pin)
        nxt_cpu = torch.tensor(targets, dtype=torch.int32, pin_memory=pin)
        alloc_for_spec_decode(
            batch.tree_cache,
            batch.req_to_token_pool,
            reqs=batch.reqs,
            req_pool_indices=batch.req_pool_indices,
            cur_kv_lens=cur_cpu.to(batch.device, non_blocking=True),
            cur_kv_lens_cpu=cur_cpu,
            nxt_kv_lens=nxt_cpu.to(batch.device, non_blocking=True),
            nxt_kv_lens_cpu=nxt_cpu,
            num_needed_tokens=needed,
            batch=batch,
        )

    def summary(self) -> dict:
        """For the stats log line: how often a step allocated."""
        return {"reservation": {"steps": self.steps, "top_ups": self.top_ups, "chunked": self.chunked}}


@dataclass
class DDTreeDraftInput(DFlashDraftInputV2):
    """DFlash's draft input whose decode reservation is the worker's :class:`Reservation`."""

    reservation: Reservation | None = None

    @classmethod
    def make(cls, reservation: Reservation, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor):
        """As SGLang's ``make_draft_input_v2``, with the worker's reservation."""
        topk_p, topk_index, hidden_states = reservation.empty_extras(
            int(new_seq_lens.numel()), bonus_tokens.device
        )
        return cls(
            topk_p=topk_p,
            topk_index=topk_index,
            bonus_tokens=bonus_tokens.to(dtype=torch.int64),
            new_seq_lens=new_seq_lens.to(dtype=torch.int64),
            hidden_states=hidden_states,
            reservation=reservation,
        )

    def prepare_for_decode(self, batch) -> None:
        if self.reservation is None:  # made by SGLang itself (an idle input)
            return super().prepare_for_decode(batch)
        self.reservation.prepare(self, batch)


class NextDraftInputs:
    """The draft inputs the worker hands the scheduler (mixed into ``DDTreeWorker``): each carries
    the worker's :class:`Reservation`."""

    reservation: Reservation

    def _next_draft_input(self, bonus_tokens, new_seq_lens) -> DDTreeDraftInput:
        """The draft input of the next step: its ``prepare_for_decode`` is the reservation."""
        return DDTreeDraftInput.make(self.reservation, bonus_tokens, new_seq_lens)

    def _make_next_draft_input_prefill(self, *, bonus_tokens, seq_lens) -> DDTreeDraftInput:
        """DFlash's prefill hands over the draft input of the first decode step."""
        return self._next_draft_input(bonus_tokens, seq_lens)

    def _idle_result(self, on_publish):
        """An idle pass's result: no tokens, an empty draft input."""
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        draft = self._next_draft_input(empty, empty)
        if on_publish is not None:
            on_publish(draft.new_seq_lens)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=empty, accept_lens=empty.to(torch.int32), next_draft_input=draft,
            can_run_cuda_graph=False, speculative_num_draft_tokens=self.width, new_seq_lens=draft.new_seq_lens,
        )  # fmt: skip


def slots_short(requests, page_size: int, reserve: int) -> int:
    """The KV slots SGLang's speculative memory check asks for: per request, the slots between its
    allocation's end and its committed length plus ``reserve`` (both ends page-aligned), where
    the allocation falls short; a request that holds the reserve adds nothing, so it is skipped
    without the arithmetic (``_new_tokens_required_next_decode_spec_v2``'s sum, term by term)."""
    total = 0
    for req in requests:
        kv = req.kv
        held, needed = kv.kv_allocated_len, kv.kv_committed_len + reserve
        if needed > held:
            total += ceil_align(needed, page_size) - ceil_align(held, page_size)
    return total


# Whether this process serves DDTREE (set by its worker's reservation): until then the hook passes through.
_serving = [False]


def install() -> None:
    """The speculative memory check's sum as :func:`slots_short` (module docstring; patches/0006),
    registered with the plugin's other hooks."""
    from sglang.srt.managers import schedule_batch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def new_tokens_required(original, batch, requests, page_size):
        if not _serving[0]:
            return original(batch, requests, page_size)
        # the reserve as SGLang's method reads it (its module's name, read at each call)
        return slots_short(requests, page_size, schedule_batch.get_alloc_reserve_per_decode())

    target = "sglang.srt.managers.schedule_batch.ScheduleBatch._new_tokens_required_next_decode_spec_v2"
    HookRegistry.register(target, new_tokens_required, HookType.AROUND)
