"""Shared fixtures: the tiny models, and real SGLang servers in CPU mode.

Order of a run: the tests that start no server first, while the background jobs
(tests/background.py: the A/B tool's runs, the launcher cases, the child engine) run
on the other core; then the server tests, each server launched while the test before
it runs (tests/serving.py, ServerRegistry); last, the tests that read the background
jobs' results.

At the end of a run the suite checks that no server, load generator or tool it
started still runs (each carries the run's tag in its environment)."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import signal
import uuid
import warnings

import pytest
from background import BACKGROUND
from processes import RUN_TAG_ENV, kill_all, wait_none_left
from serving import SHARED_SERVERS, RunSchedule

from lab.models.tiny import build_tiny_models

# Long enough for a server killed at the very end to finish dying on a loaded machine.
LEFTOVER_GRACE_S = 60.0


def pytest_configure(config):
    os.environ[RUN_TAG_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # One OpenMP thread in every process the run starts (servers, tools, launcher cases):
    # a server's scheduler otherwise runs a team as wide as the machine, whose threads
    # spin between the tiny models' small ops. Measured on 2 cores: the same greedy
    # requests took 16 core-seconds instead of 7, in no less time, and starved whatever
    # ran beside them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # This process too: torch, imported before this hook, sized its team from the machine, and
    # its in-process tests (the online budget's predictions, the kernels' references) spun
    # beside the servers: 0.5 s tests took 41 s in a full run.
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ.setdefault("SGLANG_DISABLED_MODEL_ARCHS", ",".join(_unserved_model_modules()))


# The model files of SGLang's registry that the servers of this suite load: the tiny and
# trained targets (Qwen3ForCausalLM), the tiny MLA target (DeepseekV3ForCausalLM) and the
# DFlash drafters (DFlashDraftModel). A scheduler imports every other model file at start
# to list the architectures it could serve (about 3.5 core-seconds a server); the rest
# are left out (SGLANG_DISABLED_MODEL_ARCHS). A test serving another architecture adds
# its file here (else its server refuses the model, naming the architecture).
SERVED_MODEL_MODULES = {"qwen3", "deepseek_v2", "dflash"}


def _unserved_model_modules() -> list[str]:
    spec = importlib.util.find_spec("sglang.srt.models")
    folders = list(spec.submodule_search_locations or []) if spec else []
    names = {info.name for info in pkgutil.iter_modules(folders) if not info.ispkg}
    return sorted(names - SERVED_MODEL_MODULES - {"registry"})
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


def _serving() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def _phase(item) -> int:
    """0: starts no server; 1: serves; 2: reads a background job's result."""
    if "server" not in item.keywords:
        return 0
    return 2 if BACKGROUND.reads_a_job(item.nodeid) else 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=_phase)  # stable: file order within a phase
    if _serving():
        return
    skip = pytest.mark.skip(reason="needs the CPU serving mode: SGLANG_USE_CPU_ENGINE=1 (make test sets it)")
    for item in items:
        if "server" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    RunSchedule.set_order([item.nodeid for item in session.items if not item.get_closest_marker("skip")])
    if _serving() and not session.config.option.collectonly:
        BACKGROUND.start()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Tests before this one have run; this one runs now.
    RunSchedule.now_running(item.nodeid)
    # Shared servers no remaining test needs stop; the servers the next tests need start
    # now, if they have not (ServerRegistry.release_finished, launch_next): two at once
    # once the background jobs are done (a start keeps about one core busy, a test with
    # its server ready mostly less), one while they run.
    if _serving():
        SHARED_SERVERS.max_ahead = 2 if BACKGROUND.idle() else 1
        try:
            SHARED_SERVERS.release_finished()
            SHARED_SERVERS.launch_next()
        except Exception as error:  # the test that takes the server meets it again
            warnings.warn(f"starting or stopping servers ahead failed: {error!r}", stacklevel=1)


def pytest_sessionfinish(session, exitstatus):
    # The session fixtures may not be torn down yet (an interrupted run tears them
    # down after this hook): the background jobs and the shared servers stop here first.
    BACKGROUND.stop()
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


@pytest.fixture
def registered_hooks(monkeypatch) -> list:
    """The ``(target, hook)`` pairs SGLang's ``HookRegistry.register`` is given during the test,
    in order, none applied: a module's ``install()`` then hands its hooks to the test."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered = []
    monkeypatch.setattr(
        HookRegistry, "register", lambda target, hook, kind: registered.append((target, hook))
    )
    return registered


@pytest.fixture(scope="session")
def tiny():
    return build_tiny_models()


@pytest.fixture(scope="session")
def servers():
    """Servers shared across test modules (tests/serving.py, ServerRegistry)."""
    yield SHARED_SERVERS
    SHARED_SERVERS.stop_all()
