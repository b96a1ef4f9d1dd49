"""Shared fixtures: the tiny models, and real SGLang servers in CPU mode.

At the end of a run the suite checks that no server, load generator or tool it
started still runs (each carries the run's tag in its environment)."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from processes import RUN_TAG_ENV, kill_all, wait_none_left
from serving import SHARED_SERVERS, RunSchedule

from sglang_ddtree.models.tiny import build_tiny_models

# Long enough for a server killed at the very end to finish dying on a loaded machine.
LEFTOVER_GRACE_S = 60.0


def pytest_configure(config):
    os.environ[RUN_TAG_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    signal.signal(signal.SIGTERM, _stop_the_run)


def _stop_the_run(signum, frame):
    """SIGTERM (a CI runner's stop) ends the whole run as Ctrl-C does: fixtures tear down,
    servers stop, and no further test starts."""
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(autouse=True)
def _sigterm_stops_the_run():
    # Imported libraries may take SIGTERM over; take it back before every test.
    if signal.getsignal(signal.SIGTERM) is not _stop_the_run:
        signal.signal(signal.SIGTERM, _stop_the_run)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return
    skip = pytest.mark.skip(reason="needs the CPU serving mode: SGLANG_USE_CPU_ENGINE=1 (make test sets it)")
    for item in items:
        if "server" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    RunSchedule.remaining = [item.nodeid for item in session.items]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Tests before this one have run; this one runs now.
    while RunSchedule.remaining and RunSchedule.remaining[0] != item.nodeid:
        RunSchedule.remaining.pop(0)


def pytest_sessionfinish(session, exitstatus):
    # The session fixtures may not be torn down yet (an interrupted run tears them
    # down after this hook): the shared servers stop here first.
    SHARED_SERVERS.stop_all()
    left = wait_none_left(os.environ[RUN_TAG_ENV], LEFTOVER_GRACE_S)
    if not left:
        return
    kill_all(left)
    lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"processes started by the test run were still running at its end (now killed):\n{lines}"
    if reporter is not None:
        reporter.write_line(message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny():
    return build_tiny_models()


@pytest.fixture(scope="session")
def servers():
    """Servers shared across test modules (tests/serving.py, ServerRegistry)."""
    yield SHARED_SERVERS
    SHARED_SERVERS.stop_all()
