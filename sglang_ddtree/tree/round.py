"""One whole DDTree round, each step by its reference: the specification of the worker's
round (``adapter/worker.py``) without SGLang, on the CPU.

    top-k -> build -> layout -> posterior -> accept -> commit plan

The target's part (the verify forward and its sampling) is the caller's ``posterior``:
given the layout, the target's token for every tree slot. Shapes as in ``tree/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .accept import accept_walk_ref, commit_sources_ref
from .build import topk_log_probs
from .layout import TreeBatch, build_tree_batch_ref, pack_mask_words
from .types import Acceptance

Posterior = Callable[[TreeBatch, np.ndarray], np.ndarray]  # (layout, positions) -> [bs, width]


@dataclass(frozen=True)
class RoundResult:
    layout: TreeBatch  # tokens, depths, parents, tree sizes, visibility
    positions: np.ndarray  # [bs, width] prefix + depth
    mask_words: np.ndarray  # [bs, width, ceil(width / 32)] int32, visibility bit-packed
    acceptance: Acceptance  # path, accept lengths, bonus, output tokens, new_seq_lens
    commit_sources: np.ndarray  # [bs, width] verify slot whose KV each final position takes


def draft_k(budget: int, vocab: int, max_topk: int | None = None) -> int:
    """Candidates kept per depth: ``min(budget, vocab)``, capped by ``max_topk``."""
    k = min(budget, vocab)
    return k if max_topk is None else min(k, max_topk)


def reference_round(
    draft_logits: torch.Tensor,  # [bs, depth, vocab]
    roots: np.ndarray,  # [bs] the target's last token per request
    prefix_lens: np.ndarray,  # [bs] committed tokens before the round
    posterior: Posterior,
    budget: int,
    width: int | None = None,
    max_topk: int | None = None,
) -> RoundResult:
    width = budget + 1 if width is None else width
    k = draft_k(budget, int(draft_logits.shape[-1]), max_topk)
    tops = [topk_log_probs(logits, k) for logits in draft_logits]  # 1. top-k per depth
    log_probs = np.stack([t.log_probs for t in tops])
    token_ids = np.stack([t.token_ids for t in tops])
    layout = build_tree_batch_ref(log_probs, token_ids, roots, budget, width)  # 2. build
    positions = layout.positions(prefix_lens)  # 3. verify layout
    target_tokens = posterior(layout, positions)  # 4. the target's token per slot
    walk = accept_walk_ref(layout.tokens, layout.parents, layout.tree_sizes, target_tokens)  # 5.
    walk.new_seq_lens = torch.from_numpy(np.asarray(prefix_lens, dtype=np.int64)) + walk.accept_lens + 1
    sources = commit_sources_ref(walk.path.numpy(), walk.accept_lens.numpy())  # 6. commit plan
    return RoundResult(layout, positions, pack_mask_words(layout.visibility), walk, sources)
