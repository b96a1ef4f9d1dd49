"""A test-only plugin: every decoding step's target forward checked against the readable one.

A decoding step (``adapter/decode_step.py``) runs the target's ordinary decode forward of the
roots; the drafter's context KV of each root is written from that forward's hidden states, so
a forward that returned other hidden states (another layer's, none, a padded row) would leave
greedy output identical while the drafter drifts. Before each decoding step this plugin runs
the reference, a width-1 verify of the same roots at the same slots and positions (the round
at width 1, a tree of the root alone), and when the step commits the drafter's KV (itself, or
inside width 1's decode graphs) it logs how far the decode forward's hidden states are from the
reference's::

    DDTREE decode check: rows 4 max |hidden - reference| 1.2e-07 scale 3.1

Loaded with ``SGLANG_DDTREE_TEST_PLUGIN=...,decode_check_plugin`` (this folder on
``PYTHONPATH``); ``tests/serving.py::decode_checks`` reads the lines.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_ddtree")


# What a verify's preparation (``_prepare_verify``, SGLang's ``prepare_for_verify``) sets on the
# batch: left there, a plain step would hand SGLang's decode forward a verify's ``spec_info``
# (its decode graphs refuse one).
VERIFY_SETS = ("input_ids", "spec_info", "forward_mode", "out_cache_loc")


def reference_hidden(worker, batch, draft_input, roots) -> torch.Tensor:
    """The target's hidden states of a width-1 verify of the step's ``roots`` (one slot a
    request, seeing its prefix and itself), as the round at width 1 runs it. ``draft_input``:
    None for a plain step (``adapter/plain_steps.py``), whose lengths the host knows."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_ddtree.adapter.verify_input import DDTreeVerifyInput, borrowed

    positions = batch.seq_lens.clamp(max=worker._last_position)  # each root at its prefix length
    slot = worker._root_slots(batch)
    mask = None
    if worker._uses_custom_mask:  # the GPU backends' flat mask: one slot sees its prefix and itself
        numel = int(batch.seq_lens.sum()) + len(roots)
        mask = torch.ones(numel, dtype=torch.bool, device=roots.device)
    verify_input = DDTreeVerifyInput(
        draft_token=roots,
        positions=positions,
        draft_token_num=1,
        custom_mask=mask,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        kv_loc_plan=worker._kv_plan(batch, draft_input, slot, 1),
    )
    # eagerly: under CUDA graphs width 1's graphs are decode graphs, which a verify cannot replay
    model_runner = worker.model_runner
    graphs, model_runner.decode_cuda_graph_runner = model_runner.decode_cuda_graph_runner, None
    try:
        # the verify's preparation sets these on the batch; the step it checks gets them back
        with borrowed(batch, **{name: getattr(batch, name) for name in VERIFY_SETS}):
            forward_batch = worker._prepare_verify(batch, draft_input, verify_input, slot)
            logits_output, _ = worker._target_forward(forward_batch)
    finally:
        model_runner.decode_cuda_graph_runner = graphs
    return logits_output.hidden_states.detach().clone()


def install() -> None:
    from sglang_ddtree.adapter.verify_input import borrowed
    from sglang_ddtree.adapter.worker import DDTreeWorker

    own_step, own_commit = DDTreeWorker._decode_step, DDTreeWorker._commit_root_draft_kv
    own_plain_step = DDTreeWorker._plain_step

    def decode_step(self, batch, draft_input, on_publish, grammar_barrier):
        roots = draft_input.bonus_tokens.view(-1)
        self._decode_check_reference = reference_hidden(self, batch, draft_input, roots)
        return own_step(self, batch, draft_input, on_publish, grammar_barrier)

    def plain_step(self, batch):
        roots = self.plain.future_map.output_tokens_buf[batch.req_pool_indices]
        with borrowed(batch, spec_algorithm=self.plain.algorithm):
            self._decode_check_reference = reference_hidden(self, batch, None, roots)
        if batch.spec_info is not None:  # the plain step must get the batch as the server made it
            raise AssertionError(f"decode check: a plain step's batch holds {type(batch.spec_info).__name__}")
        return own_plain_step(self, batch)

    def commit_root_draft_kv(self, plan, logits_output, positions, appended):
        reference = getattr(self, "_decode_check_reference", None)
        if reference is not None:
            hidden = logits_output.hidden_states
            if hidden is None or hidden.shape != reference.shape:
                logger.info(
                    "DDTREE decode check: shape %s against %s",
                    getattr(hidden, "shape", None),
                    tuple(reference.shape),
                )
            else:
                diff = float((hidden.float() - reference.float()).abs().max())
                scale = float(reference.float().abs().max())
                logger.info(
                    "DDTREE decode check: rows %d max |hidden - reference| %.3g scale %.3g",
                    len(hidden),
                    diff,
                    scale,
                )
            self._decode_check_reference = None
        return own_commit(self, plan, logits_output, positions, appended)

    DDTreeWorker._decode_step = decode_step
    DDTreeWorker._plain_step = plain_step
    DDTreeWorker._commit_root_draft_kv = commit_root_draft_kv
