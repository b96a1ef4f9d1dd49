"""Helpers for tests that run real SGLang servers on the tiny models."""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import os
import re
import tempfile
import urllib.error
from pathlib import Path

from sglang_ddtree.launch import ServerProcess, cpu_server_args, http_text

PROMPTS = [
    "The",
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "for i in range(10):\n    print(i, i * i)\n",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model in one forward pass.",
    "A draft tree holds many candidate continuations; the target checks all of them at once. " * 2,
    "Letters: a b c d e f g h i j k l m n o p. " * 4,
]
MAX_NEW_TOKENS = 32
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
# float32: greedy comparisons must not hinge on bf16 rounding differences between
# a batched verify and a one-token decode (patches/0001-input-embeds-dtype.md).
COMMON = ["--dtype", "float32", "--decode-log-interval", "1", "--log-level", "warning"]
# The non-speculative reference every module compares with, one process for the whole run:
# the sync scheduler (with overlap on, SGLang 0.5.23's plain server counts penalties one
# token late: docs/features.md), per-request sampling seeds honoured, custom logit
# processors allowed, and a context limit that the context-limit tests reach
# (test_serving_greedy.py: it decides how many tokens a near-limit request gets; every
# other request fits well below it). Greedy output does not depend on these options.
REFERENCE_CONTEXT = 512
REFERENCE_OPTIONS = [
    "--disable-overlap-schedule",
    "--enable-deterministic-inference",
    "--enable-custom-logit-processor",
    "--context-length",
    str(REFERENCE_CONTEXT),
]
# A server start (imports, model load, warm-up) can take minutes on a loaded 2-core machine.
START_TIMEOUT_S = 900.0


def ddtree_args(models, budget: int = 16, extra: list[str] | None = None) -> list[str]:
    return cpu_server_args(
        models.target,
        [
            *COMMON,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(models.drafter),
            "--speculative-ddtree-budget",
            str(budget),
            *(extra or []),
        ],
    )


def plain_args(models, extra: list[str] | None = None) -> list[str]:
    return cpu_server_args(models.target, [*COMMON, *(extra or [])])


def generate_sequential(server: ServerProcess, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [server.generate({"text": p, "sampling_params": params})["output_ids"] for p in prompts]


def generate_batch(server: ServerProcess, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    """All prompts in flight at once (the scheduler batches them)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(server.generate, {"text": p, "sampling_params": params}) for p in prompts]
        return [f.result()["output_ids"] for f in futures]


def run_server(args, env=None, name="server", tmp: Path | None = None) -> ServerProcess:
    log = None if tmp is None else tmp / f"{name}.log"
    return ServerProcess(args, env=env, name=name, log_path=log, start_timeout=START_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """A server a test will start: launch arguments, environment and log file."""

    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    name: str = "server"
    log_path: Path | None = None

    @property
    def key(self) -> tuple:
        return (self.args, self.env)

    def create(self) -> ServerProcess:
        return ServerProcess(
            list(self.args),
            env=dict(self.env),
            name=self.name,
            log_path=self.log_path,
            start_timeout=START_TIMEOUT_S,
        )


def server_spec(args, env=None, name="server", tmp: Path | None = None) -> ServerSpec:
    log = None if tmp is None else tmp / f"{name}.log"
    return ServerSpec(tuple(args), tuple(sorted((env or {}).items())), name, log)


class RunSchedule:
    """The tests still to run in this session (conftest.py keeps it current), so that a
    server is launched ahead only for a test that will run."""

    remaining: list[str] = []

    @classmethod
    def will_run(cls, fragment: str) -> bool:
        return any(fragment in nodeid for nodeid in cls.remaining)


def next_to_run(
    specs: dict[str, ServerSpec], after: str | None, test_of: dict[str, str | tuple[str, ...]]
) -> ServerSpec | None:
    """The first of ``specs`` after ``after`` (None: from the first) whose test
    (``test_of[name]``, a part of its node id, or a tuple of them: its tests) will still
    run: the server to launch ahead."""
    names = list(specs)
    for name in names[0 if after is None else names.index(after) + 1 :]:
        tests = test_of[name]
        if any(RunSchedule.will_run(t) for t in ((tests,) if isinstance(tests, str) else tests)):
            return specs[name]
    return None


class ServerRegistry:
    """Servers shared by the test modules of one run, keyed by launch arguments and
    environment: two modules asking for the same server get one process. A server
    start costs about a minute of imports and warm-up, mostly on one core; a shared
    one is paid once, and a test's next server starts on the other core while the
    current one serves (:meth:`take` with ``ahead``).

    At most ``max_alive`` servers wait here at once (the least recently used one
    stops to make room), besides the one a test holds. Every server stops at the end
    of the run, on Ctrl-C and on SIGTERM (conftest.py); each also dies with the test
    process (launch.ProcessGroup)."""

    def __init__(self, max_alive: int = 2):
        self.max_alive = max_alive
        self._servers: dict[tuple, ServerProcess] = {}  # least recently used first
        self._log_dir: Path | None = None

    def get(self, args: list[str], env: dict[str, str] | None = None, name: str = "shared") -> ServerProcess:
        key = (tuple(args), tuple(sorted((env or {}).items())))
        server = self._servers.pop(key, None)
        if server is not None and server.process.poll() is not None:
            server.stop()  # it died: the module that asks now gets a fresh one
            server = None
        if server is None:
            self._make_room()
            server = ServerProcess(
                args, env=env, name=name, log_path=self._log_path(name), start_timeout=START_TIMEOUT_S
            )
            self._servers[key] = server
            server.start()
        else:
            self._servers[key] = server
            flush_cache(server)  # each module starts from an empty prefix cache, as on its own server
        return server

    def take(self, spec: ServerSpec, ahead: ServerSpec | None = None) -> ServerProcess:
        """The server of ``spec`` for the caller to own (``with``: it waits until ready,
        stops at the end), launched ahead if it was; then ``ahead`` is launched."""
        server = self._servers.pop(spec.key, None) or spec.create()
        if ahead is not None:
            self.launch_ahead(ahead)
        return server

    def launch_ahead(self, spec: ServerSpec) -> None:
        """Start ``spec``'s server without waiting, when there is room for it."""
        if spec.key not in self._servers and len(self._servers) < self.max_alive:
            self._servers[spec.key] = spec.create().launch()

    def stop_all(self) -> None:
        while self._servers:
            self._servers.pop(next(iter(self._servers))).stop()

    def _make_room(self) -> None:
        while len(self._servers) >= self.max_alive:
            self._servers.pop(next(iter(self._servers))).stop()

    def _log_path(self, name: str) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="sglang-ddtree-shared-servers-"))
        return self._log_dir / f"{name}-{len(list(self._log_dir.iterdir()))}.log"


