"""The offline replay of ``pair_eval``: the greedy tokens per round each arm should reach,
from the training code's models in plain torch and the reference round (``tree/round.py``)
replayed along the plain server's output. A server that ran the drafter differently from how
it was trained shows up as a gap between this prediction and what it served."""

from __future__ import annotations

import numpy as np
import torch

from lab.bench.pair_eval_serving import Arm


def greedy_posterior(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The target's greedy token after every slot, known from the plain server's output:
    the token after position ``p`` is ``tokens[p + 1]`` on the slots the walk can reach
    (those matching the output so far); -1 (no token) past the end of the output."""
    nxt = positions + 1
    return np.where(nxt < len(tokens), tokens[np.minimum(nxt, len(tokens) - 1)], -1)


def load_models(pair: dict):
    """The pair's target and drafter as the training code's modules, in float32: (spec,
    target, drafter, mask token id). The drafter's mask embedding is the target's."""
    from safetensors.torch import load_file

    from lab.models.pair_modules import Drafter, PairSpec, Target

    spec_fields = dict(pair["manifest"]["spec"])
    spec_fields["target_layer_ids"] = tuple(spec_fields["target_layer_ids"])
    spec = PairSpec(**spec_fields)
    vocab = int(pair["manifest"]["tokenizer"]["vocab_size"])
    mask_id = int(pair["manifest"]["tokenizer"]["mask_token_id"])
    target, drafter = Target(spec, vocab), Drafter(spec)
    target.load_state_dict({k: v.float() for k, v in load_file(pair["target"] / "model.safetensors").items()})
    weights = {k: v.float() for k, v in load_file(pair["drafter"] / "model.safetensors").items()}
    weights["mask_embedding"] = target.model.embed_tokens.weight[mask_id].clone()
    drafter.load_state_dict(weights)
    return spec, target, drafter, mask_id


@torch.no_grad()
def drafter_logits_along(models, seq: torch.Tensor, start: int) -> torch.Tensor:
    """The drafter's logits ``[positions, block - 1, vocab]`` for a block anchored at every
    position ``start..`` of ``seq`` ``[1, length]``, from the target's features of ``seq``
    (all blocks in one drafter forward, each seeing the context before its anchor)."""
    from lab.models.pair_modules import block_layout

    spec, target, drafter, mask_id = models
    block, length = spec.block_size, seq.shape[1]
    _, feats = target(seq, capture=spec.target_layer_ids)
    anchors = torch.arange(start, length)[None]
    pos, mask = block_layout(anchors, length, block)
    block_ids = torch.full_like(pos, mask_id)
    block_ids[:, ::block] = seq[:, start:]
    hidden = drafter(target.model.embed_tokens(block_ids), pos, feats, mask)
    return target.logits(hidden.view(-1, block, hidden.shape[-1])[:, 1:])


def replay_rounds(logits: torch.Tensor, tokens: np.ndarray, start: int, arm: Arm) -> list[int]:
    """Tokens per round (accepted drafts + the bonus) of ``arm``'s greedy rounds along
    ``tokens`` (prompt + output) from position ``start``, with the drafter's logits of
    :func:`drafter_logits_along`; the last round stops at the end of the output, as the server."""
    from sglang_ddtree.tree.round import reference_round

    rounds, a = [], start
    while a < len(tokens) - 1:
        result = reference_round(
            logits[a - start][None],
            tokens[a : a + 1],
            np.array([a]),
            lambda layout, positions: greedy_posterior(tokens, positions),
            arm.budget,
            max_topk=arm.max_topk,
        )
        accepted = int(result.acceptance.accept_lens[0])
        rounds.append(accepted + 1)
        a += accepted + 1
    return rounds


@torch.no_grad()
def offline_replay(
    pair: dict, prompts: list[dict], greedy: list[list[int]], arms: list[Arm]
) -> dict[str, float]:
    """Greedy tokens per round each arm should reach, replaying the server's rounds
    on the plain server's output with the training code's models (float32)."""
    models = load_models(pair)
    rounds = {arm.name: [] for arm in arms if arm.speculative}
    for prompt, out in zip(prompts, greedy):
        seq = torch.tensor([prompt["input_ids"] + out])
        start = len(prompt["input_ids"])
        logits = drafter_logits_along(models, seq, start)
        for arm in arms:
            if arm.speculative:
                rounds[arm.name] += replay_rounds(logits, seq[0].numpy(), start, arm)
    return {name: sum(r) / max(len(r), 1) for name, r in rounds.items()}
