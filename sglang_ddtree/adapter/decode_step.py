"""A step of ``--speculative-ddtree-budget auto`` at width 1 without the drafter, run as a
decoding step (the worker's ``_decode_step``, chosen at the top of its round).

What the round would do at width 1 without the drafter is a plain decoding step with the
whole speculative round around it: root-only trees, a flat mask, the verify, the posterior,
the accept walk over a one-node tree, a KV move that moves nothing, the drafter's KV append
through the commit plan, the tree statistics. This step keeps only what decoding needs and
what the next drafting round reads:

* the target's ordinary decode forward of every root (a DECODE batch, no speculative input, no
  tree mask), at its first reserved KV slot (already the root's final place); under the online
  budget's CUDA graphs, width 1's graphs are decode graphs (``width_graphs.py``), so the step
  pays plain decoding's forward batch and graph load; the target's hidden states captured;
* the request features on its logits (penalties, grammar, ``logit_bias``, custom processors:
  ``request_features.py``, with root-only trees made only where a feature reads them) and
  the target's token (``posterior.py``: the argmax, or SGLang's sampler at the root's
  position): the bonus, the next root;
* the drafter's context KV of the root, from the target's hidden states, so that the drafter
  misses nothing when a later step drafts: inside width 1's decode graphs where they hold it
  (``draft_kv_graphs.py``), else from the drafter KV append's own graph or eagerly;
* the result SGLang's speculative scheduler expects: one token a request (``accept_lens`` 1),
  the new lengths published before the forward (a round publishes after its accept; a
  decoding step knows them at its start, so the scheduler's next step, which waits for them
  where the attention backend needs host lengths, need not wait for this forward), the bonus
  as the next draft input.

Where the scheduler runs the step as its own non-speculative decode step (``plain_steps.py``),
the worker's ``_plain_step`` is plain decoding's step itself: the target worker's forward batch,
forward and sampler on the batch lent plain decoding's lengths and the roots' reserved slots,
and the drafter's KV of the roots (inside width 1's decode graphs where they hold it).

Stop strings and the request's end are SGLang's one-token check (``stops.py`` only changes
rounds of more than one token). Greedy output is the plain server's; sampled output draws what
the round at width 1 draws.
"""

from __future__ import annotations

import functools

import torch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from .phases import timed
from .plain_steps import PlainSteps
from .verify_input import borrowed, prefix_lens_bound_cpu
from .width_graphs import captured_graph_mode


