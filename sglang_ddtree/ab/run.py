"""What one A/B run is made of: its prompts, its servers (start, read back, greedy side-check,
stop) and its load passes, each one ``sglang.bench_serving`` run through the kept-loaded
worker (``bench_worker.py``). ``engine.py`` puts them in a schedule."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import random
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ..launch import ProcessGroup, ServerProcess, free_port
from .arms import BENCH_FIELDS, CHECK_PROMPTS, CONTEXT_KEYS, PARITY_KEYS, ABError
from .bench_worker import REPLY

# --------------------------------------------------------------------------- prompts


def bench_module() -> str:
    """SGLang's load generator: ``sglang.benchmark.serving`` (``sglang.bench_serving`` on older releases)."""
    try:
        if importlib.util.find_spec("sglang.benchmark.serving") is not None:
            return "sglang.benchmark.serving"
    except ModuleNotFoundError:
        pass
    return "sglang.bench_serving"


def _prompt_of(row, where: str):
    """A prompt: text, or token ids (a list of integers, or an object's ``input_ids``)."""
    if isinstance(row, str):
        return row
    if isinstance(row, list) and row and all(isinstance(t, int) for t in row):
        return row
    if isinstance(row, dict):
        ids = row.get("input_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return ids
        convs = row.get("conversations", row.get("conversation"))
        if convs:
            first = convs[0]
            return first.get("content", first.get("value", "")) if isinstance(first, dict) else str(first)
        for key in ("prompt", "text", "question", "instruction", "input"):
            if isinstance(row.get(key), str):
                return row[key]
    raise ABError(f"{where}: no prompt (expected input_ids, conversations, prompt or text).")


def read_prompts(path: str) -> list:
    """Prompts from a JSONL file (one per line) or a JSON array; each a string, a list of token
    ids, a conversation (``{"conversations": [...]}``) or an object with ``input_ids`` (token
    ids, taken before any text) or ``prompt``/``text``/``question``/``instruction``/``input``."""
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        return [_prompt_of(row, f"{path}[{i}]") for i, row in enumerate(whole)]
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ABError(f"{path}:{lineno}: not JSON ({error}).") from error
        prompts.append(_prompt_of(row, f"{path}:{lineno}"))
    return prompts


def output_lens(n: int, output_len: int, range_ratio: float, seed: int) -> list[int]:
    """``n`` output lengths drawn from ``[ratio * len, len]`` as bench_serving's random dataset
    draws them (``--random-range-ratio``); all ``output_len`` at ratio 1."""
    rng = random.Random(seed)
    low = max(int(output_len * range_ratio), 1)
    return [output_len if low >= output_len else rng.randint(low, output_len) for _ in range(n)]


def prepare_prompt_rows(
    path: str | None, num_prompts: int, out: Path, seed: int, output_len: int, range_ratio: float
) -> tuple[Path, dict, list]:
    """Write ``num_prompts`` rows (prompt, output length) for the load worker's local dataset.

    With no file, the fixed prompts of the greedy check are used. Prompts are cycled when there
    are fewer than ``num_prompts``, then shuffled with ``seed``; each row's output length is
    drawn with ``range_ratio``. Every arm and pass serves these rows, in this order (a level of
    N prompts the first N). Returns the file, a description, and the unique prompts."""
    prompts = read_prompts(path) if path else list(CHECK_PROMPTS)
    prompts = [p for p in prompts if (p.strip() if isinstance(p, str) else p)]
    if not prompts:
        raise ABError(f"no prompts in {path or 'the built-in list'}.")
    unique = len(prompts)
    rows = [prompts[i % unique] for i in range(max(num_prompts, unique))]
    random.Random(seed).shuffle(rows)
    lens = output_lens(len(rows), output_len, range_ratio, seed)
    with open(out, "w") as f:
        for prompt, n in zip(rows, lens):
            f.write(json.dumps({"prompt": prompt, "output_len": n}) + "\n")
    kinds = {"token ids" if isinstance(p, list) else "text" for p in prompts}
    info = {
        "unique_prompts": unique,
        "rows": len(rows),
        "prompt_kind": " and ".join(sorted(kinds)),
        "source": path or "built-in prompts",
        "output_lens": [min(lens), max(lens)],
    }
    return out, info, prompts


# --------------------------------------------------------------------------- load passes


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    text = [t if len(t) < 400 else t[:400] + " ..." for t in text]
    return f"--- last lines of {path} ---\n" + "\n".join(text[-lines:])


class LoadWorker:
    """``bench_worker.py`` in its own process group: one ``bench_serving`` pass at a time."""

    def __init__(self, log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.module = bench_module()
        # The stock tool's module name is on the command line: it is the load generator.
        cmd = [sys.executable, "-m", "sglang_ddtree.ab.bench_worker", "--bench-module", self.module]
        self._log = open(log_path, "w")
        self.group = ProcessGroup(
            cmd,
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self._replies: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="ab-load-worker", daemon=True)
        self._reader.start()
        self.ready = False

    @property
    def pid(self) -> int:
        return self.group.pid

    def _read(self) -> None:
        for raw in self.group.process.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(REPLY):
                try:
                    self._replies.put(json.loads(line[len(REPLY) :]))
                except json.JSONDecodeError:
                    self._replies.put({"ok": False, "error": f"unreadable reply {line!r}"})
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put({"ok": False, "error": "the load generator exited", "exited": True})

    def _reply(self, timeout: float, what: str) -> dict:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise ABError(f"{what}: no answer from the load generator in {timeout:.0f} s.") from None

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        reply = self._reply(timeout, "starting bench_serving")
        if not reply.get("ok"):
            raise ABError(f"the load generator did not start: {reply.get('error')}\n{_tail(self.log_path)}")
        self.ready = True

    def run(self, argv: list[str], log: Path, rows: Path | None, timeout: float) -> None:
        """One pass; raises :class:`ABError` if it failed (the pass log's tail attached)."""
        job = {"argv": argv, "log": str(log), "rows": None if rows is None else str(rows)}
        try:
            self.group.process.stdin.write((json.dumps(job) + "\n").encode())
            self.group.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ABError(f"the load generator is gone.\n{_tail(self.log_path)}") from None
        reply = self._reply(timeout, f"a bench_serving pass ran past {timeout:.0f} s")
        if not reply.get("ok"):
            raise ABError(f"bench_serving failed: {reply.get('error')}.\n{_tail(log)}")

    def stop(self) -> bool:
        try:
            if self.group.process.stdin:
                self.group.process.stdin.close()
        except OSError:
            pass
        gone = self.group.stop(graceful_timeout=5)
        self._reader.join(timeout=5)
        self._log.close()
        return gone


def bench_argv(url: str, opts, *, concurrency: int, num_prompts: int, out_file: Path) -> list[str]:
    """The command line of one ``bench_serving`` pass (what ``python -m sglang.bench_serving``
    would be given)."""
    warmup = concurrency if opts.warmup_requests == "auto" else int(opts.warmup_requests)
    argv = [
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(opts.seed),
        "--flush-cache",  # after its warm-up: a cold prefix cache and a fresh accept-length average
        "--warmup-requests",
        str(warmup),
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "30",
        "--output-file",
        str(out_file),
    ]
    if opts.dataset in ("random", "random-ids"):
        argv += [
            "--dataset-name",
            opts.dataset,
            "--random-input-len",
            str(opts.input_len),
            "--random-output-len",
            str(opts.output_len),
            "--random-range-ratio",
            str(opts.range_ratio),
        ]
        if opts.dataset_path:
            argv += ["--dataset-path", opts.dataset_path]
    else:  # the prepared rows (bench_worker serves them in place of the stock custom dataset)
        argv += ["--dataset-name", "custom", "--dataset-path", str(opts.dataset_file)]
        if opts.apply_chat_template:
            argv.append("--apply-chat-template")
    if opts.tokenizer:
        argv += ["--tokenizer", opts.tokenizer]
    return argv + shlex.split(opts.bench_args or "")


def run_pass(worker: LoadWorker, url: str, opts, *, concurrency: int, num_prompts: int, stem: str) -> dict:
    """One timed pass against the server at ``url``; its result record (bench_serving's fields)."""
    out_file, log_file = opts.raw / f"bench_{stem}.jsonl", opts.raw / f"bench_{stem}.log"
    out_file.unlink(missing_ok=True)
    argv = bench_argv(url, opts, concurrency=concurrency, num_prompts=num_prompts, out_file=out_file)
    rows = opts.dataset_file if opts.dataset == "custom" else None
    t0 = time.perf_counter()
    worker.run(argv, log_file, rows, opts.bench_timeout)
    wall = time.perf_counter() - t0
    try:
        record = json.loads(out_file.read_text().strip().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError):
        raise ABError(f"bench_serving wrote no result (no request succeeded?).\n{_tail(log_file)}") from None
    result = {k: record.get(k) for k in BENCH_FIELDS}
    result["dataset_name"] = record.get("dataset_name")
    if (result["completed"] or 0) < num_prompts:
        raise ABError(
            f"bench_serving completed {result['completed']} of {num_prompts} requests.\n{_tail(log_file)}"
        )
    result["wall_seconds"] = round(wall, 2)  # the pass with its warm-up and cache flush
    return result


# --------------------------------------------------------------------------- servers


def _dig(obj, dotted: str):
    for part in dotted.split("."):
        if isinstance(obj, list):
            try:
                obj = obj[int(part)]
            except (ValueError, IndexError):
                return None
        elif isinstance(obj, dict):
            obj = obj.get(part)
        else:
            return None
    return obj


def readback(info: dict) -> dict:
    """The settings each server resolved: the scheduler's view (``internal_states[0]``) where it has
    the key, else the launcher's."""
    states = info.get("internal_states") or [{}]
    merged = {**info, **(states[0] if isinstance(states[0], dict) else {})}
    return {k: _dig(merged, k) for k in dict.fromkeys((*PARITY_KEYS, *CONTEXT_KEYS))}


def greedy_outputs(server: ServerProcess, prompts: list, max_new_tokens: int, top2: bool = False):
    """The server's greedy output ids per prompt and, with ``top2``, per output token the two
    best ``[log-prob, token]`` of the decode step that chose it (else None)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    extra = {"return_logprob": True, "top_logprobs_num": 2} if top2 else {}
    outputs, tops = [], []
    for p in prompts:
        key = "text" if isinstance(p, str) else "input_ids"
        answer = server.generate({key: p, "sampling_params": params, **extra})
        outputs.append(answer["output_ids"])
        if top2:
            rows = answer["meta_info"]["output_top_logprobs"]
            tops.append([[[row[0][0], row[0][1]], [row[1][0], row[1][1]]] for row in rows])
    return outputs, (tops if top2 else None)


def new_server(arm, opts, start: int, gated: bool = False) -> tuple[ServerProcess, dict]:
    """The ``start``-th server of ``arm`` (not launched yet) and its record in ``arm.servers``;
    ``gated``: held by SGLang's gate before it takes GPU memory, until :func:`open_gate`."""
    suffix = f"_s{start}" if opts.schedule == "alternating" else ""
    log = opts.raw / f"server_{safe_name(arm.name)}{suffix}.log"
    gate = ["--gated-launch-port", str(free_port())] if gated else []
    server = ServerProcess(
        [*arm.server_args, *gate],
        env=arm.env,
        log_path=log,
        start_timeout=opts.start_timeout,
        name=f"{arm.name} server",
    )
    record = {
        "start": start,
        "port": server.port,
        "pid": None,
        "log": str(log),
        "start_seconds": None,
        "check_seconds": None,
        "stop_seconds": None,
        "stopped": None,
        "error": None,
        "readback": {},
        "greedy": None,
    }
    if gated:
        record["gate_port"] = int(gate[1])
    arm.servers.append(record)
    return server, record


def open_gate(server: ServerProcess, record: dict, timeout: float) -> None:
    """Let a gated server go on with its start-up (``POST /gate/activate`` to its gate, which
    listens once the server has reached it: retried until then, or until its process ends, which
    :func:`wait_up` then reports). Its start-up time counts from here; the time it was held
    before is ``held_seconds``."""
    url = f"http://127.0.0.1:{record['gate_port']}/gate/activate"
    deadline = time.monotonic() + timeout
    while server.process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5):
                break
        except OSError:  # not at the gate yet (connection refused), or a slow answer
            time.sleep(0.5)
    now = time.perf_counter()
    record["held_seconds"] = round(now - record["launched_at"], 1)
    record["launched_at"] = now


def launch(server: ServerProcess, record: dict) -> None:
    record["launched_at"] = time.perf_counter()
    try:
        server.launch()
    finally:
        if server.process is not None:
            record["pid"] = server.process.pid


def wait_up(server: ServerProcess, record: dict) -> None:
    """Wait for a launched server to answer; its start-up time from launch to ready."""
    server.wait_until_ready()
    record["start_seconds"] = round(time.perf_counter() - record.pop("launched_at"), 1)


def check_server(server: ServerProcess, record: dict, opts, reference: bool = False) -> None:
    """Read a ready server's settings back and run the greedy side-check (a ``reference``
    server, plain's, also keeps its two best log-probs per token: a divergence's margin)."""
    record["readback"] = readback(server.server_info())
    if opts.check_prompts > 0:
        t0 = time.perf_counter()
        top2 = reference and opts.greedy_margin > 0
        record["greedy"], record["greedy_top2"] = greedy_outputs(
            server, opts.check_texts, opts.check_tokens, top2
        )
        record["check_seconds"] = round(time.perf_counter() - t0, 1)


def stop(server: ServerProcess, record: dict) -> None:
    record.pop("launched_at", None)
    t0 = time.perf_counter()
    record["stopped"] = server.stop()
    record["stop_seconds"] = round(time.perf_counter() - t0, 1)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ABError(f"{what}: expected comma-separated integers, got {text!r}.") from None
    if not values or any(v < 1 for v in values):
        raise ABError(f"{what}: expected positive integers, got {text!r}.")
    return values


def make_levels(concurrency: list[int], num_prompts: str) -> list[tuple[int, int]]:
    """``[(concurrency, prompts)]``: ``num_prompts`` is one value, one per level, or ``auto``
    (four times the concurrency, at least 16)."""
    if str(num_prompts).strip() == "auto":
        return [(c, max(4 * c, 16)) for c in concurrency]
    counts = int_list(num_prompts, "--num-prompts")
    if len(counts) == 1:
        counts = counts * len(concurrency)
    if len(counts) != len(concurrency):
        raise ABError(
            f"--num-prompts gives {len(counts)} values for {len(concurrency)} concurrency levels; "
            "give one value, or one per level."
        )
    return list(zip(concurrency, counts))
