"""Start and stop real SGLang servers (demo, A/B runs, tests).

A server runs in its own process group on a free local port, with its log in a
file. :class:`ServerProcess` waits for it to answer a generation, and always
stops every process it started - on success, failure or Ctrl-C - and reports
the tail of the log when the server dies during start-up.

Every group started here (:class:`ProcessGroup`: servers, load generators) also
dies with the process that started it, even when that process is SIGKILLed and
runs no clean-up: the group's leader gets ``PR_SET_PDEATHSIG``, and a small
watchdog process kills the whole group (the leader's own children included)
once its starter is gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

WATCHDOG_NAME = "sglang-ddtree-watchdog"
# Runs as ``python -c WATCHDOG_SCRIPT sglang-ddtree-watchdog <starter pid> <group>``:
# waits (on a pidfd, no polling) for the starter to exit, then SIGKILLs the group.
# It leaves on its own once the group is gone, so it never signals a reused id.
WATCHDOG_SCRIPT = """
import os, select, signal, sys, time
starter, group = int(sys.argv[2]), int(sys.argv[3])
def group_alive():
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
try:
    starter_fd = os.pidfd_open(starter)
except (AttributeError, OSError):
    starter_fd = None
while group_alive():
    if os.getppid() != starter:
        break
    if starter_fd is None:
        time.sleep(1.0)
    elif select.select([starter_fd], [], [], 5.0)[0]:
        break
else:
    sys.exit(0)
try:
    os.killpg(group, signal.SIGKILL)
except OSError:
    pass
"""

PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A ``preexec_fn`` that has the child SIGKILLed when its parent dies (Linux).

    The kernel sends it when the *thread* that forked exits, so it is only used
    when starting from the main thread; the watchdog covers the other cases."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    starter = os.getpid()

    def set_parent_death_signal():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != starter:  # the starter died before the prctl took effect
            os._exit(1)

    return set_parent_death_signal


def live_group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (zombies waiting to be reaped do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return [pgid] if group_alive(pgid) else []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while live_group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class ProcessGroup:
    """A command in its own session (process group), guarded by a watchdog."""

    def __init__(self, cmd: list[str], *, stdout, env: dict[str, str] | None = None, cwd=None, stdin=None):
        self.process = subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        self.pgid = self.process.pid
        self.watchdog = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                WATCHDOG_SCRIPT,
                WATCHDOG_NAME,
                str(os.getpid()),
                str(self.pgid),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal must not take the guard first
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self, graceful_timeout: float = 30.0, kill_timeout: float = 120.0) -> bool:
        """SIGTERM to the leader (a clean shutdown of its children), then SIGKILL
        to the whole group for anything left. Returns whether the group is gone."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=graceful_timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pgid, signal.SIGKILL)
        try:
            self.process.wait(timeout=kill_timeout)
        except subprocess.TimeoutExpired:
            pass
        gone = wait_group_gone(self.pgid, kill_timeout)
        self._stop_watchdog()
        return gone

    def _stop_watchdog(self) -> None:
        if self.watchdog.poll() is None:
            self.watchdog.kill()
        self.watchdog.wait()


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message ends with its log tail."""


_PORTS_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_SGLANG_OWN_PORTS_LOW = 22000  # SGLang picks an unset --nccl-port at random from 22000-29999


def free_port() -> int:
    """A free port below the kernel's ephemeral range and below the range SGLang picks its
    own ports from, never handed out twice by this process.

    A server binds its HTTP port only once its model is loaded; a port picked by
    ``bind(0)`` is ephemeral, and other servers starting meanwhile (their NCCL, ZMQ and
    torch.distributed sockets) can take it first ("address already in use" a minute later).
    """
    high = min(_ephemeral_low(), _SGLANG_OWN_PORTS_LOW)
    rng = random.SystemRandom()
    for _ in range(2000):
        port = rng.randrange(max(1024, high - 12000), high)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def has_flag(args: list[str], flag: str) -> bool:
    """Whether server arguments name ``flag`` (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def cpu_server_args(target: str, extra: list[str] | None = None, max_total_tokens: int = 8192) -> list[str]:
    """Arguments for a CPU-mode server on a local model folder. ``--sleep-on-idle``:
    an idle scheduler otherwise polls its sockets in a busy loop (a whole core)."""
    return [
        "--model-path",
        str(target),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        str(max_total_tokens),
        "--sleep-on-idle",
        *(extra or []),
    ]


def http_text(url: str, payload: dict | None = None, timeout: float = 300.0) -> str:
    """The body of a GET (no payload) or a JSON POST, as text (e.g. ``/start_profile``'s
    plain-text answer)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
    body = http_text(url, payload, timeout)
    return json.loads(body) if body.strip() else {}


class ServerProcess:
    """``with ServerProcess(args, env=...) as server: server.generate(...)``"""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        start_timeout: float = 240.0,
        name: str = "server",
        python: str = sys.executable,
        cwd: str | Path | None = None,
    ):
        self.python, self.cwd = python, cwd  # the interpreter (its environment), the working folder
        self.port = free_port()
        # SGLang checks an unset --nccl-port free when it picks it and binds it later; another
        # server starting meanwhile can take it (EADDRINUSE at start-up). Ours are handed out once.
        nccl = [] if has_flag(args, "--nccl-port") else ["--nccl-port", str(free_port())]
        self.args = [*args, *nccl, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        )
        self.start_timeout = start_timeout
        self.name = name
        self.group: ProcessGroup | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        if self.group is None:  # not launched ahead
            self.launch()
        return self.wait_until_ready()

    def launch(self) -> ServerProcess:
        """Start the server's processes without waiting for it (its start-up can
        overlap other work); :meth:`wait_until_ready` then waits."""
        with open(self.log_path, "w") as log:
            self.group = ProcessGroup(
                [self.python, "-m", "sglang.launch_server", *self.args],
                stdout=log,
                env=self.env,
                cwd=self.cwd,
            )
        self.process = self.group.process
        return self

    def wait_until_ready(self) -> ServerProcess:
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.process.returncode} during start-up.\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        raise ServerStartError(
            f"{self.name} was not ready after {self.start_timeout:.0f} s.\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        text = [line if len(line) < 400 else line[:400] + " ..." for line in text]
        return "--- last lines of " + str(self.log_path) + " ---\n" + "\n".join(text[-lines:])

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop the server: SIGTERM to the launcher (which stops its scheduler and
        detokenizer cleanly), then SIGKILL to the whole process group for anything
        left. Signalling the group first would look like a crashed scheduler to the
        launcher, which then waits for crash diagnostics. Returns whether every
        process of the group is gone."""
        if self.group is None:
            return True
        return self.group.stop(graceful_timeout=timeout)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- requests --------------------------------------------------------------------

    def generate(self, payload: dict, timeout: float = 600.0):
        return http_json(f"{self.url}/generate", payload, timeout=timeout)

    def server_info(self) -> dict:
        return http_json(f"{self.url}/server_info", timeout=60)

    def accept_length(self) -> float | None:
        states = self.server_info().get("internal_states") or [{}]
        value = states[0].get("avg_spec_accept_length")
        return None if value is None else float(value)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pid: int) -> bool:
    """Whether any process of the group ``pid`` still runs."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False
