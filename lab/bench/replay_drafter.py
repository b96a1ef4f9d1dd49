"""The replay drafter: real drafter costs, a controlled acceptance profile (benchmarks only).

With random weights (``--load-format dummy``) a drafter accepts nothing, so a benchmark of
tree speculation at real shapes needs a drafter whose acceptance is set, while every cost
stays real. This module, loaded through the test-plugin seam
(``SGLANG_DDTREE_TEST_PLUGIN=lab.bench.replay_drafter``; never in a normal launch),
takes the worker's proposal seam (``DDTreeWorker.replay_proposal``): the drafter's forward and
the LM head's top-k run as always, inside the drafter's CUDA graph as in a normal launch, then
on the device each depth's top-k is replaced by a calibrated one
(:mod:`.replay_profiles`): log-probs ``log q_d(r)`` and the target's true next token at a rank
drawn from ``q_d``, the drafter's own candidates around it.

The true next tokens come from a recording of a plain greedy run of the same model
(``SGLANG_DDTREE_REPLAY_TOKENS=<file.json>``, ``{"sequences": [[prompt..., output...]]}``,
matched by prompt). Why a recording: at draft time nothing else knows the continuation, and
the verify decides every emitted token, so a recording can steer acceptance but never the
output - greedy outputs stay the target's. Where a request leaves the recording (a bf16
near-tie decided differently in a batched verify) its later rounds simply find the recorded
tokens wrong and accept less; ``DDTREE replay`` log lines count the rounds whose root
disagreed with the recording, so a run can say how much of its acceptance was on profile.

``SGLANG_DDTREE_REPLAY_PROFILE``: a profile name of :data:`.replay_profiles.PROFILES`; a
recording may name one per sequence (``"profiles": [...]``), so that one server serves
several profiles, each on its own prompts.

``SGLANG_DDTREE_REPLAY_TRACE``: a trace of a real drafter's draws (:mod:`.draw_trace`) in place
of a profile: per round, the recorded log-probs and the true token at the recorded rank
(:mod:`.trace_replay`).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from lab.bench.replay_profiles import PROFILES, RankSampler, mix32, place_true_token

ENV_TOKENS = "SGLANG_DDTREE_REPLAY_TOKENS"
ENV_PROFILE = "SGLANG_DDTREE_REPLAY_PROFILE"
ENV_TRACE = "SGLANG_DDTREE_REPLAY_TRACE"  # a trace of real draws (trace_replay.py) in place of a profile
LOG_EVERY = 512  # rounds between drift reports (each reads two device counters)
logger = logging.getLogger("sglang_ddtree")


def recorded_row(sequences: list[list[int]], prompt: list[int]) -> int:
    """Index of the recorded sequence that continues ``prompt`` (-1: none). A longer recorded
    prompt may begin with this one (a 4k prompt tiled from the same text as a short one): the
    shortest sequence that extends ``prompt`` is the one recorded for it."""
    n = len(prompt)
    matches = [i for i, s in enumerate(sequences) if len(s) > n and s[:n] == prompt]
    return min(matches, key=lambda i: len(sequences[i]), default=-1)


class Recording:
    """Recorded greedy sequences as one padded device table, looked up by prompt."""

    def __init__(self, sequences: list[list[int]], device, profiles: list[str] | None = None):
        width = max(len(s) for s in sequences) + 1
        table = torch.full((len(sequences), width), -1, dtype=torch.int64)
        for row, sequence in enumerate(sequences):
            table[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.int64)
        self.table = table.to(device)
        self.width = width
        self._sequences = [list(s) for s in sequences]
        self.profiles = list(profiles or [])  # per sequence (optional): several profiles, one server

    def row(self, req) -> int:
        """The recorded sequence this request's prompt begins (cached on the request)."""
        cached = getattr(req, "_ddtree_replay_row", None)
        if cached is not None:
            return cached
        row = recorded_row(self._sequences, list(req.origin_input_ids))
        req._ddtree_replay_row = row
        return row

    def truth(self, rows: torch.Tensor, prefix_lens: torch.Tensor, depth: int):
        """Recorded tokens ``[bs, depth]`` after each root (-1: unknown), and whether each
        root itself matches the recording ``[bs]`` (False off the recording)."""
        positions = prefix_lens[:, None].to(torch.int64) + torch.arange(depth + 1, device=rows.device)
        safe_rows = rows.clamp_min(0)[:, None].expand_as(positions)
        tokens = self.table[safe_rows, positions.clamp(max=self.width - 1)]
        tokens = torch.where((rows[:, None] >= 0) & (positions < self.width), tokens, -1)
        return tokens[:, 1:], tokens[:, 0]


