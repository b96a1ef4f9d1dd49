"""The one training loop of the trained pair (target and drafter alike): AdamW with
warm-up and cosine decay, gradient clipping, a step cap that keeps a phase within its
time, and a log that keeps every line."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn


class Log:
    """Prints and keeps every line (written to ``train_log.txt``)."""

    def __init__(self):
        self.lines: list[str] = []
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.start:7.1f}s] {msg}"
        self.lines.append(line)
        print(line, flush=True)


def autocast_factory(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in module.named_parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for n, p in module.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    fused = next(module.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def _lr(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


class StepBudget:
    """Caps a phase's steps so that it ends within ``seconds``: the step time is
    measured over steps 5..20 and the cap is fixed from then on (the manifest
    records the steps actually run; pass them explicitly to reproduce a run)."""

    def __init__(self, steps: int, seconds: float, device: torch.device, log: Log, name: str):
        self.total, self.seconds, self.device, self.log, self.name = steps, seconds, device, log, name
        self.started = time.perf_counter()
        self._t5 = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def after(self, step: int) -> None:
        """Call after each step (``step`` counted from 0)."""
        if step == 4 or (step == 19 and self._t5 is not None):
            self._sync()
            if step == 4:
                self._t5 = time.perf_counter()
                return
            per_step = (time.perf_counter() - self._t5) / 15
            left = self.seconds - (time.perf_counter() - self.started)
            cap = max(20, 20 + int(left / per_step))
            if cap < self.total:
                self.log(
                    f"{self.name}: {per_step * 1e3:.1f} ms/step; {self.total} steps capped to {cap} (time limit)"
                )
                self.total = cap
            else:
                self.log(f"{self.name}: {per_step * 1e3:.1f} ms/step")


def train_loop(
    module: nn.Module, name: str, lr: float, steps: int, seconds: float, device, log, batch_loss
) -> dict:
    """AdamW with warm-up and cosine decay, gradient clipping at 1, and a step cap that ends
    the phase within ``seconds`` (``StepBudget``). ``batch_loss()`` draws the next batch and
    returns its loss and a callable giving extra text for the progress line."""
    opt = _optimizer(module, lr)
    module.train()
    recent = []
    budget = StepBudget(steps, seconds, device, log, name)
    started = time.perf_counter()
    step = 0
    while step < budget.total:
        for group in opt.param_groups:
            group["lr"] = _lr(step, budget.total, lr)
        loss, describe = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        budget.after(step)
        step += 1
        if step % 10 == 0 or step == budget.total:
            recent.append(loss.item())
        if step % 200 == 0 or step == 1 or step == budget.total:
            log(
                f"{name}: step {step}/{budget.total} loss {loss.item():.4f} "
                f"{describe()}({time.perf_counter() - started:.0f}s)"
            )
    module.eval()
    return {"steps": step, "final_train_loss": float(np.mean(recent[-20:]))}