SHARED_SERVERS = ServerRegistry()


def reference_server(servers: ServerRegistry, models) -> ServerProcess:
    """The shared non-speculative float32 server on ``models`` (REFERENCE_OPTIONS)."""
    return servers.get(plain_args(models, REFERENCE_OPTIONS), name="reference")


def flush_cache(server: ServerProcess) -> None:
    try:
        http_text(f"{server.url}/flush_cache", {}, timeout=120)
    except urllib.error.HTTPError:
        pass  # refused while requests run: none do between modules


def oracle_reference(server: ServerProcess, models, tmp: Path) -> dict:
    """The plain server's greedy answers to ``token_requests`` on ``models``, and the
    scripted drafter's file built from them (tests/oracle_plugin.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.target)
    requests = token_requests(tokenizer)
    greedy = output_ids(run_all(server, requests))
    return {
        "tokenizer": tokenizer,
        "requests": requests,
        "greedy": greedy,
        "oracle": write_oracle(tmp / "oracle.json", requests, greedy),
        "tmp": tmp,
    }


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


ORACLE_RANKS = [0, 1, 0, 0, 1, 0, 0]  # rank of the right token at depths 1..7


def token_requests(tokenizer, params=GREEDY, prompts=PROMPTS) -> list[dict]:
    """Requests by token ids, so that an oracle can key on them exactly."""
    return [{"input_ids": tokenizer(p)["input_ids"], "sampling_params": params} for p in prompts]


def run_all(server: ServerProcess, requests) -> list[dict]:
    return [server.generate(r) for r in requests]


def output_ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def write_oracle(path: Path, requests, outputs, ranks=ORACLE_RANKS) -> Path:
    """The controlled drafter's script: each request's true continuation."""
    continuations = [r["input_ids"] + out for r, out in zip(requests, outputs)]
    return write_json(path, {"continuations": continuations, "ranks": ranks})


def oracle_env(oracle_path: Path, max_topk: int | None = None) -> dict:
    """The scripted drafter (``tests/oracle_plugin.py``) in every server process."""
    tests_dir = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PYTHONPATH": path,
        "SGLANG_DDTREE_TEST_PLUGIN": "oracle_plugin",
        "SGLANG_DDTREE_ORACLE_DRAFT": str(oracle_path),
        "SGLANG_DDTREE_LOG_STATS_EVERY": "1",
    }
    if max_topk is not None:
        env["SGLANG_DDTREE_MAX_TOPK"] = str(max_topk)
    return env


def last_tree_stats(log_path: Path) -> dict:
    """The last ``DDTREE stats: {...}`` line the worker logged."""
    lines = [line for line in log_path.read_text().splitlines() if "DDTREE stats:" in line]
    assert lines, f"no DDTREE stats line in {log_path}"
    return ast.literal_eval(re.sub(r"^.*DDTREE stats: ", "", lines[-1]))
