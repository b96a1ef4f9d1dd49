"""The A/B tool's two schedules: every arm's server up at once with the passes interleaved, or
the servers started one at a time, A B A B ..., every start measured.

**interleaved**: every arm's server is started together (their start-ups overlap); then per
concurrency level, ``--repeats`` rounds, each running one pass of every arm in an order rotated
round by round (round ``i`` starts with arm ``i``). The passes of one round lie close in time,
so a slow spell of the host hits every arm of the round alike; round ``i`` of one arm pairs
with round ``i`` of another.

**alternating**: one server at a time (where only one fits): ``--starts`` rounds, each starting
every arm's server in turn, in the order given, and running all its passes (every level,
``--repeats`` passes each) before stopping it. Start ``s`` of one arm pairs with start ``s`` of
another, pass for pass; the spread between an arm's own starts is reported.

Either way one load generator (``bench_serving`` in ``bench_worker.py``) runs the passes, one at
a time, and every server and the load generator are stopped on any exit: success, failure,
Ctrl-C, SIGTERM or SIGHUP (and by their watchdogs when this process is SIGKILLed).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..launch import ServerStartError
from . import phase_log
from .arms import ABError, Arm
from .profiling import profile_level
from .run import LoadWorker, check_server, launch, new_server, open_gate, run_pass, safe_name, stop, wait_up


class Interrupted(BaseException):
    """SIGTERM/SIGHUP, handled like Ctrl-C: stop everything, write what was measured."""


def _install_signal_handlers() -> dict:
    def handler(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. SIGHUP under nohup: keep ignoring it
                continue
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass
    return previous


def rotated(arms: list, i: int) -> list:
    k = i % len(arms)
    return arms[k:] + arms[:k]


class Engine:
    """One run: ``Engine(arms, opts, levels).run()`` -> (status, error text).

    ``on_server_ready(arm, server, record)``, when given, is called once each server has started
    and passed its side-check, before its passes (a preset's hook, e.g. to record what a
    replay drafter will serve)."""

    def __init__(
        self,
        arms: list[Arm],
        opts,
        levels: list[tuple[int, int]],
        on_server_ready: Callable | None = None,
    ):
        self.arms, self.opts, self.levels = arms, opts, levels
        self.on_server_ready = on_server_ready
        self.live: list[tuple[Arm, object, dict]] = []
        self.worker: LoadWorker | None = None
        self.worker_record: dict = {}
        self.skipped: list[str] = []
        self.dropped: dict[str, str] = {}  # arm (or arm and start) -> why (--keep-going)
        self.t0 = time.monotonic()
        self.timing: dict = {}
        self.pbar = None

    # ------------------------------------------------------------------ bookkeeping

    def passes_total(self) -> int:
        starts = self.opts.starts if self.opts.schedule == "alternating" else 1
        return len(self.arms) * len(self.levels) * self.opts.repeats * starts

    def _past_deadline(self) -> bool:
        limit = self.opts.time_limit
        return limit is not None and time.monotonic() - self.t0 > limit

    def _wait_for_file(self) -> None:
        """``--wait-file``: measure only once another job sharing the machine has finished."""
        path = getattr(self.opts, "wait_file", None)
        if not path or Path(path).exists():
            return
        self.pbar.set_description(f"waiting for {path}")
        began = time.monotonic()
        while not Path(path).exists() and not self._past_deadline():
            time.sleep(1.0)
        self.timing["waited_for_file_seconds"] = round(time.monotonic() - began, 1)

    def run(self) -> tuple[str, str | None]:
        from tqdm import tqdm

        status, error_text = "ok", None
        previous = _install_signal_handlers()
        names = ", ".join(a.name for a in self.arms)
        print(
            f"[ab] {len(self.arms)} arms ({names}), {self.opts.schedule} schedule, "
            f"{self.passes_total()} passes; logs in {self.opts.raw}",
            flush=True,
        )
        self.pbar = tqdm(total=self.passes_total(), unit="pass", dynamic_ncols=True, file=sys.stderr)
        try:
            self.worker = LoadWorker(self.opts.raw / "load_worker.log")
            self.worker_record = {"pid": self.worker.pid, "log": str(self.worker.log_path)}
            if self.opts.schedule == "interleaved":
                self._interleaved()
            else:
                self._alternating()
        except ABError as error:
            status, error_text = "failed", str(error)
        except (KeyboardInterrupt, Interrupted) as error:
            status, error_text = (
                "interrupted",
                f"interrupted ({str(error) or 'Ctrl-C'}); every server started was stopped",
            )
        finally:
            self.timing["measured_seconds"] = round(time.monotonic() - self.t0, 1)
            self._stop_all()
            if self.worker is not None:
                self.worker_record["stopped"] = self.worker.stop()
            self.pbar.close()
            self.timing["total_seconds"] = round(time.monotonic() - self.t0, 1)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status, error_text

    # ------------------------------------------------------------------ servers

    def _wait_up(self, arm: Arm, server, record: dict) -> None:
        try:
            wait_up(server, record)
        except ServerStartError as error:
            record["error"] = arm.error = str(error)
            raise ABError(f"the {arm.name!r} arm's server did not start:\n{error}") from error

    def _check(self, arm: Arm, server, record: dict) -> None:
        """A ready server's read-back and side-check, the preset's hook; then the load
        generator (the first time)."""
        self.pbar.set_description(f"{arm.name}: greedy check")
        try:
            check_server(server, record, self.opts, reference=arm.name == self.opts.reference_arm)
        except Exception as error:  # the side-check's request failed (the server died, or answered an error)
            record["error"] = arm.error = f"{type(error).__name__}: {error}"
            raise ABError(f"the {arm.name!r} arm failed: {arm.error}\n{server.log_tail(30)}") from error
        if self.on_server_ready is not None:
            self.on_server_ready(arm, server, record)
        self.worker.wait_ready(self.opts.start_timeout)

    def _wait_all_up(self, servers: list) -> None:
        """Every launched server, waited for side by side (each one's start-up time its own);
        the first arm (in the order given) that did not start fails the run."""
        self.pbar.set_description(f"starting {len(servers)} servers")
        errors: dict[str, BaseException] = {}

        def wait(item):
            arm, server, record = item
            try:
                self._wait_up(arm, server, record)
            except BaseException as error:  # noqa: BLE001 - raised below, in the main thread
                errors[arm.name] = error

        threads = [
            threading.Thread(target=wait, args=(item,), name=f"wait {item[0].name}") for item in servers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for arm, _, _ in servers:
            if arm.name in errors:
                self._fail_or_drop(arm, errors[arm.name])

    def _fail_or_drop(self, arm: Arm, error: BaseException) -> None:
        """An arm's server that did not start or failed its check: the run fails, or with
        ``--keep-going`` (and :class:`ABError`s only) the arm is dropped and the run goes on."""
        if not (getattr(self.opts, "keep_going", False) and isinstance(error, ABError)):
            raise error
        self.dropped[arm.name] = str(error)
        self.pbar.write(f"[ab] {arm.name} dropped (--keep-going): {str(error).splitlines()[0]}")

    def _stop_all(self) -> None:
        """Every server still up, stopped side by side (each may take its graceful seconds)."""
        threads = [
            threading.Thread(target=stop, args=(server, record), name=f"stop {arm.name}")
            for arm, server, record in self.live
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.live.clear()

    def _launch(self, arm: Arm, start: int, gated: bool = False) -> tuple:
        """``arm``'s ``start``-th server, launched (``gated``: held at SGLang's gate, after its
        imports and process start-up and before any GPU memory, until :func:`open_gate`)."""
        server, record = new_server(arm, self.opts, start, gated)
        self.live.append((arm, server, record))
        launch(server, record)
        return server, record

    def _stop(self, arm: Arm, server, record: dict) -> None:
        stop(server, record)
        self.live.remove((arm, server, record))

    # ------------------------------------------------------------------ passes

    def _measure(self, arm: Arm, server, concurrency: int, prompts: int, repeat: int, start: int, order: int):
        label = f"c={concurrency} rep {repeat + 1}/{self.opts.repeats}"
        alternating = self.opts.schedule == "alternating"
        if alternating:
            label = f"start {start + 1}/{self.opts.starts} {label}"
        # Alternating, the limit gates server starts only: a server that took its minutes to
        # start runs all its passes (cut short, its start would be spent for no cell).
        if not alternating and self._past_deadline():
            self.skipped.append(f"{arm.name} {label}: past --time-limit")
            self.pbar.update(1)
            return
        self.pbar.set_description(f"{arm.name}: {label}")
        stem = f"{safe_name(arm.name)}_c{concurrency}_r{repeat}"
        if self.opts.schedule == "alternating":
            stem += f"_s{start}"
        phases = phase_log.timed(arm.env)
        log_at = phase_log.log_size(server.log_path) if phases else 0
        try:
            result = run_pass(
                self.worker, server.url, self.opts, concurrency=concurrency, num_prompts=prompts, stem=stem
            )
        except ABError as error:
            arm.error = str(error)
            raise ABError(
                f"the {arm.name!r} arm failed: {error}\nserver log:\n{server.log_tail(20)}"
            ) from error
        result.update(
            concurrency_requested=concurrency,
            num_prompts=prompts,
            repeat=repeat,
            start=start,
            order=order,
            at_seconds=round(time.monotonic() - self.t0, 1),
        )
        if phases:  # the phase lines this pass added to the server's log (its warm-up's rounds too)
            result["phase_host_us"] = phase_log.phase_means(phase_log.read_since(server.log_path, log_at))
        arm.runs.append(result)
        self.pbar.update(1)
        accept = result["accept_length"]
        where = f"start {start + 1} " if self.opts.schedule == "alternating" else ""
        self.pbar.write(
            f"  {arm.name:<16} c={concurrency:<4} {where}rep {repeat + 1}: {result['output_throughput']:9.1f} tok/s"
            f"  TPOT {result['median_tpot_ms']:.1f} ms  TTFT {result['median_ttft_ms']:.1f} ms"
            + (f"  accept {accept:.2f}" if accept else "")
        )

    def _profile(self, arm: Arm, server, concurrency: int, start: int) -> None:
        """``--profile ARM@C``: ``C`` requests under SGLang's torch profiler (``profiling.py``)."""
        if (arm.name, concurrency) not in getattr(self.opts, "profile_specs", ()) or start > 0:
            return
        if self._past_deadline():
            self.skipped.append(f"{arm.name} profile c={concurrency}: past --time-limit")
            return
        self.pbar.set_description(f"{arm.name}: profile c={concurrency}")
        began = time.monotonic()
        record = profile_level(
            server.url,
            self.opts.profile_prompts,
            concurrency,
            self.opts.raw / "profiles" / f"{safe_name(arm.name)}_c{concurrency}",
            steps=self.opts.profile_steps,
            max_new_tokens=self.opts.output_len,
            timeout=self.opts.bench_timeout,
        )
        record = {"concurrency": concurrency, "start": start, **record}
        record["seconds"] = round(time.monotonic() - began, 1)
        arm.profiles.append(record)
        if "error" in record:
            self.pbar.write(f"  {arm.name:<16} c={concurrency:<4} profile failed: {record['error']}")
        else:
            busy = f", GPU busy {record['gpu_busy_us']:.0f} us" if "gpu_busy_us" in record else ""
            self.pbar.write(
                f"  {arm.name:<16} c={concurrency:<4} profile: {record['rounds']} rounds of "
                f"{record['round_us']:.0f} us{busy}"
            )

    # ------------------------------------------------------------------ schedules

    def _interleaved(self) -> None:
        servers = []
        for arm in self.arms:  # every start-up at once: they overlap
            servers.append((arm, *self._launch(arm, 0)))
        self._wait_all_up(servers)
        self.timing["servers_up_seconds"] = round(time.monotonic() - self.t0, 1)
        for arm, server, record in servers:
            if arm.name not in self.dropped:
                try:
                    self._check(arm, server, record)
                except ABError as error:
                    self._fail_or_drop(arm, error)
        for arm, server, record in servers:
            if arm.name in self.dropped:
                self._stop(arm, server, record)
        arms = [arm for arm in self.arms if arm.name not in self.dropped]
        if len(arms) < 2 and len(self.arms) >= 2:
            raise ABError(f"fewer than two arms started: {'; '.join(self.dropped.values())}")
        by_arm = {arm.name: server for arm, server, _ in servers}
        self.timing["checked_seconds"] = round(time.monotonic() - self.t0, 1)
        self._wait_for_file()
        self.pbar.total = len(arms) * len(self.levels) * self.opts.repeats
        self.pbar.refresh()
        for concurrency, prompts in self.levels:
            for repeat in range(self.opts.repeats):
                for order, arm in enumerate(rotated(arms, repeat)):
                    self._measure(arm, by_arm[arm.name], concurrency, prompts, repeat, 0, order)
            for arm in arms:
                self._profile(arm, by_arm[arm.name], concurrency, 0)

    def _alternating(self) -> None:
        turns = [
            (start, order, arm) for start in range(self.opts.starts) for order, arm in enumerate(self.arms)
        ]
        held = None  # the next turn's server, launched ahead and held at SGLang's gate (--prelaunch)
        for turn, (start, order, arm) in enumerate(turns):
            if self._past_deadline():  # a server held for this turn is stopped with the rest, unopened
                self.skipped.append(f"{arm.name} start {start + 1}: not started, past --time-limit")
                self.pbar.update(len(self.levels) * self.opts.repeats)
                continue
            if held is None:
                server, record = self._launch(arm, start)
            else:
                (server, record), held = held, None
                open_gate(server, record, self.opts.start_timeout)
            self.pbar.set_description(f"{arm.name}: starting")
            try:
                self._wait_up(arm, server, record)
                self._check(arm, server, record)
            except ABError as error:
                self._fail_or_drop(arm, error)  # dropped: this start only
                self.dropped[f"{arm.name} start {start + 1}"] = self.dropped.pop(arm.name)
                self._stop(arm, server, record)
                self.pbar.update(len(self.levels) * self.opts.repeats)
                continue
            if getattr(self.opts, "prelaunch", False) and turn + 1 < len(turns) and not self._past_deadline():
                next_start, _, next_arm = turns[turn + 1]
                held = self._launch(next_arm, next_start, gated=True)
            try:
                self._wait_for_file()  # the first server's start-up overlaps the other job
                for concurrency, prompts in self.levels:
                    for repeat in range(self.opts.repeats):
                        self._measure(arm, server, concurrency, prompts, repeat, start, order)
                    self._profile(arm, server, concurrency, start)
            finally:
                self._stop(arm, server, record)
