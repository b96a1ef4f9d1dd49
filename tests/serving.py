"""Helpers for tests that run real SGLang servers on the tiny models."""

from __future__ import annotations

import ast
import bisect
import concurrent.futures
import dataclasses
import json
import os
import re
import tempfile
import urllib.error
from collections.abc import Callable
from pathlib import Path

from lab.models.tiny import build_tiny_models
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


def ddtree_args(models, budget: int | None = 16, extra: list[str] | None = None) -> list[str]:
    """A DDTREE server's arguments; ``budget=None`` leaves the budget flag out (the
    minimal launch: the default budget)."""
    width = [] if budget is None else ["--speculative-ddtree-budget", str(budget)]
    return cpu_server_args(
        models.target,
        [
            *COMMON,
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(models.drafter),
            *width,
            *(extra or []),
        ],
    )


def plain_args(models, extra: list[str] | None = None) -> list[str]:
    return cpu_server_args(models.target, [*COMMON, *(extra or [])])


def generate_sequential(server: ServerProcess, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [server.generate({"text": p, "sampling_params": params})["output_ids"] for p in prompts]


def one_batch(requests: list[dict]) -> dict:
    """One ``/generate`` call carrying every request: the scheduler receives them together and
    runs them as one batch (requests sent from threads may reach a loaded machine one by one)."""
    return {
        "input_ids": [r["input_ids"] for r in requests],
        "sampling_params": [r["sampling_params"] for r in requests],
    }


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
    """The tests of this session in run order, and which one runs now (conftest.py keeps
    it current), so that a server is launched ahead only for a test that will run, and
    in the order the tests need them."""

    order: list[str] = []
    current: int = 0
    _index: dict[str, int] = {}

    @classmethod
    def set_order(cls, nodeids: list[str]) -> None:
        cls.order, cls.current = list(nodeids), 0
        cls._index = {nodeid: i for i, nodeid in enumerate(cls.order)}

    @classmethod
    def now_running(cls, nodeid: str) -> None:
        cls.current = cls._index.get(nodeid, cls.current)

    @classmethod
    def positions(cls, fragments: tuple[str, ...]) -> list[int]:
        """Where the tests whose node ids hold one of ``fragments`` are in the run order."""
        return [i for i, nodeid in enumerate(cls.order) if any(f in nodeid for f in fragments)]

    @classmethod
    def first_index(cls, fragments: tuple[str, ...]) -> int | None:
        """How far ahead the first test still to run (the one running now included) whose
        node id holds one of ``fragments`` is (0: it runs now), or None when none will."""
        return cls.next_of(cls.positions(fragments))

    @classmethod
    def next_of(cls, positions: list[int]) -> int | None:
        """The same for positions already found (:meth:`positions`, sorted)."""
        at = bisect.bisect_left(positions, cls.current)
        return positions[at] - cls.current if at < len(positions) else None


@dataclasses.dataclass
class _Plan:
    specs: Callable[[], dict[str, ServerSpec]]
    tests: dict[str, tuple[str, ...]]


class ServerRegistry:
    """The servers of one run. A server start costs about a minute of imports and
    warm-up, mostly on one core, so:

    * a shared server (:meth:`get`: the plain reference, one DDTREE server two modules
      use) serves every module that asks for its launch arguments and environment, and
      stops once the tests planned on it have run (:meth:`release_finished`);
    * every module declares at import the servers it will take and the tests that take
      each (:meth:`plan`); while a test uses its server, the next server any remaining
      test needs is launched (:meth:`launch_next`: at most ``max_ahead`` at once, in the
      order the tests will ask for them, across modules), so that its start-up runs on
      the other core and the test that takes it (:meth:`take`) mostly finds it ready.

    Every server stops at the end of the run, on Ctrl-C and on SIGTERM (conftest.py);
    each also dies with the test process (launch.ProcessGroup)."""

    def __init__(self, max_ahead: int = 1):
        self.max_ahead = max_ahead
        self._shared: dict[tuple, ServerProcess] = {}
        self._ahead: dict[tuple, ServerProcess] = {}
        self._plans: list[_Plan] = []
        self._planned: dict[tuple, tuple[ServerSpec, list[int]]] | None = None
        self._taken: set[tuple] = set()
        self._root: Path | None = None

    def folder(self, name: str) -> Path:
        """A folder of this run for a module's server logs and drafter scripts."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="sglang-ddtree-servers-"))
        path = self._root / name
        path.mkdir(exist_ok=True)
        return path

    def plan(self, specs: Callable[[], dict[str, ServerSpec]], tests: dict) -> None:
        """Declare servers a module will use: ``specs()`` builds them (called when first
        needed; it must give the same launch arguments and environment as the module's
        tests use) and ``tests[name]`` are parts of the node ids of the tests that use
        server ``name`` (one string or a tuple). A shared server (:meth:`get`) stops
        once its planned tests have run."""
        as_tuples = {name: (t,) if isinstance(t, str) else tuple(t) for name, t in tests.items()}
        self._plans.append(_Plan(specs, as_tuples))
        self._planned = None

    def get(self, spec: ServerSpec) -> ServerProcess:
        """The shared server of ``spec``, started (or taken from the ones launched ahead)
        on first use; each caller finds its prefix cache empty."""
        server = self._shared.get(spec.key)
        if server is not None and server.process.poll() is not None:
            server.stop()  # it died: the module that asks now gets a fresh one
            server = None
        if server is None:
            server = self._ahead.pop(spec.key, None) or spec.create()
            self._shared[spec.key] = server
            if server.group is None:
                server.launch()
            self.launch_next()
            server.wait_until_ready()
        else:
            flush_cache(server)  # each module starts from an empty prefix cache, as on its own server
        return server

    def take(self, spec: ServerSpec) -> ServerProcess:
        """The server of ``spec`` for the caller to own (``with``: it waits until ready,
        stops at the end), launched ahead if it was; then the next server is launched."""
        server = self._ahead.pop(spec.key, None) or spec.create()
        self._taken.add(spec.key)
        if server.group is None:
            server.launch()
        self.launch_next()
        return server

    def launch_next(self) -> None:
        """Launch the servers the remaining tests will ask for first, up to ``max_ahead``
        waiting at once, without waiting for them."""
        while len(self._ahead) < self.max_ahead:
            spec = self._next_planned()
            if spec is None:
                return
            self._ahead[spec.key] = spec.create().launch()

    def release_finished(self) -> None:
        """Stop the shared servers whose planned tests have all run."""
        planned = self._planned_servers()
        for key in list(self._shared):
            if key in planned and RunSchedule.next_of(planned[key][1]) is None:
                self._shared.pop(key).stop()

    def stop_all(self) -> None:
        for servers in (self._ahead, self._shared):
            while servers:
                servers.pop(next(iter(servers))).stop()

    def _planned_servers(self) -> dict[tuple, tuple[ServerSpec, list[int]]]:
        """Every planned server, with the run-order positions of the tests that use it."""
        if self._planned is None:
            tests: dict[tuple, tuple[ServerSpec, tuple[str, ...]]] = {}
            for plan in self._plans:
                for name, spec in plan.specs().items():
                    _, before = tests.get(spec.key, (spec, ()))
                    tests[spec.key] = (spec, before + plan.tests[name])
            self._planned = {key: (spec, RunSchedule.positions(t)) for key, (spec, t) in tests.items()}
        return self._planned

    def _next_planned(self) -> ServerSpec | None:
        best, best_index = None, None
        for key, (spec, positions) in self._planned_servers().items():
            if key in self._taken or key in self._ahead or key in self._shared:
                continue
            index = RunSchedule.next_of(positions)
            if index is not None and (best_index is None or index < best_index):
                best, best_index = spec, index
        return best


SHARED_SERVERS = ServerRegistry()


def reference_spec(models=None) -> ServerSpec:
    """The shared non-speculative float32 server on ``models`` (REFERENCE_OPTIONS;
    default: the tiny models)."""
    models = models or build_tiny_models()
    return server_spec(
        plain_args(models, REFERENCE_OPTIONS), name="reference", tmp=SHARED_SERVERS.folder("shared")
    )


def uses_reference(*tests: str) -> None:
    """Declare (at a module's import) tests that use the shared reference on the tiny models."""
    SHARED_SERVERS.plan(lambda: {"reference": reference_spec()}, {"reference": tests})


def reference_server(servers: ServerRegistry, models=None) -> ServerProcess:
    """The shared non-speculative float32 server on ``models`` (REFERENCE_OPTIONS)."""
    return servers.get(reference_spec(models))


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
    """Written whole, by rename: a server may read it at any moment (tests/oracle_plugin.py)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(obj))
    os.replace(partial, path)
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


_SCRIPT_PARTS: dict[Path, dict[str, dict]] = {}


def add_to_script(path: Path, part: str, continuations, overrides=None, ranks=ORACLE_RANKS) -> Path:
    """Add (or replace) ``part`` of a drafter script that several modules write to, for
    a server that serves all of them: the script holds every part's continuations, with
    each part's per-continuation overrides (by index within the part) moved along."""
    parts = _SCRIPT_PARTS.setdefault(path, {})
    parts[part] = {"continuations": continuations, "overrides": overrides or {}, "ranks": ranks}
    assert all(p["ranks"] == ranks for p in parts.values()), "the parts of one script share their ranks"
    merged, moved = [], {}
    for p in parts.values():
        moved.update({str(int(i) + len(merged)): o for i, o in p["overrides"].items()})
        merged += p["continuations"]
    return write_json(path, {"continuations": merged, "ranks": ranks, "overrides": moved})


def deterministic_tree_spec() -> ServerSpec:
    """One DDTREE server (overlap on) with deterministic inference (per-request sampling
    seeds honoured), custom logit processors allowed and metrics on, on the tiny models:
    the request features of test_serving_features.py, the seeded sampling of
    test_serving_tree.py and the stop cases of test_serving_stops.py run on it. Its
    drafter script (:func:`add_to_script`, :func:`deterministic_tree_script`) holds
    every module's requests."""
    folder = SHARED_SERVERS.folder("shared")
    args = ddtree_args(
        build_tiny_models(),
        budget=24,
        extra=[
            "--log-level",
            "info",
            "--enable-deterministic-inference",
            "--enable-custom-logit-processor",
            "--enable-metrics",
        ],
    )
    return server_spec(args, oracle_env(deterministic_tree_script()), "ddtree-deterministic", folder)


WIDTH1_BUDGET = 16  # the width-1 server's largest budget


def width1_spec() -> ServerSpec:
    """One DDTREE ``auto`` server whose injected costs make width 1 win at every batch size, so
    every step that does not draft (to predict) is a decoding step (``adapter/decode_step.py``):
    page size 16, the reference's context limit and options, the scripted drafter, the phase
    timer and SGLang's strict idle KV check on. The width-1 checks of three modules run on it:
    greedy identity and the requests that end at the context limit (test_serving_greedy.py),
    every request feature and the stop cases (test_serving_features.py), its steps and phases
    (test_serving_online_budget.py)."""
    from sglang_ddtree.budget import candidate_widths

    folder = SHARED_SERVERS.folder("width1")
    table = width1_cost_table(folder / "width1_cost_table.json", candidate_widths(WIDTH1_BUDGET))
    extra = [
        "--speculative-num-draft-tokens",
        str(WIDTH1_BUDGET + 1),
        "--page-size",
        "16",
        "--log-level",
        "info",
    ]
    args = ddtree_args(build_tiny_models(), budget="auto", extra=[*extra, *REFERENCE_OPTIONS[1:]])
    env = {
        **oracle_env(deterministic_tree_script()),
        "SGLANG_DDTREE_BUDGET_COST_TABLE": str(table),
        "SGLANG_DDTREE_PHASE_TIMES": "1",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    }
    env["SGLANG_DDTREE_TEST_PLUGIN"] += ",decode_check_plugin"  # each decoding step against the reference
    return server_spec(args, env, "ddtree-width1", folder)


DECODE_CHECK = re.compile(
    r"DDTREE decode check: (?:rows (\d+) max \|hidden - reference\| (\S+) scale (\S+)|(shape .*))"
)


def decode_checks(log_path: Path) -> list[tuple[int, float, float] | str]:
    """``tests/decode_check_plugin.py``'s lines in a server log: per decoding step (rows, the
    largest difference of its hidden states from the reference's, the reference's scale), or the
    line's text where the shapes differed."""
    checks = []
    for match in DECODE_CHECK.finditer(log_path.read_text(errors="replace")):
        rows, diff, scale, shapes = match.groups()
        checks.append(shapes if shapes else (int(rows), float(diff), float(scale)))
    return checks


COUNTERS = ("rounds", "decode_steps", "request_rounds", "reservation", "plain_steps")


def stats_between(before: dict | None, after: dict, keys=COUNTERS) -> dict:
    """The counters of a stats line (``last_tree_stats``) gained since an earlier one (None:
    since the start): the part of a shared server's totals that one module's requests made."""
    before = before or {}
    gained = {}
    for key in (key for key in keys if key in after):  # plain_steps: the online budget's only
        if isinstance(after[key], dict):
            gained[key] = stats_between(before.get(key), after[key], tuple(after[key]))
        else:
            gained[key] = after[key] - before.get(key, 0)
    return gained


def check_width1_drafts_only_to_predict(log_path: Path, stats: dict) -> None:
    """A server whose every step is width 1 (no cost probes: an injected table) drafts only
    where ``adapter/refresh.py`` asks, from its start to the stats line ``stats`` (the last):
    its first step (nothing predicted yet), a refresh once requests joined (each needs a
    prefill batch since the last prediction: at most one per prefill), and a refresh after a
    run without a draft (runs of 2, 4, 8, 16 and 32, then one in every 64). Every other step
    is a decoding step. How many requests join per prefill depends on how fast the requests
    reach the scheduler, so the share of decoding steps is not fixed; this bound is."""
    from sglang_ddtree.adapter.refresh import FIRST_REFRESH, REFRESH_EVERY

    assert set(stats["width_steps"]) == {1}, stats
    assert stats["decode_steps"] == stats["width1_steps_without_draft"], stats
    lines = log_path.read_text().splitlines()
    last_round = max(i for i, line in enumerate(lines) if "DDTREE stats:" in line)
    prefills = sum("Prefill batch" in line for line in lines[:last_round])
    assert prefills > 0, f"no prefill lines (log level below info?) in {log_path}"
    doublings = (REFRESH_EVERY // FIRST_REFRESH).bit_length() - 1  # runs of 2 .. 32
    drafted = stats["rounds"] - stats["decode_steps"]
    assert 0 < drafted <= 1 + prefills + doublings + stats["decode_steps"] // REFRESH_EVERY, (prefills, stats)
    assert stats["decode_steps"] > 0, stats


def width1_cost_table(path: Path, widths, batch_sizes=(1, 2, 4, 8, 16, 32, 64)) -> Path:
    """An injected cost table (``SGLANG_DDTREE_BUDGET_COST_TABLE``) for an ``auto`` server of
    candidate ``widths`` where width 1 wins at every batch size: every other width costs a
    million times more, so every step that does not draft to predict is a decoding step."""
    ms = [[1.0 if w == 1 else 1e6 for w in widths] for _ in batch_sizes]
    return write_json(path, {"batch_sizes": list(batch_sizes), "widths": list(widths), "ms": ms})


def deterministic_tree_script() -> Path:
    return SHARED_SERVERS.folder("shared") / "deterministic-tree-oracle.json"


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


def last_tree_stats(log_path: Path, required: bool = True) -> dict | None:
    """The last ``DDTREE stats: {...}`` line the worker logged (None if none yet and not
    ``required``)."""
    lines = [line for line in log_path.read_text().splitlines() if "DDTREE stats:" in line]
    if not lines and not required:
        return None
    assert lines, f"no DDTREE stats line in {log_path}"
    return ast.literal_eval(re.sub(r"^.*DDTREE stats: ", "", lines[-1]))
