"""Checks whose work runs in other processes, done in the background of the run.

Some tests only start processes and read what they did: the A/B tool's runs, the
launcher's fail-fast cases, an in-process engine in a child. Their work (mostly a
minute of imports each, on one core) needs nothing from the test process, so it runs in
``WORKERS`` threads from the start of the run, one job per thread at a time, in the
order of the tests that read them, while this process runs the other tests.
conftest.py orders the tests that start no server first (the jobs fill the other core
while they run) and the tests that read a job's result last, when it is long done.

A module declares a job at import (:meth:`Background.declare`), naming the test that
reads it; a job runs only if that test will. The test reads the result with
:meth:`Background.result` (an exception the job raised is raised there)."""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from serving import RunSchedule

# Two: the jobs take longer than the tests that start no server, and the rest of them
# then runs beside the server tests; two threads keep the tail short.
WORKERS = 2


@dataclasses.dataclass
class Job:
    name: str
    test: str  # a part of the node id of the test that reads the result
    run: Callable[[Job], object]
    folder: Path | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: object = None
    error: BaseException | None = None
    processes: list = dataclasses.field(default_factory=list)

    def track(self, process):
        """Register a process the job started (a Popen or a launch.ProcessGroup), for
        the end of the run to stop if the job still runs then."""
        self.processes.append(process)
        return process


class Background:
    def __init__(self):
        self._jobs: dict[str, Job] = {}
        self._queue: list[Job] = []
        self._pending: list[Job] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._root: Path | None = None

    def declare(self, name: str, test: str, run: Callable[[Job], object]) -> None:
        self._jobs[name] = Job(name, test, run)

    def reads_a_job(self, nodeid: str) -> bool:
        """Whether the test ``nodeid`` reads a declared job's result."""
        return any(job.test in nodeid for job in self._jobs.values())

    def start(self) -> None:
        """Run, in the workers, every declared job whose test will run, in test order."""
        ranked = []
        for job in self._jobs.values():
            index = RunSchedule.first_index((job.test,))
            if index is not None:
                ranked.append((index, job))
        self._queue = [job for _, job in sorted(ranked, key=lambda pair: pair[0])]
        self._pending = list(self._queue)
        for number in range(min(WORKERS, len(self._queue))):
            thread = threading.Thread(target=self._work, name=f"background-jobs-{number}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def idle(self) -> bool:
        """No job left to run."""
        return not any(thread.is_alive() for thread in self._threads)

    def job(self, name: str) -> Job:
        return self._jobs[name]

    def result(self, name: str, timeout: float = 3600.0):
        job = self._jobs[name]
        if job not in self._queue:  # not started ahead (its test was not expected to run)
            self._run(job)
        assert job.done.wait(timeout), f"background job {name} did not finish in {timeout:.0f} s"
        if job.error is not None:
            raise job.error
        return job.value

    def stop(self) -> None:
        """The end of the run: no further job starts; the processes of running ones stop
        (again after the workers end: one may have started a process meanwhile)."""
        self._stopping.set()
        self._stop_processes()
        for thread in self._threads:
            thread.join(timeout=60)
        self._stop_processes()

    def _stop_processes(self) -> None:
        for job in list(self._jobs.values()):
            for process in list(job.processes):
                if isinstance(process, subprocess.Popen):
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                else:
                    process.stop(graceful_timeout=5)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                job = self._pending.pop(0)
            if self._stopping.is_set():
                job.error = RuntimeError("the run ended before this background job started")
                job.done.set()
                continue
            self._run(job)

    def _run(self, job: Job) -> None:
        if job.done.is_set():
            return
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="sglang-ddtree-background-"))
        job.folder = self._root / job.name
        job.folder.mkdir(exist_ok=True)
        try:
            job.value = job.run(job)
        except BaseException as error:  # re-raised in the test that reads it
            job.error = error
        finally:
            job.done.set()


BACKGROUND = Background()
