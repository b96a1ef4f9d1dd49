"""Request features under a tree: penalties, ``min_new_tokens``, grammar,
``logit_bias`` and custom logit processors, applied to every slot's verify logits
before the posterior, in the plain server's order (penalties, grammar mask,
logit bias, then custom processors).

* penalties and ``min_new_tokens``: exact per path (``penalties.py``);
* grammar: each slot is masked by the grammar state after its own path, built
  by SGLang's tree traversal (the one EAGLE trees use) over the DDTree's
  first-child / next-sibling links. A slot whose token its parent's state
  rejects keeps no mask, and can never be accepted: its parent's masked
  posterior never proposes it. The FSM advances along the accepted path only,
  when the scheduler processes the round (``advance_grammar_fsm``);
* ``logit_bias``: the request's bias on every slot;
* custom logit processors: every slot with its request's parameters. A
  processor that depends on its parameters only is exact; one that reads the
  request's generated text sees it as of the round start.

Requests without features share the batch and run the same kernels; the extra
work is only done when some request of the batch needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..tree.paths import first_child_next_sibling, path_token_counts
from .penalties import PenaltyTable, RowPenalties, apply_path_penalties, has_penalties

logger = logging.getLogger("sglang_ddtree")


@dataclass
class RoundFeatures:
    penalties: RowPenalties | None = None
    penalty_rows: torch.Tensor | None = None  # [n] batch rows of the penalised requests
    grammar_tree: object | None = None  # sglang GrammarTree, copying to the host
    trees: object | None = None  # the round's Trees, where a feature reads them


class RequestFeatures:
    def __init__(self, pool_rows: Callable[[], int], vocab: int, device, is_logging_rank: bool = True):
        self.penalty_table = PenaltyTable(pool_rows, vocab, device)
        self.vocab = vocab
        self._is_logging_rank = is_logging_rank
        self._logged: set[str] = set()

    def on_prefill(self, batch) -> None:
        reqs = getattr(batch, "reqs", None)
        if reqs:
            self.penalty_table.register(reqs)

    def start_round(self, batch, trees) -> RoundFeatures:
        """Before the verify forward: gather the penalty state and start copying the
        tree links to the host for the grammar traversal (overlapping the forward).
        ``trees`` is the round's :class:`Trees`, or a function that makes them (a decoding
        step makes its root-only trees only where a feature reads them)."""
        features = RoundFeatures()
        rows = penalised_rows(batch)
        penalised = bool(rows) and self.penalty_table.counts is not None
        if penalised or batch.has_grammar:
            features.trees = trees = trees() if callable(trees) else trees
        if penalised:
            # Only the penalised requests pay: their rows are adjusted as a sub-batch.
            features.penalty_rows = torch.tensor(rows, dtype=torch.int64).to(trees.tokens.device)
            features.penalties = self.penalty_table.rows(batch.req_pool_indices[features.penalty_rows])
            self._log_once("penalties", "exact per-path penalties are computed after the verify forward")
        if batch.has_grammar:
            from sglang.srt.speculative.spec_utils import GrammarTree

            next_token, next_sibling = first_child_next_sibling(trees.parents)
            features.grammar_tree = GrammarTree.from_device(next_token, next_sibling, trees.tokens)
            self._log_once(
                "grammar",
                "per-node grammar masks are built on the host each round (overlapping the verify forward)",
            )
        return features

    def apply(self, batch, features: RoundFeatures, logits: torch.Tensor, grammar_barrier) -> None:
        """``logits`` ``[bs * width, vocab]`` in place, after the verify forward."""
        bs = len(batch.reqs)
        width = logits.shape[0] // bs
        logits_3d = logits.view(bs, width, -1)
        if features.penalties is not None:
            self._apply_penalties(features, logits_3d[..., : self.vocab], features.trees)
        if features.grammar_tree is not None:
            self._apply_grammar(batch, features.grammar_tree, logits, grammar_barrier)
        sampling_info = batch.sampling_info
        if sampling_info is None:
            return
        if sampling_info.logit_bias is not None:
            logits_3d.add_(sampling_info.logit_bias.to(logits.dtype)[:, None, :])
        if sampling_info.has_custom_logit_processor:
            from sglang.srt.layers.sampler import apply_custom_logit_processor

            self._log_once("custom", "custom logit processors run on the host for every tree slot")
            apply_custom_logit_processor(logits, sampling_info, num_tokens_in_batch=width)

    @staticmethod
    def _apply_penalties(features: RoundFeatures, logits_3d, trees) -> None:
        rows = features.penalty_rows
        tokens = trees.tokens.index_select(0, rows)
        path_counts = path_token_counts(trees.visibility().index_select(0, rows), tokens)
        adjusted = logits_3d.index_select(0, rows)
        depths = trees.depths.index_select(0, rows)
        apply_path_penalties(adjusted, features.penalties, tokens, depths, path_counts)
        logits_3d.index_copy_(0, rows, adjusted)

    def _apply_grammar(self, batch, grammar_tree, logits, grammar_barrier) -> None:
        from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask

        grammar_mask = build_grammar_vocab_mask(
            reqs=batch.reqs,
            tree=grammar_tree,
            sampling_info=batch.sampling_info,
            device=logits.device,
            barrier=grammar_barrier,
        )
        if grammar_mask is not None:
            grammar_mask.apply(logits)

    def finish_round(self, batch, features: RoundFeatures, acceptance=None) -> None:
        """After the accept walk (``acceptance``; None: a decoding step, the root alone
        accepted)."""
        if features.penalties is not None:
            rows, tokens = features.penalty_rows, features.trees.tokens.index_select(0, features.penalty_rows)
            if acceptance is None:
                path, accept_lens = torch.zeros_like(tokens), torch.zeros_like(rows)
            else:
                path, accept_lens = (
                    acceptance.path.index_select(0, rows),
                    acceptance.accept_lens.index_select(0, rows),
                )
            self.penalty_table.advance(
                batch.req_pool_indices[rows], features.penalties, tokens, path, accept_lens
            )

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged and self._is_logging_rank:
            self._logged.add(key)
            logger.info("DDTREE request features: %s.", message)


def penalised_rows(batch) -> list[int]:
    """The batch's rows whose requests have a penalty; SGLang's own orchestrator first, which
    knows when none has (checking every request costs the host per step at large batches)."""
    orchestrator = getattr(batch.sampling_info, "penalizer_orchestrator", None)
    if orchestrator is not None and not orchestrator.is_required:
        return []
    return [i for i, r in enumerate(batch.reqs) if has_penalties(r.sampling_params)]
