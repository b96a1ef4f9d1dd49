"""The replay drafter's trace source: real, varying draws (:mod:`.draw_trace`) in place of a
fixed per-depth profile (``SGLANG_DDTREE_REPLAY_TRACE=<trace>`` beside the recording,
``SGLANG_DDTREE_REPLAY_TOKENS``; :mod:`.replay_drafter` installs it).

At a round whose root sits at offset ``o`` of a request's continuation, every depth's top-k is the
trace's: its recorded log-probs, and the replaying server's own true token (its recording of
plain's greedy continuation) at the recorded rank among the drafter's own candidates. The tree
is built from the recorded distributions and accepts what the recorded pair would have.

Which trace request: the request's row in the recording, modulo the trace's request count (the
i-th prompt of the replaying server's recording plays the i-th trace request, cycling), so a
trace of one model drives another with other prompts and tokens. Offsets count from the end of
each prompt, so prompts of different lengths align on their continuations.

An offset with no record of its own (a budget the trace did not record roots its rounds
elsewhere) takes the nearest earlier recorded offset's block, shifted: depth ``d`` of root
``o`` drafts the same token as depth ``d + (o - r)`` of the record at ``r``, so that depth's
log-probs and rank are used; depths past the recorded block are "not proposed". This replays
a miss pessimistically (a later root's own draws would see more context). Offsets past the
trace's continuation, and requests off their recording, get the drafter's own proposals.
Every round is counted as exact, shifted or off the trace (the replay's log line).
"""

from __future__ import annotations

import torch

from lab.bench.draw_trace import FORMAT
from lab.bench.replay_drafter import Recording, ReplayDrafter
from lab.bench.replay_profiles import LOG_FLOOR, place_true_token

EXACT, SHIFTED, OFF_TRACE = 0, 1, 2


def resolve_offsets(offsets: list[int], length: int) -> tuple[list[int], list[int]]:
    """Per offset ``0..length-1``: the index in ``offsets`` (sorted) of the nearest recorded
    offset at or before it (-1: none) and how far before it lies (the shift)."""
    records, shifts, at = [], [], -1
    for o in range(length):
        while at + 1 < len(offsets) and offsets[at + 1] <= o:
            at += 1
        records.append(at)
        shifts.append(o - offsets[at] if at >= 0 else 0)
    return records, shifts


class TraceTables:
    """A trace as device tables: every record's ``[depth, k]`` log-probs and ``[depth]`` ranks
    (one extra last row: none), and per (trace request, offset) the record and shift to use."""

    def __init__(self, trace: dict, k: int, device):
        if trace.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} trace: {trace.get('format')!r}")
        requests, depth = trace["requests"], int(trace["depth"])
        length = max(1, max(r["length"] for r in requests))
        n_records = sum(len(r["offsets"]) for r in requests)
        logp = torch.full((n_records + 1, depth, k), LOG_FLOOR, dtype=torch.float32)
        rank = torch.full((n_records + 1, depth), -1, dtype=torch.int64)
        at = torch.full((len(requests), length), n_records, dtype=torch.int64)
        shift = torch.zeros((len(requests), length), dtype=torch.int64)
        first = 0
        for t, request in enumerate(requests):
            for j, (lp, ranks) in enumerate(zip(request["logp"], request["rank"])):
                for d, row in enumerate(lp):
                    kept = row[:k]
                    logp[first + j, d, : len(kept)] = torch.tensor(kept)
                rank[first + j] = torch.tensor(ranks)
            records, shifts = resolve_offsets(request["offsets"], request["length"])
            for o, (r, s) in enumerate(zip(records, shifts)):
                if r >= 0:
                    at[t, o], shift[t, o] = first + r, s
            first += len(request["offsets"])
        self.none = n_records
        self.depth, self.length, self.requests = depth, length, len(requests)
        self.logp, self.rank = logp.to(device), rank.to(device)
        self.at, self.shift = at.to(device), shift.to(device)

    def lookup(self, trace_rows: torch.Tensor, offsets: torch.Tensor):
        """Records ``[bs]`` (``none`` off the trace) and shifts ``[bs]`` of requests at
        ``offsets`` of trace requests ``trace_rows`` (-1: none)."""
        inside = (trace_rows >= 0) & (offsets >= 0) & (offsets < self.length)
        flat = trace_rows.clamp_min(0) * self.length + offsets.clamp(0, self.length - 1)
        records = torch.where(inside, self.at.view(-1)[flat], self.none)
        return records, torch.where(inside, self.shift.view(-1)[flat], 0)

    def draws(self, records: torch.Tensor, shifts: torch.Tensor, k: int):
        """Log-probs ``[bs, depth, k]`` and ranks ``[bs, depth]`` (``k``: not proposed) of each
        request's record, each depth shifted as the module docstring says."""
        depths = shifts[:, None] + torch.arange(self.depth, device=shifts.device)  # [bs, depth]
        inside = depths < self.depth
        depths = depths.clamp(max=self.depth - 1)
        rows = records[:, None].expand_as(depths)
        ranks = torch.where(inside, self.rank[rows, depths], -1)
        ranks = torch.where((ranks >= 0) & (ranks < k), ranks, k)
        log_probs = self.logp[rows, depths, :k]
        if log_probs.shape[-1] < k:  # a trace narrower than the ask (a recorder beside the replay)
            log_probs = torch.nn.functional.pad(log_probs, (0, k - log_probs.shape[-1]), value=LOG_FLOOR)
        return log_probs, ranks


