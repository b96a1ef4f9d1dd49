"""The round's last step: commit the accepted path's KV (the worker's ``commit`` steps).

The target wrote KV for every tree slot of the verify window; the accepted nodes' KV moves to
the slots of their final positions. The drafter's context KV for the committed tokens comes
from the target's hidden features of those nodes (replayed from a CUDA graph if captured).
"""

from __future__ import annotations

from .draft_kv_graphs import committed_rows
from .phases import timed


class KVCommitSteps:
    """The worker's KV commit (mixed into ``DDTreeWorker``, whose state it reads)."""

    @timed("target kv commit")
    def _commit_target_kv(self, plan, sources, bs):
        """Move each accepted node's target KV to the slot of its final position."""
        slots = plan.write_ids(self.model_runner.kv_index_translator).view(bs, self.width)
        slots = slots[:, : sources.shape[1]]  # the step's verify width
        src = slots.gather(1, sources).reshape(-1)
        pool = self.model_runner.token_to_kv_pool_allocator.get_kvcache()
        pool.move_kv_cache(slots.reshape(-1), src)

    @timed("draft kv commit")
    def _commit_draft_kv(self, plan, logits_output, acceptance, prefix_lens, can_run_graph):
        """The drafter's context KV for the committed tokens, from the target's hidden features
        of the accepted nodes at their final positions (replayed from a CUDA graph if captured).
        Nothing at width 1 where the verify's decode graphs appended the root themselves."""
        sources, commit_lens = acceptance.sources, acceptance.emitted
        bs, width = sources.shape  # the step's verify width
        if width == 1 and self._roots_appended_in_graph(can_run_graph):
            return
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify returned no target hidden states.")
        cache_loc = self._draft_write_ids(plan)
        if width != self.width:
            cache_loc = cache_loc.view(bs, self.width)[:, :width].reshape(-1)
        graphs = self.draft_kv_graphs
        if graphs is not None and graphs.append(hidden, sources, prefix_lens, cache_loc, commit_lens):
            return
        rows, positions = committed_rows(hidden, sources, prefix_lens, width, self._last_position)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=rows.reshape(bs * width, -1),
            cache_loc=cache_loc,
            cache_loc_2d=cache_loc.view(bs, width),
            positions=positions.reshape(-1),
            commit_lens=commit_lens,
        )
