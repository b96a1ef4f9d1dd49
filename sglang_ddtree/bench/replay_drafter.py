"""The replay drafter: real drafter costs, a controlled acceptance profile (benchmarks only).

With random weights (``--load-format dummy``) a drafter accepts nothing, so a benchmark of
tree speculation at real shapes needs a drafter whose acceptance is set, while every cost
stays real. This module, loaded through the test-plugin seam
(``SGLANG_DDTREE_TEST_PLUGIN=sglang_ddtree.bench.replay_drafter``; never in a normal launch),
wraps the worker's ``_propose``: the drafter's forward and the LM head's top-k run as
always, then on the device each depth's top-k is replaced by a calibrated one
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
"""

from __future__ import annotations

import json
import logging
import os

import torch

from .replay_profiles import PROFILES, RankSampler, place_true_token

ENV_TOKENS = "SGLANG_DDTREE_REPLAY_TOKENS"
ENV_PROFILE = "SGLANG_DDTREE_REPLAY_PROFILE"
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
    def __init__(self, recording: Recording, default_profile: str):
        names = sorted({default_profile, *recording.profiles})
        unknown = [n for n in names if n not in PROFILES]
        if unknown:
            raise ValueError(f"unknown replay profile(s) {unknown}: expected one of {sorted(PROFILES)}")
        self.recording, self.names = recording, names
        default = names.index(default_profile)
        self._row_profile = [names.index(n) for n in recording.profiles]
        self._default = default
        self._samplers: dict[tuple[int, int], RankSampler] = {}
        self._rounds = 0
        self._drift = None

    def sampler(self, depth: int, k: int, device) -> RankSampler:
        key = (depth, k)
        if key not in self._samplers:
            self._samplers[key] = RankSampler([PROFILES[n] for n in self.names], depth, k, device)
        return self._samplers[key]

    def _profile_of(self, row: int) -> int:
        return self._row_profile[row] if 0 <= row < len(self._row_profile) else self._default

    def replace(self, reqs, roots, prefix_lens, candidates, depth: int, k: int):
        """The drafter's top-(k+1) ``candidates`` ``[bs * depth, k+1]`` -> top-k log-probs
        and ids ``[bs * depth, k]`` of the calibrated drafter."""
        bs, device = len(reqs), candidates.device
        host_rows = [self.recording.row(r) for r in reqs]
        rows = torch.tensor(host_rows, dtype=torch.int64).to(device)
        profile_ids = torch.tensor([self._profile_of(r) for r in host_rows], dtype=torch.int64).to(device)
        true_ids, recorded_roots = self.recording.truth(rows, prefix_lens, depth)
        # Off the recording (or past its end) every proposal is the drafter's own.
        on_record = (recorded_roots == roots.view(-1)) & (recorded_roots >= 0)
        true_ids = torch.where(on_record[:, None], true_ids, -1)
        sampler = self.sampler(depth, k, device)
        ranks = sampler.sample(profile_ids).view(-1)
        ids = place_true_token(candidates, true_ids.reshape(-1), ranks, k)
        log_probs = sampler.log_probs[profile_ids].reshape(bs * depth, k)
        self._count(on_record)
        return log_probs.contiguous(), ids

    def _count(self, on_record: torch.Tensor) -> None:
        stats = torch.stack([on_record.sum(), torch.tensor(on_record.numel(), device=on_record.device)])
        self._drift = stats if self._drift is None else self._drift + stats
        self._rounds += 1
        if self._rounds % LOG_EVERY == 0:
            on, total = (int(x) for x in self._drift.tolist())
            logger.warning("DDTREE replay: %d of %d request-rounds on the recording", on, total)


def install() -> None:
    """Make the worker's proposals the replay drafter's (called by the plugin's ``register``)."""
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.runtime_context import get_parallel

    from sglang_ddtree.adapter.draft_head import draft_topk
    from sglang_ddtree.adapter.worker import DDTreeWorker

    with open(os.environ[ENV_TOKENS]) as f:
        spec = json.load(f)
    default = os.environ.get(ENV_PROFILE, "dflash-k25-code")
    logger.warning(
        "DDTREE replay drafter active: %d recorded sequences, profiles %s.",
        len(spec["sequences"]),
        sorted(set(spec.get("profiles") or [default])),
    )
    state: dict = {}

    def propose(self, batch, hidden, prefix_lens, k):
        if "drafter" not in state:
            recording = Recording(spec["sequences"], self.device, spec.get("profiles"))
            state["drafter"] = ReplayDrafter(recording, default)
        lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        tp_group = get_parallel().tp_group if get_parallel().tp_size > 1 else None
        _, candidates = draft_topk(hidden, lm_head, k + 1, tp_group, topk=self.trees.topk)
        roots = batch.spec_info.bonus_tokens
        return state["drafter"].replace(batch.reqs, roots, prefix_lens, candidates, self.block_size - 1, k)

    DDTreeWorker._propose = propose