class TraceReplayDrafter(ReplayDrafter):
    """The replay drafter on a trace (:class:`.replay_drafter.ReplayDrafter`'s recording and
    pool-slot table; profiles unused). ``k``: the widest top-k any head asks for; ``depth``: the
    drafter's (the trace's must be the same)."""

    def __init__(self, recording: Recording, trace: dict, pool_rows: int, k: int, depth: int, profile: str):
        if int(trace["depth"]) != depth:
            raise ValueError(f"the trace drafts {trace['depth']} depths, this drafter {depth}")
        super().__init__(recording, profile, pool_rows)  # its profiles are never drawn
        device = recording.table.device
        self.tables = TraceTables(trace, max(k, int(trace["topk"])), device)  # a recorder asks the trace's k
        self.prompt_len_of_slot = torch.zeros((pool_rows,), dtype=torch.int64, device=device)
        self._kinds = torch.zeros(3, dtype=torch.int64, device=device)  # exact, shifted, off the trace

    def _fill_slots(self, reqs) -> None:
        super()._fill_slots(reqs)
        device = self.prompt_len_of_slot.device
        slots = torch.tensor([req.kv.req_pool_idx for req in reqs], device=device)
        lens = torch.tensor([len(req.origin_input_ids) for req in reqs], device=device)
        self.prompt_len_of_slot[slots] = lens

    def replace_from_trace(self, own_log_probs, candidates, roots, prefix_lens, req_pool_indices, depth, k):
        """The drafter's own top-k log-probs ``[bs * depth, k]`` and top-(k+1) ``candidates`` ->
        the top-k log-probs and ids ``[bs * depth, k]`` the tree is built from (device only)."""
        bs = roots.shape[0]
        rows, true_ids, on_record = self._recorded(roots, prefix_lens, req_pool_indices, depth)
        records, shifts = self._lookup(rows, prefix_lens, req_pool_indices)
        log_probs, ranks = self.tables.draws(records, shifts, k)
        ids = place_true_token(candidates, true_ids.reshape(-1), ranks.view(-1), k)
        # Off the recording or past the trace: the drafter's own proposals.
        replayed = (on_record & (records != self.tables.none))[:, None].expand(bs, depth).reshape(-1, 1)
        log_probs = torch.where(replayed, log_probs.reshape(bs * depth, k), own_log_probs)
        return log_probs.contiguous(), torch.where(replayed, ids, candidates[:, :k])

    def _lookup(self, rows, prefix_lens, req_pool_indices):
        trace_rows = torch.where(rows >= 0, rows % self.tables.requests, -1)
        offsets = prefix_lens.to(torch.int64) - self.prompt_len_of_slot[req_pool_indices.to(torch.int64)]
        return self.tables.lookup(trace_rows, offsets)

    def count(self, roots, prefix_lens, req_pool_indices) -> None:
        """Per round (eager), beside the recording's drift: how many request-rounds found their
        own offset in the trace, a shifted earlier one, or none."""
        rows, _, on_record = self._recorded(roots, prefix_lens, req_pool_indices, 0)
        records, shifts = self._lookup(rows, prefix_lens, req_pool_indices)
        kind = torch.where(records == self.tables.none, OFF_TRACE, torch.where(shifts > 0, SHIFTED, EXACT))
        self._kinds += (torch.nn.functional.one_hot(kind, 3) * on_record[:, None]).sum(0)  # no host sync
        super().count(roots, prefix_lens, req_pool_indices)

    def log_line(self) -> str:
        exact, shifted, off = (int(x) for x in self._kinds.tolist())
        return f"{super().log_line()}; on the trace: {exact} exact, {shifted} shifted, {off} off it"