class ReplayDrafter:
    """The calibrated replacement of the drafter's top-k, from the batch's device state alone
    (capturable): the recorded row of every request-pool slot is a device table the host
    fills once per request (:meth:`register`), and each rank draw is a hash of (recorded row,
    position, depth), so one request at one position draws the same ranks in every arm."""

    def __init__(self, recording: Recording, default_profile: str, pool_rows: int):
        names = sorted({default_profile, *recording.profiles})
        unknown = [n for n in names if n not in PROFILES]
        if unknown:
            raise ValueError(f"unknown replay profile(s) {unknown}: expected one of {sorted(PROFILES)}")
        self.recording, self.names = recording, names
        device, default = recording.table.device, names.index(default_profile)
        per_row = [names.index(n) for n in recording.profiles] or [default] * recording.table.shape[0]
        # row -> profile; the extra last entry (the default) serves requests off the recording
        self.profile_of_row = torch.tensor(per_row + [default], device=device)
        self.row_of_slot = torch.full((pool_rows,), -1, dtype=torch.int64, device=device)
        self._samplers: dict[tuple[int, int], RankSampler] = {}
        self._drift = torch.zeros(2, dtype=torch.int64, device=device)
        self._rounds = 0

    def sampler(self, depth: int, k: int) -> RankSampler:
        key = (depth, k)
        if key not in self._samplers:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"DDTREE replay: no rank tables for depth {depth}, k {k} before the capture"
                )
            device = self.recording.table.device
            self._samplers[key] = RankSampler([PROFILES[n] for n in self.names], depth, k, device)
        return self._samplers[key]

    def register(self, reqs) -> None:
        """Point each request's pool slot at its recorded row (host, once per request)."""
        moved = []
        for req in reqs:
            slot = req.kv.req_pool_idx  # the request's req_to_token row (SGLang 0.5.23)
            if getattr(req, "_ddtree_replay_slot", None) != slot:
                moved.append(req)
                req._ddtree_replay_slot = slot
        if moved:
            self._fill_slots(moved)

    def _fill_slots(self, reqs) -> None:
        device = self.row_of_slot.device
        slots = torch.tensor([req.kv.req_pool_idx for req in reqs], device=device)
        self.row_of_slot[slots] = torch.tensor([self.recording.row(req) for req in reqs], device=device)

    def replace(self, candidates, roots, prefix_lens, req_pool_indices, depth: int, k: int):
        """The drafter's top-(k+1) ``candidates`` ``[bs * depth, k+1]`` -> top-k log-probs
        and ids ``[bs * depth, k]`` of the calibrated drafter (device work only)."""
        bs = roots.shape[0]
        rows, true_ids, on_record = self._recorded(roots, prefix_lens, req_pool_indices, depth)
        profile_ids = self.profile_of_row[torch.where(rows >= 0, rows, self.profile_of_row.shape[0] - 1)]
        # Off the recording (or past its end) every proposal is the drafter's own.
        true_ids = torch.where(on_record[:, None], true_ids, -1)
        sampler = self.sampler(depth, k)
        ranks = sampler.sample(profile_ids, draw_keys(rows, prefix_lens)).view(-1)
        ids = place_true_token(candidates, true_ids.reshape(-1), ranks, k)
        log_probs = sampler.log_probs[profile_ids].reshape(bs * depth, k)
        return log_probs.contiguous(), ids

    def _recorded(self, roots, prefix_lens, req_pool_indices, depth: int):
        """Each request's recorded row ``[bs]``, the recorded tokens after its root ``[bs,
        depth]``, and whether its root is the recorded one ``[bs]``."""
        rows = self.row_of_slot[req_pool_indices.to(torch.int64)]
        true_ids, recorded_roots = self.recording.truth(rows, prefix_lens, depth)
        return rows, true_ids, (recorded_roots == roots.view(-1)) & (recorded_roots >= 0)

    def count(self, roots, prefix_lens, req_pool_indices) -> None:
        """Per round (eager): how many requests' roots are on their recording; logged every
        :data:`LOG_EVERY` rounds."""
        _, _, on_record = self._recorded(roots, prefix_lens, req_pool_indices, 0)
        self._drift[0] += on_record.sum()
        self._drift[1] += on_record.numel()
        self._rounds += 1
        if self._rounds % LOG_EVERY == 0:
            logger.warning("DDTREE replay: %s", self.log_line())

    def log_line(self) -> str:
        on, total = (int(x) for x in self._drift.tolist())
        return f"{on} of {total} request-rounds on the recording"


