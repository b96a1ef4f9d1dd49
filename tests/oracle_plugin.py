"""A drafter whose proposals a test controls: a test-only plugin module.

With random drafter weights nothing is ever accepted, and a tree that accepts
nothing proves nothing. This drafter knows each request's true greedy
continuation (recorded from a non-speculative run) and places the right token at
a chosen rank per depth: rank 0 where the chain would find it too, rank 1 (a
sibling of a decoy) where only a tree can. Everything else in the round - draft
forward, tree build, tree-masked verify, accept, KV commit - runs for real, and
the output must still equal non-speculative decoding.

Loaded in every server process by ``SGLANG_DDTREE_TEST_PLUGIN=oracle_plugin`` (with this
folder on ``PYTHONPATH``; see ``tests/serving.py::oracle_env``), it replaces the worker's
``_propose`` - the drafter's hidden states to per-depth top-k - by the script in
``SGLANG_DDTREE_ORACLE_DRAFT=<file.json>`` (read when it appears, again when it changes;
until it exists the worker proposes as it would without this module)::

    {"continuations": [[prompt ids..., output ids...], ...],
     "ranks": [0, 1, 0, 1, ...],      # rank of the right token per depth (cycled)
     "decoy_offset": 1,
     "overrides": {"2": {"ranks": [1], "decoy_token": 7}}}   # optional, per continuation

A decoy is ``right + decoy_offset``, or ``decoy_token`` where a continuation sets
one (to propose a token a grammar forbids, say).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

HIGH, DECOY, OTHER = 10.0, 9.0, 0.0


@dataclass
class OracleDrafter:
    continuations: list[list[int]]
    ranks: list[int]
    decoy_offset: int = 1
    overrides: dict[int, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> OracleDrafter:
        with open(path) as f:
            spec = json.load(f)
        overrides = {int(k): v for k, v in spec.get("overrides", {}).items()}
        return cls(spec["continuations"], spec.get("ranks", [0]), spec.get("decoy_offset", 1), overrides)

    def _continuation(self, req) -> tuple[list[int], dict] | tuple[None, None]:
        prompt = list(req.origin_input_ids)
        for index, sequence in enumerate(self.continuations):
            if sequence[: len(prompt)] == prompt:
                return sequence, self.overrides.get(index, {})
        return None, None

    def draft_logits(self, reqs, prefix_lens: torch.Tensor, depth: int, vocab: int, device) -> torch.Tensor:
        """``[bs, depth, vocab]`` logits: at each depth the right token at its rank."""
        logits = torch.full((len(reqs), depth, vocab), OTHER, dtype=torch.float32)
        for b, (req, prefix_len) in enumerate(zip(reqs, prefix_lens.tolist())):
            sequence, override = self._continuation(req)
            if sequence is None:
                continue
            ranks = override.get("ranks", self.ranks)
            for d in range(depth):
                position = int(prefix_len) + 1 + d  # the root sits at prefix_len
                if position >= len(sequence):
                    break
                right = sequence[position]
                rank = ranks[d % len(ranks)]
                logits[b, d, right] = HIGH if rank == 0 else DECOY
                if rank > 0:
                    decoy = override.get("decoy_token", (right + self.decoy_offset) % vocab)
                    logits[b, d, decoy] = HIGH
        return logits.to(device)


class ScriptFile:
    """The script at ``path``, read when it first appears and again whenever it changes:
    a server can start before its test has written the script (the test writes it
    whole, by rename). Until then the worker's own proposals run (SGLang's warm-up)."""

    def __init__(self, path: str):
        self.path = path
        self.stamp = None
        self.oracle: OracleDrafter | None = None

    def current(self) -> OracleDrafter | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return self.oracle
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp != self.stamp:
            self.oracle, self.stamp = OracleDrafter.load(self.path), stamp
            logging.getLogger("sglang_ddtree").warning(
                "DDTREE test drafter active (%s): proposals come from a script.", self.path
            )
        return self.oracle


def install() -> None:
    """Make the worker propose from the script (called by the plugin's ``register``)."""
    from sglang_ddtree.adapter.worker import DDTreeWorker

    script = ScriptFile(os.environ["SGLANG_DDTREE_ORACLE_DRAFT"])
    own_propose = DDTreeWorker._propose

    def propose(self, batch, hidden, prefix_lens, k):
        oracle = script.current()
        if oracle is None:
            return own_propose(self, batch, hidden, prefix_lens, k)
        bs, depth = len(prefix_lens), self.block_size - 1
        vocab = int(self.model_runner.model_config.vocab_size)
        logits = oracle.draft_logits(batch.reqs, prefix_lens, depth, vocab, self.device)
        return self.trees.topk(logits.view(bs * depth, vocab), k)

    DDTreeWorker._propose = propose
