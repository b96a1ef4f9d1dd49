"""The DDTree speculative worker on SGLang's spec-v2 (overlap) path.

One decode round, per batch:

1. **draft** - the DFlash drafter runs one block ``[root, MASK x (block-1)]``;
   its hidden states through the target's LM head give per-depth top-k log-probs;
2. **build** - a best-first tree of ``budget`` nodes per request;
3. **verify** - the target runs ``budget + 1`` slots per request in one forward,
   each slot seeing the prefix and its tree ancestors;
4. **accept** - adjust every slot's verify logits for the request's features
   (penalties and grammar per path, ``request_features.py``), then walk each
   tree along the target's argmax (or samples);
5. **commit** - move the accepted path's KV to the front of the verify window, and
   write the drafter's context KV for the accepted tokens.

A step of ``--speculative-ddtree-budget auto`` at width 1 without the drafter skips all of
that for a decoding step (:meth:`DDTreeWorker._decode_step`): the target's ordinary decode
forward of each root, whose token is the next, and the drafter's context KV of the root; no
tree, mask, accept walk or KV move. A drafted round of width 1 verifies by that forward too.

Prefill and everything around the round (memory pools, draft KV materialisation, CUDA
graphs, overlap relay) is the DFlash V2 worker's; the KV reservation before each step is
DFlash's, topped up in chunks (``reservation.py``). The round issues no host
synchronisation: all shapes are fixed by ``(bs, width)``.
"""

from __future__ import annotations

import functools
import logging

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_exec, get_parallel, get_spec
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

from ..config import (
    DDTreeConfig,
    DDTreeConfigError,
    eager_tree_step_requested,
    online_budget_log_every,
    phase_times_interval,
    plain_steps_enabled,
    settings_of,
    tree_backend_override,
)
from ..kernels.backend import get_tree_backend
from . import draft_kv_graphs
from .decode_step import DecodeStep
from .draft_block import draft_forward_batch
from .draft_head import DraftTreeHead, draft_topk
from .kv_commit import KVCommitSteps
from .phases import RoundPhases, timed
from .plain_steps import PlainSteps
from .posterior import tree_posterior
from .request_features import RequestFeatures
from .reservation import NextDraftInputs, Reservation
from .stats import TreeStats
from .streams import current_stream
from .tp_check import tp_tree_check
from .verify_graph_memory import release_decode_scratch
from .verify_input import DDTreeVerifyInput, borrowed, prefix_lens_bound_cpu
from .width_policy import FixedWidth
from .widths import LOG_EVERY, StepWidths

logger = logging.getLogger("sglang_ddtree")


