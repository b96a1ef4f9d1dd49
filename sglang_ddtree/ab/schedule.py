"""Which schedule a run uses (``--schedule auto|interleaved|alternating``), and why.

Interleaved needs every arm's server up at once. On a CPU they share the host's memory and the
tool's CPU runs are small models: always interleaved. On GPUs every server takes
``--mem-fraction-static`` of each GPU's memory for its weights and KV cache, plus its CUDA
context, activations and graphs outside that share; the servers fit together where those add up
to at most :data:`GPU_SHARE` of the memory. Where ``--mem-fraction-static`` is given, that is
the check. Where it is not, the tool estimates it: the weights of target and drafter (their
files, split over the tensor-parallel ranks) with room for a KV cache, and gives every server
the same share (``--mem-fraction-static`` added to every arm). A model whose size it cannot
read (a hub id not in the local cache) runs alternating unless ``--schedule`` says otherwise.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .arms import ABError, flag_value, has_flag

GPU_SHARE = 0.90  # of each GPU's memory, for every server of an interleaved run together
OUTSIDE_STATIC_GIB = 3.0  # per server: CUDA context, activations, CUDA graphs (not in the static share)
KV_ROOM = 0.5  # KV cache room per server, as a share of its weights (at least MIN_KV_GIB)
MIN_KV_GIB = 2.0
MAX_FRACTION = 0.88


@dataclass
class Schedule:
    name: str  # interleaved | alternating
    reason: str
    added_args: list[str] = field(default_factory=list)  # flags added to every arm


def _gib(n: float) -> float:
    return n / 2**30


def model_bytes(path: str | None) -> int | None:
    """The size of a model's weight files (a local folder, or a hub id in the local cache)."""
    if not path:
        return 0
    folder = Path(path)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached, or no hub library: unknown
            return None
    files = [f for f in folder.glob("*") if f.suffix in (".safetensors", ".bin", ".pt", ".gguf")]
    return sum(f.stat().st_size for f in files) if files else None


def gpu_memory_bytes() -> int | None:
    """Total memory of the first GPU the servers would use (``nvidia-smi``), or None."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        query.insert(1, f"--id={visible}")
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    try:
        return int(float(out.stdout.strip().splitlines()[0])) * 2**20  # MiB
    except ValueError:
        return None


def parallel_size(args: list[str]) -> int:
    """GPUs one server spreads its weights over (``--tp``/``--tp-size``; pipeline stages too)."""
    tp = flag_value(args, "--tp-size") or flag_value(args, "--tp") or "1"
    pp = flag_value(args, "--pp-size") or flag_value(args, "--pp") or "1"
    try:
        return max(1, int(tp)) * max(1, int(pp))
    except ValueError:
        return 1


def _fractions(arms) -> list[float] | None:
    values = [flag_value(a.server_args, "--mem-fraction-static") for a in arms]
    if any(v is None for v in values):
        return None
    try:
        return [float(v) for v in values]
    except ValueError as error:
        raise ABError(f"--mem-fraction-static: {error}") from None


def choose(requested: str, arms, cpu: bool, model: str, drafter: str | None) -> Schedule:
    """The schedule for ``arms`` (their server flags as built), and flags to add to every arm."""
    n = len(arms)
    # Idle servers that poll would take the host CPU the measured server's scheduler needs.
    interleave_extra = ["--sleep-on-idle"]
    if cpu:
        if requested == "alternating":
            return Schedule("alternating", "asked for (--schedule alternating)")
        why = (
            "asked for (--schedule interleaved)"
            if requested == "interleaved"
            else (f"a CPU run: the {n} servers share the host's memory and fit together")
        )
        return Schedule("interleaved", why, interleave_extra)
    if requested == "alternating":
        return Schedule("alternating", "asked for (--schedule alternating)")
    fractions = _fractions(arms)
    if fractions is not None:
        total = sum(fractions)
        fits = total <= GPU_SHARE
        text = (
            f"{n} servers x --mem-fraction-static {max(fractions):g} = {total:.2f} of each GPU's memory "
            f"{'<=' if fits else '>'} {GPU_SHARE:.2f}"
        )
        if requested == "interleaved":
            return Schedule("interleaved", f"asked for (--schedule interleaved); {text}", interleave_extra)
        if fits:
            return Schedule("interleaved", f"the servers fit together: {text}", interleave_extra)
        return Schedule("alternating", f"the servers do not fit together: {text}")
    estimate = _estimate(arms, model, drafter)
    if estimate is None or isinstance(estimate, str):
        why = estimate or "no estimate"
        if requested == "interleaved":
            return Schedule(
                "interleaved",
                f"asked for (--schedule interleaved); no --mem-fraction-static given and {why}: "
                "SGLang's own default share per server",
                interleave_extra,
            )
        return Schedule(
            "alternating",
            f"no --mem-fraction-static given and {why}; pass --server-args '--mem-fraction-static F' "
            "(F x servers <= 0.9) to run interleaved",
        )
    fraction, text = estimate
    if fraction is None:
        if requested == "interleaved":
            return Schedule(
                "interleaved", f"asked for (--schedule interleaved), though {text}", interleave_extra
            )
        return Schedule("alternating", f"the servers do not fit together: {text}")
    reason = f"the servers fit together: {text}; every arm gets --mem-fraction-static {fraction:.3f}"
    if requested == "interleaved":
        reason = "asked for (--schedule interleaved); " + reason
    return Schedule("interleaved", reason, [*interleave_extra, "--mem-fraction-static", f"{fraction:.3f}"])


def _estimate(arms, model: str, drafter: str | None):
    """``(fraction, text)`` for servers that fit (``fraction`` None where they do not), or a
    string saying why there is no estimate."""
    memory = gpu_memory_bytes()
    if memory is None:
        return "no GPU memory could be read (nvidia-smi)"
    target = model_bytes(model)
    draft = model_bytes(drafter) if any(a.kind != "plain" for a in arms) else 0
    if target is None or draft is None:
        return "the model's size is unknown (not a local folder or a cached hub model)"
    n = len(arms)
    ranks = parallel_size(arms[0].server_args)
    weights = (target + draft) / ranks
    need = weights + max(KV_ROOM * weights, MIN_KV_GIB * 2**30)  # the static share's least
    per_server = GPU_SHARE * memory / n - OUTSIDE_STATIC_GIB * 2**30
    text = (
        f"{n} servers, each {_gib(weights):.1f} GiB of weights per GPU (target + drafter over {ranks} "
        f"GPU(s)) + KV room + {OUTSIDE_STATIC_GIB:g} GiB outside the static share, on "
        f"{_gib(memory):.0f} GiB GPUs"
    )
    if per_server < need:
        return None, text
    return min(per_server / memory, MAX_FRACTION), text


def apply(schedule: Schedule, arms) -> list[str]:
    """Add the schedule's flags to every arm that lacks them; returns what was added (one
    string per flag and its value)."""
    groups, flags = [], schedule.added_args
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            value = flags[i + 1 : i + 2] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else []
            groups.append([flag, *value])
    added = []
    for group in groups:
        for arm in arms:
            if not has_flag(arm.server_args, group[0]):
                arm.server_args += group
                if " ".join(group) not in added:
                    added.append(" ".join(group))
    return added
