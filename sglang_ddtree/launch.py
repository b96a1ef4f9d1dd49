"""Start and stop real SGLang servers (demo, A/B runs, tests).

A server runs in its own process group on a free local port, with its log in a
file. :class:`ServerProcess` waits for it to answer a generation, and always
stops every process it started - on success, failure or Ctrl-C - and reports
the tail of the log when the server dies during start-up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_server_args(target: str, extra: list[str] | None = None, max_total_tokens: int = 8192) -> list[str]:
    """Arguments for a CPU-mode server on a local model folder."""
    return [
        "--model-path",
        str(target),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        str(max_total_tokens),
        *(extra or []),
    ]


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
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
    ):
        self.port = free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        )
        self.start_timeout = start_timeout
        self.name = name
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()
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

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server: SIGTERM to the launcher (which stops its scheduler and
        detokenizer cleanly), then SIGKILL to the whole process group for anything
        left. Signalling the group first would look like a crashed scheduler to the
        launcher, which then waits for crash diagnostics."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

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
