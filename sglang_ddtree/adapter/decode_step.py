"""A step of ``--speculative-ddtree-budget auto`` at width 1 without the drafter, run as a
decoding step (the worker's ``_decode_step``, chosen at the top of its round).

What the round would do at width 1 without the drafter is a plain decoding step with the
whole speculative round around it: root-only trees, a flat mask, the verify, the posterior,
the accept walk over a one-node tree, a KV move that moves nothing, the drafter's KV append
through the commit plan, the tree statistics. This step keeps only what decoding needs and
what the next drafting round reads:

* the target's forward of every root alone, at its first reserved KV slot (already the
  root's final place) through the width-1 verify (its CUDA graphs under the online budget),
  the target's hidden states captured;
* the request features on its logits (penalties, grammar, ``logit_bias``, custom processors:
  ``request_features.py``, with root-only trees made only where a feature reads them) and
  the target's token (``posterior.py``: the argmax, or SGLang's sampler at the root's
  position): the bonus, the next root;
* the drafter's context KV of the root, from the target's hidden states (from a CUDA graph
  where captured), so that the drafter misses nothing when a later step drafts;
* the result SGLang's speculative scheduler expects: one token a request (``accept_lens`` 1),
  the new lengths published mid-step, the bonus as the next draft input.

Stop strings and the request's end are SGLang's one-token check (``stops.py`` only changes
rounds of more than one token). Greedy output is the plain server's; sampled output draws what
the round at width 1 draws.
"""

from __future__ import annotations

import functools

import torch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from .phases import timed
from .verify_input import DDTreeVerifyInput, prefix_lens_bound_cpu


class DecodeStep:
    """The worker's decoding step (mixed into ``DDTreeWorker``, whose state it reads)."""

    _visible: torch.Tensor | None = None  # the all-true mask buffer (_all_visible)
    _accept_ones: dict[int, torch.Tensor] | None = None  # [bs] int32 ones per batch size

    def _decode_step(self, batch, draft_input, on_publish, grammar_barrier):
        """Width 1 without the drafter: a decoding step inside SGLang's speculative frame, with
        the result the round gives at width 1. Each request's root runs alone through the
        target at its first reserved slot, already the root's final place (nothing to move);
        the next token is the target's after the request features; the drafter's context KV of
        the root is written from the target's hidden states. The scheduler gets one token a
        request (``accept_lens`` 1), which is also the next root."""
        bs, prefix_lens, roots = len(batch.seq_lens), batch.seq_lens, draft_input.bonus_tokens.view(-1)
        with self.phase("decode prepare"):
            positions = self._root_positions(batch, draft_input)
            slot, plan = self._decode_slot(batch, draft_input)
            forward_batch = self._decode_forward_batch(batch, draft_input, roots, positions, slot, plan)
        features = self._start_features(batch, functools.partial(self._root_trees, roots, prefix_lens))
        with self.phase("decode forward"):
            logits_output, can_run_graph = self._target_forward(forward_batch)
        self._apply_features(batch, features, logits_output, grammar_barrier)
        posterior = self._posterior(batch, logits_output, positions.view(bs, 1), bs)  # [bs, 1]
        next_ids = posterior.view(bs)
        self._finish_features(batch, features)
        new_seq_lens = prefix_lens + 1
        emitted = self._decode_accept_lens(bs)
        if batch.return_logprob:
            self._spec_logprobs(batch, logits_output, posterior, torch.zeros_like(posterior))
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._commit_root_draft_kv(plan, logits_output, positions)
        logits_output.hidden_states = None
        self.stats.record_decode_step(bs)
        self._record_width(None)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_ids,
            accept_lens=emitted,
            can_run_cuda_graph=can_run_graph,
            next_draft_input=self._next_draft_input(next_ids, new_seq_lens),
            speculative_num_draft_tokens=1,
            new_seq_lens=new_seq_lens,
        )

    def _root_trees(self, roots, prefix_lens):
        """A decoding step's trees, for the request features that read them: the roots alone."""
        trees, _ = self.widths.root_only(roots, prefix_lens, self._last_position)
        return trees

    def _root_positions(self, batch, draft_input):
        """Each root's position, its prefix length: clamped to the last position of the RoPE
        tables where a request may have reached its context (it emits nothing more), known from
        the host bound of the lengths without waiting for the device."""
        bound = prefix_lens_bound_cpu(batch, draft_input, self._last_position + 1)
        if bound is not None and int(bound.max()) <= self._last_position:
            return batch.seq_lens
        return batch.seq_lens.clamp(max=self._last_position)

    def _decode_slot(self, batch, draft_input):
        """A decoding step's window: each request's first reserved KV slot (the root's final
        place), and its KV location plan."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slot = req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)
        return slot, self._kv_plan(batch, draft_input, slot, 1)

    def _decode_forward_batch(self, batch, draft_input, roots, positions, slot, plan):
        """The target's forward of a decoding step: each root alone, seeing its whole prefix
        (a width-1 verify; on the GPU backends its flat mask is all ones)."""
        mask = None
        if self._uses_custom_mask:
            host_lens = prefix_lens_bound_cpu(batch, draft_input, self._last_position + 1)
            if host_lens is None:  # neither known on the host (not under SGLang's scheduler)
                host_lens = batch.seq_lens.cpu()
            mask = self._all_visible(int(host_lens.sum()) + len(host_lens))
        verify_input = DDTreeVerifyInput(
            draft_token=roots,
            positions=positions,
            draft_token_num=1,
            custom_mask=mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=plan,
        )
        return self._prepare_verify(batch, draft_input, verify_input, slot)

    def _all_visible(self, numel: int) -> torch.Tensor:
        """``numel`` true mask elements: a view of one buffer that only grows, never written
        after it is made (a backend reads no further than the batch's own lengths)."""
        held = 0 if self._visible is None else self._visible.numel()
        if held < numel:
            self._visible = torch.ones(max(numel, 2 * held), dtype=torch.bool, device=self.device)
        return self._visible[:numel]

    def _decode_accept_lens(self, bs: int) -> torch.Tensor:
        """``[bs]`` int32 ones: a decoding step's accept lengths (read only, kept per size)."""
        if self._accept_ones is None:
            self._accept_ones = {}
        ones = self._accept_ones.get(bs)
        if ones is None:
            ones = self._accept_ones[bs] = torch.ones(bs, dtype=torch.int32, device=self.device)
        return ones

    @timed("draft kv commit")
    def _commit_root_draft_kv(self, plan, logits_output, positions):
        """The drafter's context KV of every root, from the target's hidden features of its only
        slot, at its position (replayed from a CUDA graph if captured)."""
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify returned no target hidden states.")
        cache_loc = self._draft_write_ids(plan)
        graphs = self.draft_kv_graphs
        if graphs is not None and graphs.append_roots(hidden, positions, cache_loc):
            return
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden, cache_loc=cache_loc, positions=positions
        )
