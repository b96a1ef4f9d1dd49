"""The drafter's real draws, recorded round by round (a lab test plugin; never in a normal launch).

Loaded through the test-plugin seam (``SGLANG_DDTREE_TEST_PLUGIN=lab.bench.draw_recorder``), a
DDTREE (or chain) server writes, for every decode round and request, what its tree was built
from: the request's prompt (a hash and its length), the root's position in the sequence (the
root token is ``sequence[root_pos]``; depth ``d`` drafts ``sequence[root_pos + d]``), and each
depth's top-k log-probs and token ids from the proposal its tree was built from (the drafter's
own, or the replay drafter's where that plugin is also loaded). :mod:`.draw_trace` joins these
rows with the target's greedy continuation into a trace that :mod:`.trace_replay` serves.

``SGLANG_DDTREE_RECORD_DRAWS=<folder>``: each scheduler process writes ``draws-<pid>.jsonl``
there (tensor-parallel rank 0 only: every rank builds the same trees), one JSON object a line,
flushed every round. ``SGLANG_DDTREE_RECORD_TOPK``: the ranks recorded per depth (default 64),
whatever the tree's k: a chain's rounds (k = 1) are recorded as wide as a tree's, so that a
trace holds every recorded offset at full width.

The rows are read on the host every round, which a CUDA graph replay of the tree step would
skip: the recorder asks for the eager tree step (``SGLANG_DDTREE_EAGER_TREE_STEP``), as a
debugging run does. Acceptance is unchanged; only the round's speed is.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ENV_DRAWS = "SGLANG_DDTREE_RECORD_DRAWS"
ENV_TOPK = "SGLANG_DDTREE_RECORD_TOPK"
DEFAULT_TOPK = 64
DECIMALS = 4  # log-probs as written (the trace rounds further)


def prompt_hash(ids) -> str:
    """A request's identity: its prompt token ids, hashed (the same on every server)."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def draw_rows(reqs, prefix_lens, roots, log_probs, ids) -> list[dict]:
    """One row per request of a round (host lists: ``prefix_lens`` and ``roots`` ``[bs]``,
    ``log_probs`` and ``ids`` ``[bs][depth][k]``)."""
    rows = []
    for i, req in enumerate(reqs):
        prompt = list(req.origin_input_ids)
        rows.append(
            {
                "prompt": prompt_hash(prompt),
                "prompt_len": len(prompt),
                "root_pos": int(prefix_lens[i]),
                "root": int(roots[i]),
                "logp": [[round(x, DECIMALS) for x in depth] for depth in log_probs[i]],
                "ids": ids[i],
            }
        )
    return rows


class DrawLog:
    """This process's JSONL file of draws, opened on the first row."""

    def __init__(self, folder: Path, topk: int):
        self.folder, self.topk, self._file = folder, topk, None

    def write(self, rows: list[dict]) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._file = open(self.folder / f"draws-{os.getpid()}.jsonl", "a", buffering=1)
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()  # a server is stopped by a signal: every finished round is on disk


def install() -> None:
    """Wrap the worker's proposal (keep each round's top-k) and its round (write the rows)."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_ddtree.adapter.worker import DDTreeWorker
    from sglang_ddtree.config import ENV_EAGER_TREE_STEP

    os.environ[ENV_EAGER_TREE_STEP] = "1"  # the rows are read on the host (module docstring)
    log = DrawLog(Path(os.environ[ENV_DRAWS]), int(os.environ.get(ENV_TOPK, DEFAULT_TOPK)))
    own_proposal, own_round = DDTreeWorker._device_proposal, DDTreeWorker._tree_round

    def device_proposal(self, roots, prefix_lens, req_pool_indices):
        propose = own_proposal(self, roots, prefix_lens, req_pool_indices)

        def keep(hidden, k):
            # As wide as the recording asks, whatever the tree's k (a chain's rounds too); the
            # tree gets the first k columns, which are its top-k.
            log_probs, ids = propose(hidden, max(k, log.topk))
            self._ddtree_draws = (roots.clone(), prefix_lens.clone(), log_probs, ids)  # the batch's move on
            return log_probs[:, :k].contiguous(), ids[:, :k].contiguous()

        return keep

    def tree_round(self, batch, *args, **kwargs):
        self._ddtree_draws = None  # a root-only step (online budget) drafts nothing
        result = own_round(self, batch, *args, **kwargs)
        if self._ddtree_draws is not None and get_parallel().tp_rank == 0:
            roots, prefix_lens, log_probs, ids = self._ddtree_draws
            bs = len(batch.reqs)
            log_probs, ids = log_probs.view(bs, -1, log_probs.shape[-1]), ids.view(bs, -1, ids.shape[-1])
            host = [t.tolist() for t in (prefix_lens, roots.view(-1), log_probs.float(), ids)]
            log.write(draw_rows(batch.reqs, *host))
        return result

    DDTreeWorker._device_proposal = device_proposal
    DDTreeWorker._tree_round = tree_round
