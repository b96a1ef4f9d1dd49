"""Which processes a test run started, found by an environment tag every child inherits."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sglang_ddtree.launch import WATCHDOG_NAME

RUN_TAG_ENV = "SGLANG_DDTREE_TEST_RUN"
# Command-line marks of what the suite starts: servers (launcher, scheduler and
# detokenizer processes, which SGLang renames "sglang::..."), load generators,
# the A/B tool and the watchdogs guarding them.
LOAD_GENERATOR_MARKS = ("sglang.bench_serving", "sglang.benchmark.serving")
MARKS = ("sglang.launch_server", "sglang::", *LOAD_GENERATOR_MARKS, "lab.bench", WATCHDOG_NAME)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _running(entry: Path) -> bool:
    stat = _read(entry / "stat").decode(errors="replace")
    return bool(stat) and stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def tagged_processes(tag: str, marks=MARKS) -> dict[int, str]:
    """Live processes (pid -> command line) whose environment carries ``tag``
    and whose command line has one of ``marks``; this process excluded."""
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if needle not in _read(entry / "environ").split(b"\0"):
            continue
        cmd = _read(entry / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        if any(m in cmd for m in marks) and _running(entry):
            found[int(entry.name)] = cmd[:300]
    return found


def wait_none_left(tag: str, timeout: float) -> dict[int, str]:
    """Wait up to ``timeout`` s for every tagged process to end; returns those left."""
    deadline = time.monotonic() + timeout
    left = tagged_processes(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = tagged_processes(tag)
    return left


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