def draw_keys(rows: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """One key per request ``[bs]`` from its recorded row and position (ranks follow them)."""
    return mix32(mix32(rows.to(torch.int64) + 1) ^ prefix_lens.to(torch.int64))


def install() -> None:
    """Make the worker's proposals the replay drafter's (called by the plugin's ``register``):
    through its capturable seam, so the tree step stays in the drafter's CUDA graph as it does
    in a normal launch. With ``SGLANG_DDTREE_REPLAY_TRACE`` the draws are a trace's
    (:mod:`.trace_replay`), else a profile's."""
    from sglang_ddtree.adapter.worker import DDTreeWorker

    with open(os.environ[ENV_TOKENS]) as f:
        spec = json.load(f)
    default = os.environ.get(ENV_PROFILE, "dflash-k25-code")
    trace = _read_trace(os.environ.get(ENV_TRACE))
    profiles = sorted(set(spec.get("profiles") or [default]))
    source = f"a trace of {len(trace['requests'])} requests" if trace else f"profiles {profiles}"
    logger.warning("DDTREE replay drafter active: %d recorded sequences, %s.", len(spec["sequences"]), source)
    state: dict = {}

    def drafter_of(worker) -> ReplayDrafter:
        if "drafter" not in state:
            recording = Recording(spec["sequences"], worker.device, spec.get("profiles"))
            pool_rows = int(worker.model_runner.req_to_token_pool.req_to_token.shape[0])
            ks = [head.k for head in worker.widths.heads.values()]  # every head keeps the server head's k
            if trace:
                from lab.bench.trace_replay import TraceReplayDrafter

                depth = worker.block_size - 1
                state["drafter"] = TraceReplayDrafter(recording, trace, pool_rows, max(ks), depth, default)
            else:
                state["drafter"] = ReplayDrafter(recording, default, pool_rows)
                for k in ks:
                    state["drafter"].sampler(worker.block_size - 1, k)  # device tables before any capture
        return state["drafter"]

    def proposal(self, hidden, k, *, roots, prefix_lens, req_pool_indices):
        log_probs, candidates = self._lm_head_topk(hidden, k + 1)  # the drafter's real head and top-k
        drafter, depth = drafter_of(self), self.block_size - 1
        if trace:
            own = log_probs[:, :k]
            return drafter.replace_from_trace(own, candidates, roots, prefix_lens, req_pool_indices, depth, k)
        return drafter.replace(candidates, roots, prefix_lens, req_pool_indices, depth, k)

    own_round, own_fold = DDTreeWorker._tree_round, DDTreeWorker._maybe_build_draft_sampler

    def tree_round(self, batch, *args, **kwargs):
        drafter = drafter_of(self)
        drafter.register(batch.reqs)
        drafter.count(batch.spec_info.bonus_tokens, batch.seq_lens, batch.req_pool_indices)
        return own_round(self, batch, *args, **kwargs)

    def fold(self):
        drafter_of(self)
        return own_fold(self)

    DDTreeWorker.replay_proposal = proposal
    DDTreeWorker._tree_round = tree_round
    DDTreeWorker._maybe_build_draft_sampler = fold


def _read_trace(path: str | None) -> dict | None:
    if not path:
        return None
    from lab.bench.draw_trace import read_json

    return read_json(path)
