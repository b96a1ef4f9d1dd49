"""What the tree-kernel benchmark measures on: one configuration's inputs (``Case``),
draft-like logits and a target posterior that accepts deep, all drawn on the GPU."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

VOCAB = 163840


@dataclass(frozen=True)
class Case:
    """One configuration's inputs, on the GPU: per-depth top-k ``[bs, depth, budget]`` log-probs
    and ids, the roots ``[bs]`` and the prefix lengths ``[bs]``."""

    block: int
    budget: int
    bs: int
    lp: torch.Tensor
    ids: torch.Tensor
    roots: torch.Tensor
    prefix: torch.Tensor

    @property
    def depth(self) -> int:
        return self.block - 1

    @property
    def width(self) -> int:
        return self.budget + 1

    def on_host(self) -> tuple[np.ndarray, ...]:
        """lp, ids, roots, prefix copied to the host (the copy the CPU builders pay)."""
        return tuple(t.cpu().numpy() for t in (self.lp, self.ids, self.roots, self.prefix))

    def __str__(self) -> str:
        return f"block={self.block} budget={self.budget} bs={self.bs}"


def draft_logits(bs: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 ``[bs, depth, VOCAB]`` draft-like logits: a few strong candidates per depth over a
    flat tail, drawn from ``gen`` (which goes on to draw the configurations' roots)."""
    dev = gen.device
    logits = torch.randn(bs, depth, VOCAB, generator=gen, device=dev) * 2.0
    boost = torch.randint(0, VOCAB, (bs, depth, 8), generator=gen, device=dev)
    logits.scatter_add_(-1, boost, torch.rand(bs, depth, 8, generator=gen, device=dev) * 12)
    return logits.bfloat16()


def first_two_children(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[bs, W]`` each: every slot's first and second child (smallest slots), -1 if none."""
    width = parents.shape[1]
    slots = torch.arange(width, device=parents.device)
    is_child = parents[:, None, :] == slots[None, :, None]  # [bs, parent, child]
    first = torch.where(is_child.any(-1), is_child.to(torch.int8).argmax(-1), -1)
    rest = is_child & (slots[None, None, :] != first[..., None])
    second = torch.where(rest.any(-1), rest.to(torch.int8).argmax(-1), -1)
    return first, second


def posterior_following(tokens: torch.Tensor, parents: torch.Tensor, seed: int):
    """A posterior that accepts deep: at every slot the second child (30%) if any, else the first."""
    g = torch.Generator(device=tokens.device).manual_seed(seed)
    first_child, sc = first_two_children(parents)
    use_second = torch.rand(first_child.shape, generator=g, device=tokens.device) < 0.3
    pick = torch.where(use_second & (sc >= 0), sc, first_child)
    noise = torch.randint(0, VOCAB, tokens.shape, generator=g, device=tokens.device)
    return torch.where(pick >= 0, tokens.gather(1, pick.clamp(min=0)), noise).contiguous()
