"""The verify input of a DDTree round, as SGLang's attention backends see it.

``SpecInputType`` is a closed enum, so DDTree reuses ``DFLASH_VERIFY`` on purpose:
every backend path that accepts a DFlash verify (target-verify forward of a fixed
width per request, CUDA-graph capture at that width) accepts this one. What a
chain verify lacks is the tree mask, carried in two forms:

* ``tree_visibility`` ``[bs, width, width]`` bool - read by the torch_native
  verify forward (``adapter/attention/torch_native.py``);
* ``custom_mask`` - SGLang's flat per-request ``[width, prefix + width]`` allow
  mask, read by the GPU backends' custom-mask verify paths.

``topk`` stays 1: backends that gate EAGLE tree metadata on ``topk > 1`` must not
build EAGLE topology for a DDTree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    tree_visibility: torch.Tensor | None = None  # [bs, width, width] bool