class DDTreeWorker(DecodeStep, KVCommitSteps, NextDraftInputs, DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        spec, settings = get_spec(), settings_of(server_args)
        self.ddtree = DDTreeConfig.from_spec_fields(
            spec.speculative_num_draft_tokens, spec.speculative_dflash_block_size, settings.max_topk
        )
        self.ddtree.validate()
        self._refuse_unsupported_drafter()
        # The DFlash worker took the verify width for its block; the drafter runs one block.
        self.block_size = self.ddtree.block_size
        self.speculative_num_draft_tokens = self.ddtree.block_size
        self.draft_model.set_block_size(self.block_size)
        self._block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device
        )
        self.width = self.ddtree.verify_width
        self._backend_checked = False
        self.trees = get_tree_backend(tree_backend_override())
        # Slots of a request's last rounds sit past its context; their outputs are never
        # emitted, but their positions must stay inside the RoPE tables (context_len <=
        # max_position_embeddings), on the drafter's block, the verify and the KV append.
        self._last_position = int(self.model_runner.model_config.context_len) - 1
        self.head = DraftTreeHead(
            trees_backend=self.trees,
            last_position=self._last_position,
            budget=self.ddtree.budget,
            width=self.width,
            block=self.block_size,
            k=self.ddtree.topk(int(self.model_runner.model_config.vocab_size)),
        )
        self.draft_kv_graphs = None  # captured with the CUDA graphs (init_cuda_graphs)
        self.check_tp_round = tp_tree_check(get_dp_tp_group())  # a no-op unless debugging
        self.stats = TreeStats(
            self.ddtree, settings.stats_interval, is_logging_rank=get_parallel().tp_rank == 0
        )
        # The width policy each round asks (width_policy.py): fixed, or the online budget's.
        self.widths = self._online_widths() if settings.online_budget else FixedWidth(self.head)
        # Its width-1 steps as SGLang's own decode steps, where the scheduler allows (plain_steps.py).
        self.plain = PlainSteps(settings.online_budget and plain_steps_enabled(), self._last_position)
        # The decode KV reservation, topped up in chunks (reservation.py): the draft input's.
        self.reservation = Reservation(spec.speculative_num_draft_tokens)
        parts = (self.widths, self.reservation, self.plain)
        self.stats.extra = lambda: {key: v for part in parts for key, v in part.summary().items()}
        self.phase = RoundPhases(phase_times_interval(), is_logging_rank=get_parallel().tp_rank == 0)
        self.features = RequestFeatures(
            # The request pool exists once the scheduler has set up memory.
            pool_rows=lambda: int(self.model_runner.req_to_token_pool.req_to_token.shape[0]),
            vocab=int(self.model_runner.model_config.vocab_size),
            device=torch.device(self.device),
            is_logging_rank=get_parallel().tp_rank == 0,
        )
        if get_parallel().tp_rank == 0:
            logger.info(
                "DDTREE worker ready: budget=%d, max siblings per depth=%s, verify width=%d, drafter block=%d, "
                "tree builder=%s",
                self.ddtree.budget,
                self.ddtree.max_topk or "budget",
                self.width,
                self.block_size,
                self.trees.name,
            )

    def _online_widths(self) -> StepWidths:
        """The per-step width of ``--speculative-ddtree-budget auto``."""
        widths = StepWidths.like(self.head, self.ddtree.budget, self.ddtree.depth)
        # Without a stats line the online budget logs its widths itself (host values only).
        logs = get_parallel().tp_rank == 0 and not self.stats.interval
        widths.log_every = online_budget_log_every(LOG_EVERY) if logs else 0
        if get_parallel().tp_rank == 0:
            logger.info("DDTREE online budget: verify widths %s chosen per step", list(widths.widths))
        return widths

    def _refuse_unsupported_drafter(self) -> None:
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            raise DDTreeConfigError(
                "DDTREE needs a plain DFlash drafter (per-position distributions); "
                "selector, LiLiCorr and Domino drafters propose single tokens."
            )

    def _maybe_build_draft_sampler(self):
        """Called before the drafter's decode graphs are captured: fold the tree step into
        them instead of DFLASH's greedy head (which would return one token per depth)."""
        if (
            self.trees.name == "cuda"
            and DDTreeWorker._propose is _PROPOSE_THROUGH_LM_HEAD
            and not eager_tree_step_requested()
        ):
            max_bs = max(get_exec().graph.cuda_graph_config.decode.bs)
            # The graph builds the server's widest tree; a step of the online budget takes its width.
            proposal = self.widths.graph_proposal(self._device_proposal, max_bs, self.device)
            self.head.fold_into_graph(self.draft_model_runner, proposal, max_bs=max_bs, device=self.device)
        elif get_parallel().tp_rank == 0:
            logger.info(
                "DDTREE tree step kept eager (tree builder %s, a test drafter or asked)", self.trees.name
            )
        return None

    def init_cuda_graphs(self):
        """SGLang's graphs, the drafter KV append's, then the online budget's per width."""
        super().init_cuda_graphs()
        self.draft_kv_graphs = draft_kv_graphs.install(self, self.widths.widths)
        roots_append = draft_kv_graphs.root_append_hook(self) is not None
        backends = [self.model_runner.attn_backend]
        backends += self.widths.install_graphs(self.model_runner, self.draft_model_runner, roots_append)
        release_decode_scratch(self.model_runner, backends)

    @property
    def _uses_custom_mask(self) -> bool:
        """GPU backends take SGLang's flat custom mask; torch_native the dense visibility."""
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return not isinstance(self.model_runner.attn_backend, TorchNativeAttnBackend)

    # --- the round -------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        prefill = batch.forward_mode.is_extend() or batch.is_extend_in_batch
        if prefill or batch.forward_mode.is_idle():
            self.widths.interrupt(len(batch.seq_lens) if prefill else 0)  # not in the step's period
            self.plain.ran(None)
        if prefill:
            self.features.on_prefill(batch)
            return super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        if batch.forward_mode.is_idle() or len(batch.seq_lens) == 0:
            return self._idle_result(on_publish)
        self.phase.start_round()
        plain = self.plain.is_plain(batch)
        result = self._plain_step(batch) if plain else self._tree_round(batch, on_publish, grammar_barrier)
        self.phase.end_round()
        return result

    def _tree_round(self, batch, on_publish, grammar_barrier=None):
        """Draft, build, verify, accept, commit (the module docstring): one decode step."""
        draft_input = self._round_input(batch)
        bs, prefix_lens, roots = len(batch.seq_lens), batch.seq_lens, draft_input.bonus_tokens.view(-1)
        width = self._step_width(bs)
        if self.widths.skips_draft:  # width 1 without the drafter
            return self._decode_step(batch, draft_input, on_publish, grammar_barrier)
        self.plain.ran(None)  # the host knows no length this round leaves
        window, plan = self._verify_window(batch, draft_input)  # [bs * width] slots
        trees, draft_top1 = self._draft(batch, draft_input, roots, prefix_lens, plan, width)  # and build
        features = self._start_features(batch, trees)
        logits_output, can_run_graph = self._verify(batch, draft_input, trees, window, plan)
        self._apply_features(batch, features, logits_output, grammar_barrier)
        posterior = self._posterior(batch, logits_output, trees.positions, bs)  # [bs, width]
        acceptance = self._accept(trees, posterior, prefix_lens)
        self._finish_features(batch, features, acceptance)
        new_seq_lens = acceptance.new_seq_lens.to(prefix_lens.dtype)  # no-op for SGLang's int64 lengths
        if batch.return_logprob:
            self._spec_logprobs(batch, logits_output, posterior, acceptance.path)
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._commit_target_kv(plan, acceptance.sources, bs)  # sources: [bs, width]
        self._commit_draft_kv(plan, logits_output, acceptance, prefix_lens, can_run_graph)
        logits_output.hidden_states = None
        self._record_stats(acceptance, trees, draft_top1)
        self._record_width(acceptance)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=acceptance.out_tokens.reshape(-1),
            accept_lens=acceptance.emitted,
            can_run_cuda_graph=can_run_graph,
            next_draft_input=self._next_draft_input(acceptance.bonus, new_seq_lens),
            speculative_num_draft_tokens=width,
            new_seq_lens=new_seq_lens,
        )

    # --- steps (each timed as a phase of its round: phases.py) ---------------------------

    def _round_input(self, batch) -> DFlashDraftInputV2:
        if not self._backend_checked:
            from .attention.gpu_backends import check_live_backend

            check_live_backend(self.model_runner.attn_backend)
            self._backend_checked = True
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch.")
        batch.seq_lens.record_stream(current_stream(self.device))
        return draft_input

    @timed("width choice")
    def _choose_width(self, bs: int) -> int:
        """This step's verify width (with the online budget, its host work)."""
        return self.widths.start(bs)

    @timed("window")
    def _verify_window(self, batch, draft_input):
        """The ``width`` KV slots reserved for this round, per request in position order, read
        from ``req_to_token`` once at the start of the round, and their KV location plan."""
        prefix_lens, bs, width = batch.seq_lens, len(batch.seq_lens), self.width
        window = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + width,
            batch_size=bs,
            draft_token_num=width,
            device=self.device,
        )
        return window, self._kv_plan(batch, draft_input, window, width)

    def _kv_plan(self, batch, draft_input, window, width: int):
        """The KV location plan of a step writing ``window`` (``width`` slots a request)."""
        return self.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=draft_input.nxt_kv_lens_cpu if batch.seq_lens_cpu is None else batch.seq_lens_cpu,
            write_virtual=window,
            read_extent=width,
        )

    @timed("features")
    def _start_features(self, batch, trees):
        return self.features.start_round(batch, trees)

    @timed("features")
    def _apply_features(self, batch, features, logits_output, grammar_barrier):
        self.features.apply(batch, features, logits_output.next_token_logits, grammar_barrier)

    @timed("features")
    def _finish_features(self, batch, features, acceptance=None):
        self.features.finish_round(batch, features, acceptance)

    @timed("accept")
    def _accept(self, trees, posterior, prefix_lens):
        acceptance = self.trees.accept(trees, posterior, prefix_lens, self.ddtree.depth)
        self.check_tp_round(trees, acceptance)
        return acceptance

    def _spec_logprobs(self, batch, logits_output, posterior, path):
        bs, width = posterior.shape  # the accepted path's nodes, as rows of the flat verify
        rows = torch.where(path >= 0, path + width * torch.arange(bs, device=self.device)[:, None], -1)
        compute_spec_logprobs(batch, logits_output, posterior.reshape(-1), accept_index=rows)

    @timed("stats")
    def _record_stats(self, acceptance, trees, draft_top1):
        self.stats.record(acceptance, trees, draft_top1, self.trees.non_argmax_accepted)

    @timed("width record")
    def _record_width(self, acceptance):
        """What the width policy keeps of the step (the online budget: one drafted step in 32
        also predicts; a decoding step, ``acceptance`` None, only its cost)."""
        self.widths.finish(None if acceptance is None else acceptance.accept_lens)

    def _draft(self, batch, draft_input, roots, prefix_lens, plan, width):
        """One drafter block and the tree step for a verify ``width``: (:class:`Trees`, the
        drafter's top-1 per depth ``[bs, depth]``). On a graph replay the tree step ran
        inside the graph."""
        with self.phase("draft prepare"):
            forward_batch = draft_forward_batch(self, batch, draft_input, roots, prefix_lens, plan)
        with self.phase("draft forward"), torch.inference_mode():
            out = self.draft_model_runner.forward(forward_batch)
        with self.phase("tree step"):
            if out.can_run_graph and self.head.in_graph:
                return self.widths.from_graph(self.head.replayed(len(prefix_lens), width))
            if DDTreeWorker._propose is _PROPOSE_THROUGH_LM_HEAD:
                propose = self._device_proposal(roots, prefix_lens, batch.req_pool_indices)
            else:  # a scripted test drafter
                propose = lambda hidden, k: self._propose(batch, hidden, prefix_lens, k)  # noqa: E731
            head, propose = self.widths.head_for(width), self.widths.watch(propose)
            return head.run(out.logits_output.hidden_states, roots, prefix_lens, propose)

    def _propose(self, batch, hidden, prefix_lens, k):
        """The drafter's hidden states ``[bs * depth, hidden]`` to top-k log-probs and ids
        ``[bs * depth, k]``. A test plugin may replace it (to script proposals from the host);
        the tree step then stays out of the drafter's CUDA graph."""
        return self._lm_head_topk(hidden, k)

    # A benchmark seam (``bench/replay_drafter.py``): proposals made from the batch's device
    # state alone, ``(self, hidden, k, roots=, prefix_lens=, req_pool_indices=)`` -> top-k
    # log-probs and ids, capturable, so the tree step stays in the drafter's CUDA graph.
    replay_proposal = None

    def _device_proposal(self, roots, prefix_lens, req_pool_indices):
        """``propose(hidden, k)`` of one batch, device work only (the graph's and the eager
        step's): the LM head's top-k, or the replay drafter's where a benchmark installed it."""
        if self.replay_proposal is None:
            return self._lm_head_topk
        return functools.partial(
            self.replay_proposal, roots=roots, prefix_lens=prefix_lens, req_pool_indices=req_pool_indices
        )

    def _lm_head_topk(self, hidden, k):
        """Through the target's LM head (vocabulary-parallel top-k merged over its ranks)."""
        lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        # The head's own group: the attention-TP group under --enable-dp-lm-head, none unsharded.
        tp_group = lm_head.tp_group if int(getattr(lm_head, "tp_size", 1)) > 1 else None
        return draft_topk(hidden, lm_head, k, tp_group, topk=self.trees.topk)

    def _verify(self, batch, draft_input, trees, window, plan):
        if trees.width == 1:  # the root alone: its decode forward (decode_step.py)
            return self._verify_root(batch, draft_input, trees, plan)
        custom = self._uses_custom_mask
        with self.phase("mask"):
            mask = None
            if custom:
                host_lens = prefix_lens_bound_cpu(batch, draft_input, self._last_position + 1)
                mask = self.trees.flat_mask(trees, batch.seq_lens, host_lens)
        with self.phase("verify prepare"):
            forward_batch = self._verify_forward_batch(batch, draft_input, trees, window, plan, mask)
        with self.phase("verify forward"):
            return self._target_forward(forward_batch)

    def _target_forward(self, forward_batch, planned: bool = True):
        """The target's verify forward (at any width): its logits output with the logits
        gathered, and whether it ran from a CUDA graph. ``planned``: its attention metadata
        (or graph load) was prepared with the batch (a verify); else the forward plans it."""
        self.widths.verify_started()  # the online budget prices a width by its verify's time
        out = self.target_worker.forward_batch_generation(  # unplanned: not marked (None), so it plans
            batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=planned or None
        )
        self.widths.verify_finished()
        logits_output = out.logits_output
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits_output.next_token_logits):
            logits_output.next_token_logits = target_lp.finish_deferred_gather(
                logits_output.next_token_logits
            )
        return logits_output, out.can_run_cuda_graph

    def _verify_forward_batch(self, batch, draft_input, trees, window, plan, mask):
        width = trees.width  # the server's width, or this step's (online budget): its first columns
        verify_input = DDTreeVerifyInput(
            draft_token=trees.tokens.reshape(-1),
            positions=trees.positions.reshape(-1),
            draft_token_num=width,
            custom_mask=mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=plan,
            tree_visibility=None if mask is not None else trees.visibility(),
            kv_loc_cols=None if width == self.width else slice(0, width),
        )
        return self._prepare_verify(batch, draft_input, verify_input, window)

    def _prepare_verify(self, batch, draft_input, verify_input, window):
        """The target's forward batch of ``verify_input``, writing ``window``; the host
        lengths its attention reads bound the prefix plus this step's width."""
        batch.out_cache_loc = window
        lens = {}
        if batch.seq_lens_cpu is not None:
            host = batch.seq_lens_cpu + verify_input.draft_token_num
            lens = {"seq_lens_cpu": host, "seq_lens_sum": int(host.sum())}
        elif draft_input.nxt_kv_lens_cpu is not None:
            host = draft_input.nxt_kv_lens_cpu
            lens = {"seq_lens_cpu": host, "seq_lens_sum": int(draft_input.nxt_kv_lens_sum)}
        with borrowed(batch, **lens):
            forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        return forward_batch

    @timed("posterior")
    def _posterior(self, batch, logits_output, positions, bs):
        posterior = tree_posterior(
            logits_output.next_token_logits,
            batch.sampling_info,
            positions.reshape(-1),
            positions.shape[1],
            self.model_runner.sampler,
        ).view(bs, positions.shape[1])
        # Every rank must walk the same path (sampling draws are per rank).
        site = (
            SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            if batch.sampling_info is None or batch.sampling_info.is_all_greedy
            else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        )
        self._tp_sync.sync(site, posterior)
        return posterior


# The worker's own proposal step; a test plugin that replaces ``DDTreeWorker._propose``
# keeps the tree step eager (its proposals may read the host).
_PROPOSE_THROUGH_LM_HEAD = DDTreeWorker._propose