class DecodeStep:
    """The worker's decoding step (mixed into ``DDTreeWorker``, whose state it reads)."""

    _accept_ones: dict[int, torch.Tensor] | None = None  # [bs] int32 ones per batch size
    plain: PlainSteps  # the online budget's width-1 steps as SGLang's own decode steps
    _scheduled_width: tuple[int, int] | None = None  # (bs, width) chosen when the step was prepared

    def _decode_step(self, batch, draft_input, on_publish, grammar_barrier):
        """Width 1 without the drafter: a decoding step inside SGLang's speculative frame, with
        the result the round gives at width 1. Each request's root runs alone through the
        target at its first reserved slot, already the root's final place (nothing to move);
        the next token is the target's after the request features; the drafter's context KV of
        the root is written from the target's hidden states. The scheduler gets one token a
        request (``accept_lens`` 1), which is also the next root."""
        bs, roots = len(batch.seq_lens), draft_input.bonus_tokens.view(-1)
        with self.phase("decode prepare"):
            host_lens, new_seq_lens = self._root_lens(batch, draft_input)
        logits_output, next_ids, can_run_graph = self._decode_roots(
            batch, roots, host_lens, new_seq_lens, draft_input, on_publish, grammar_barrier
        )
        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_ids,
            accept_lens=self._decode_accept_lens(bs),
            can_run_cuda_graph=can_run_graph,
            next_draft_input=self._next_draft_input(next_ids, new_seq_lens),
            speculative_num_draft_tokens=1,
            new_seq_lens=new_seq_lens,
        )
        self.plain.ran(batch, in_frame_result=result)
        return result

    def _plain_step(self, batch):
        """Width 1 without the drafter as SGLang's own decode step (``plain_steps.py``): plain
        decoding's forward and sampler through the target worker, on a non-speculative batch
        whose lengths the host knows, and the drafter's KV of the roots. The roots are the last
        step's tokens in the scheduler's relay buffer, each written at its first reserved slot;
        the result is plain decoding's (the tokens); the scheduler publishes the lengths and
        relays the tokens."""
        bs, prefix_lens = len(batch.seq_lens), batch.seq_lens
        with self.phase("plain step"), borrowed(batch, **self._plain_decoding_fields(batch)):
            self.widths.verify_started()  # the online budget prices a width by its forward's time
            result = self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL, return_kv_loc_plan=True
            )
            self.widths.verify_finished()
        plan, result.kv_loc_plan = result.kv_loc_plan, None
        self.plain.ran(batch)
        self.plain.steps += 1  # before the stats line this step may log
        self._end_root_step(plan, result.logits_output, prefix_lens, result.can_run_cuda_graph, bs)
        return result

    def _plain_decoding_fields(self, batch) -> dict:
        """What a plain step lends its batch so that the target worker decodes it as plain
        decoding would: the roots (the last step's tokens, in the scheduler's relay buffer), each
        written at its first reserved KV slot, and the lengths counting them; no speculative
        input (the conversion parked it: lent here too, as a decoding step's forward batch does)."""
        lens = self.plain.forward_lens
        return {
            "spec_algorithm": self.plain.algorithm,  # its forward runs as the frame's would
            "forward_mode": ForwardMode.DECODE,
            "spec_info": None,
            "input_ids": self.plain.future_map.output_tokens_buf.index_select(0, batch.req_pool_indices),
            "out_cache_loc": self._root_slots(batch),
            "seq_lens": lens.device,
            "seq_lens_cpu": lens.host,
            "seq_lens_sum": lens.total,
        }

    def _decode_roots(self, batch, roots, host_lens, new_seq_lens, draft_input, on_publish, grammar_barrier):
        """The decoding step's work (module docstring): ``(logits output, next tokens
        [bs], whether a CUDA graph ran)``. ``host_lens``: the prefix lengths or a bound of
        them on the host (None where neither is known there)."""
        bs, prefix_lens = len(batch.seq_lens), batch.seq_lens
        with self.phase("decode prepare"):
            positions = self._root_positions(batch, host_lens)
            plan = self._decode_plan(batch, draft_input)
            forward_batch = self._decode_forward_batch(batch, host_lens, new_seq_lens, roots, positions, plan)
        if on_publish is not None:  # known before the forward: the next step's wait on them ends here
            on_publish(new_seq_lens)
        features = self._start_features(batch, functools.partial(self._root_trees, roots, prefix_lens))
        with self.phase("decode forward"):
            logits_output, can_run_graph = self._target_forward(forward_batch, planned=False)
        self._apply_features(batch, features, logits_output, grammar_barrier)
        posterior = self._posterior(batch, logits_output, positions.view(bs, 1), bs)  # [bs, 1]
        next_ids = posterior.view(bs)
        self._finish_features(batch, features)
        if batch.return_logprob:
            self._spec_logprobs(batch, logits_output, posterior, torch.zeros_like(posterior))
        self._end_root_step(plan, logits_output, positions, can_run_graph, bs)
        return logits_output, next_ids, can_run_graph

    def _end_root_step(self, plan, logits_output, positions, can_run_graph: bool, bs: int) -> None:
        """The end of a decoding or plain step: the drafter's context KV of every root (nothing
        more where width 1's decode graphs appended it), the hidden states let go, the step
        counted and its width recorded."""
        self._commit_root_draft_kv(
            plan, logits_output, positions, self._roots_appended_in_graph(can_run_graph)
        )
        logits_output.hidden_states = None
        self.stats.record_decode_step(bs)
        self._record_width(None)

    def schedule_decode(self, batch, future_map, queued_results) -> None:
        """The scheduler has prepared a decode step of ``batch`` (overlap; ``plain_steps.py``'s
        hook): its width is chosen now, and a width-1 step without the drafter whose lengths the
        host knows becomes a plain decode step."""
        bs = batch.batch_size()
        self._scheduled_width = (bs, self._choose_width(bs))
        if self.widths.skips_draft and self.plain.allows(batch):
            self.plain.convert(batch, future_map, queued_results)  # (False: it stays in the frame)

    def _step_width(self, bs: int) -> int:
        """This step's verify width: chosen when the scheduler prepared it, else now."""
        scheduled, self._scheduled_width = self._scheduled_width, None
        if scheduled is not None and scheduled[0] == bs:
            return scheduled[1]
        return self._choose_width(bs)

    def _root_trees(self, roots, prefix_lens):
        """A decoding step's trees, for the request features that read them: the roots alone."""
        trees, _ = self.widths.root_only(roots, prefix_lens, self._last_position)
        return trees

    def _root_lens(self, batch, draft_input):
        """The prefix lengths on the host (or a bound of them; None where neither is known
        there) and, on the device, the lengths counting the root."""
        return prefix_lens_bound_cpu(batch, draft_input, self._last_position + 1), batch.seq_lens + 1

    def _root_positions(self, batch, host_lens):
        """Each root's position, its prefix length: clamped to the last position of the RoPE
        tables where a request may have reached its context (it emits nothing more), known from
        the host bound of the lengths (``host_lens``) without waiting for the device."""
        if host_lens is not None and int(host_lens.max()) <= self._last_position:
            return batch.seq_lens
        return batch.seq_lens.clamp(max=self._last_position)

    def _decode_plan(self, batch, draft_input):
        """A decoding step's KV location plan: its window is each request's root slot
        (``draft_input``: read only without host lengths)."""
        return self._kv_plan(batch, draft_input, self._root_slots(batch), 1)

    def _root_slots(self, batch) -> torch.Tensor:
        """Each request's first reserved KV slot (its root's final place), read from
        ``req_to_token``."""
        # one slot a request: a gather (two launches) costs the host less than the window kernel
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        return req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)

    def _verify_root(self, batch, draft_input, trees, plan):
        """A drafted round's verify of one-node trees (width 1, drafted to predict): the roots'
        decode forward, as a decoding step runs it (width 1's graphs are decode graphs)."""
        with self.phase("verify prepare"):
            cols = None if self.width == 1 else slice(0, 1)  # the first column of a wider window
            roots, positions = trees.tokens.reshape(-1), trees.positions.reshape(-1)
            host_lens, new_seq_lens = self._root_lens(batch, draft_input)
            forward_batch = self._decode_forward_batch(
                batch, host_lens, new_seq_lens, roots, positions, plan, cols
            )
        with self.phase("verify forward"):
            return self._target_forward(forward_batch, planned=False)

    def _decode_forward_batch(self, batch, host_lens, new_seq_lens, roots, positions, plan, cols=None):
        """The target's ordinary decode forward of every root: a DECODE batch without a
        speculative input, its lengths ``new_seq_lens`` counting the root (on the host:
        ``host_lens``, the prefix lengths or a bound of them, plus one), writing the root's KV
        at its plan's slot (``cols``: the plan's first column, where its window is wider).
        Width 1's CUDA graphs are decode graphs (``width_graphs.py``), and the forward plans
        its attention and loads its graph itself, as plain decoding's does (no pre-planned
        load, whose replay would copy the inputs again)."""
        model_runner = self.model_runner
        if captured_graph_mode(model_runner) not in (None, ForwardMode.DECODE):
            raise RuntimeError(
                "DDTREE: a decoding step found verify graphs in place of width 1's decode graphs."
            )
        lens = {}
        if host_lens is not None:
            lens["seq_lens_cpu"] = host_lens + 1
            lens["seq_lens_sum"] = int(lens["seq_lens_cpu"].sum())
        decode = {"forward_mode": ForwardMode.DECODE, "spec_info": None, "input_ids": roots}
        with borrowed(batch, seq_lens=new_seq_lens, **decode, **lens):
            forward_batch = ForwardBatch.init_new(
                batch,
                model_runner,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                return_hidden_states_before_norm=False,
                kv_loc_plan=plan,
                write_cols=cols,
            )
        forward_batch.positions = positions  # clamped where a request reached its context
        return forward_batch

    def _roots_appended_in_graph(self, can_run_graph: bool) -> bool:
        """Whether the forward just run (at width 1) replayed decode graphs that appended every
        root's drafter KV themselves (``draft_kv_graphs.py``); an eager forward (a batch past
        the captured sizes) did not."""
        if not can_run_graph:
            return False
        return getattr(self.model_runner.decode_cuda_graph_runner, "appends_draft_kv", False)

    def _decode_accept_lens(self, bs: int) -> torch.Tensor:
        """``[bs]`` int32 ones: a decoding step's accept lengths (read only, kept per size)."""
        if self._accept_ones is None:
            self._accept_ones = {}
        ones = self._accept_ones.get(bs)
        if ones is None:
            ones = self._accept_ones[bs] = torch.ones(bs, dtype=torch.int32, device=self.device)
        return ones

    @timed("draft kv commit")
    def _commit_root_draft_kv(self, plan, logits_output, positions, appended: bool = False):
        """The drafter's context KV of every root, from the target's hidden features of its only
        slot, at its position (replayed from a CUDA graph if captured); nothing more where the
        decode graphs that ran the forward appended it (``appended``)."""
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify returned no target hidden states.")
        if appended:
            return
        cache_loc = self._draft_write_ids(plan)
        graphs = self.draft_kv_graphs
        if graphs is not None and graphs.append_roots(hidden, positions, cache_loc):
            return
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden, cache_loc=cache_loc, positions=positions
        )
