"""Where a number was measured: device, driver, versions, commit, date, host.

``stamp()`` is the provenance of one measurement; ``host_stamp()`` adds the CPU, every GPU
and the serving stack's versions (every A/B report carries it); ``host_load()`` is the
host's state beside a timed cell; ``device_name()`` the device part of a series name.
Nothing here imports SGLang; CUDA is only queried.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout's root (else no git)


def _run(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """The commit the numbers belong to: ``$BENCH_COMMIT`` if set (copies without .git), else git."""
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    sha = _run(["git", "rev-parse", "HEAD"])
    if sha is None:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return sha + ("-dirty" if dirty else "")


def stamp() -> dict:
    """Provenance of a measurement: device, driver, library versions, commit, date (UTC)."""
    info: dict = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
        smi = _run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]
        )
        if smi:
            parts = [p.strip() for p in smi.splitlines()[0].split(",")]
            info["driver"] = parts[0]
            if len(parts) >= 3:
                info["max_clocks"] = {"sm": parts[1], "mem": parts[2]}
        else:
            info["driver"] = None
    else:
        info.update(device="cpu", driver=None)
    return info


def host_stamp() -> dict:
    """``stamp()`` plus what a served A/B run also records: CPU model and cores, every GPU,
    and the serving stack's versions. Called after every server has stopped."""
    info = stamp()
    info["cpu_model"] = _cpu_model()
    info["cpu_count"] = os.cpu_count()
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    info["gpus"] = [line.strip() for line in smi.splitlines()] if smi else []
    from .. import __version__

    info["versions"] = {
        "sglang": _version("sglang"),
        "torch": _version("torch"),
        "sglang_ddtree": _version("sglang-ddtree") or __version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
    }
    return info


def host_load(marker: str = "sglang") -> dict:
    """The host's state beside a timed cell: its 1-minute load average and how many processes
    name ``marker`` in their command line (a server's own few; more after a server whose
    processes outlived it). A served cell's prefill is bound by the host's launch pace
    (docs/gpu.md), so a cell measured beside other work on the host shows it here."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += marker.encode() in (entry / "cmdline").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
    return {"load_1m": round(os.getloadavg()[0], 2), f"{marker}_processes": count}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def device_name(cpu: bool, gpus_per_server: int = 1) -> str:
    """The device part of a series name: ``cpu``, ``h200`` (``NVIDIA H200``), ``h200x8`` for
    servers over eight GPUs. Read from ``nvidia-smi`` (the first visible GPU)."""
    import re

    if cpu:
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    if visible.isdigit():
        query.insert(1, f"--id={visible}")
    out = _run(query)
    words = re.split(r"[^a-z0-9]+", (out or "gpu").splitlines()[0].lower())
    words = [w for w in words if w and w not in ("nvidia", "amd", "geforce", "rtx", "tesla", "instinct")]
    name = words[0] if words else "gpu"  # NVIDIA H200 -> h200, NVIDIA A100-SXM4-80GB -> a100
    return name + (f"x{gpus_per_server}" if gpus_per_server > 1 else "")
