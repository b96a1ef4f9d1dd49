"""Running one A/B arm: its server, the greedy side-check, and SGLang's load generator
(``bench_serving``) once per (concurrency, prompts, repeat)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..launch import ProcessGroup, ServerProcess, ServerStartError
from .arms import BENCH_FIELDS, CHECK_PROMPTS, CONTEXT_KEYS, PARITY_KEYS, ABError, Arm

# --------------------------------------------------------------------------- datasets


def bench_module() -> str:
    """SGLang's load generator: ``sglang.benchmark.serving`` (``sglang.bench_serving`` on older releases)."""
    try:
        if importlib.util.find_spec("sglang.benchmark.serving") is not None:
            return "sglang.benchmark.serving"
    except ModuleNotFoundError:
        pass
    return "sglang.bench_serving"


def _prompt_of(row, where: str) -> str:
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        convs = row.get("conversations", row.get("conversation"))
        if convs:
            first = convs[0]
            return first.get("content", first.get("value", "")) if isinstance(first, dict) else str(first)
        for key in ("prompt", "text", "question", "instruction", "input"):
            if isinstance(row.get(key), str):
                return row[key]
    raise ABError(f"{where}: no prompt (expected conversations, prompt or text).")


def read_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file (one per line) or a JSON array; each a string, a conversation
    (``{"conversations": [...]}``) or an object with ``prompt``/``text``/``question``/``instruction``/``input``."""
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


def prepare_custom_dataset(
    path: str | None, num_prompts: int, out: Path, seed: int
) -> tuple[Path, dict, list[str]]:
    """Write ``num_prompts`` conversations in the JSONL layout SGLang's ``custom`` dataset reads.

    With no file, the fixed prompts of the greedy check are used. Prompts are cycled when
    there are fewer than ``num_prompts``. Returns the file, a description, and the prompts.
    """
    prompts = read_prompts(path) if path else list(CHECK_PROMPTS)
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ABError(f"no prompts in {path or 'the built-in list'}.")
    unique = len(prompts)
    rows = [prompts[i % unique] for i in range(max(num_prompts, unique))]
    random.Random(seed).shuffle(rows)
    with open(out, "w") as f:
        for p in rows:
            f.write(json.dumps({"conversations": [{"value": p}, {"value": "(answer)"}]}) + "\n")
    return out, {"unique_prompts": unique, "rows": len(rows), "source": path or "built-in prompts"}, prompts


# --------------------------------------------------------------------------- running


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    text = [t if len(t) < 400 else t[:400] + " ..." for t in text]
    return f"--- last lines of {path} ---\n" + "\n".join(text[-lines:])


def run_bench(
    url: str,
    opts,
    *,
    concurrency: int,
    num_prompts: int,
    seed: int,
    out_file: Path,
    log_file: Path,
    dataset_file: Path | None,
) -> dict:
    """One ``bench_serving`` run; returns its result record (the JSONL line it wrote)."""
    cmd = [
        sys.executable,
        "-m",
        bench_module(),
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--flush-cache",  # after its warm-up: a cold prefix cache and a fresh accept-length average
        "--warmup-requests",
        str(opts.warmup_requests),
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "30",
        "--output-file",
        str(out_file),
    ]
    if opts.dataset in ("random", "random-ids"):
        cmd += [
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
            cmd += ["--dataset-path", opts.dataset_path]
    else:
        cmd += ["--dataset-name", "custom", "--dataset-path", str(dataset_file)]
        cmd += ["--sharegpt-output-len", str(opts.output_len)]
        if opts.apply_chat_template:
            cmd.append("--apply-chat-template")
    if opts.tokenizer:
        cmd += ["--tokenizer", opts.tokenizer]
    cmd += shlex.split(opts.bench_args or "")
    out_file.unlink(missing_ok=True)
    with open(log_file, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = ProcessGroup(cmd, stdout=log)
    try:
        proc.wait(timeout=opts.bench_timeout)
    except subprocess.TimeoutExpired:
        raise ABError(f"bench_serving ran past {opts.bench_timeout} s.\n{_tail(log_file)}") from None
    finally:
        proc.stop(graceful_timeout=10)
    if proc.poll() != 0:
        raise ABError(f"bench_serving exited with code {proc.poll()}.\n{_tail(log_file)}")
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
    return result


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


def greedy_outputs(server: ServerProcess, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    return [server.generate({"text": p, "sampling_params": params})["output_ids"] for p in prompts]


def run_arm(arm: Arm, opts, plan: list[tuple[int, int, int]], raw: Path, pbar, live: list) -> None:
    """Start the arm's server, check, load it for every (concurrency, prompts, repeat); stop it."""
    log = raw / f"server_{safe_name(arm.name)}.log"
    server = ServerProcess(
        arm.server_args,
        env=arm.env,
        log_path=log,
        start_timeout=opts.start_timeout,
        name=f"{arm.name} server",
    )
    arm.port, arm.log = server.port, str(log)
    arm.server_args = [*arm.server_args, "--host", "127.0.0.1", "--port", str(server.port)]
    live.append(server)
    pbar.set_description(f"{arm.name}: starting")
    started = time.perf_counter()
    try:
        try:
            server.start()
        finally:
            if server.process is not None:
                arm.pid = server.process.pid
        arm.start_seconds = round(time.perf_counter() - started, 1)
        pbar.update(1)
        arm.readback = readback(server.server_info())
        if opts.check_prompts > 0:
            pbar.set_description(f"{arm.name}: greedy check")
            t0 = time.perf_counter()
            arm.greedy = greedy_outputs(server, opts.check_texts, opts.check_tokens)
            arm.check_seconds = round(time.perf_counter() - t0, 1)
        for concurrency, num_prompts, rep in plan:
            pbar.set_description(f"{arm.name}: c={concurrency} rep {rep + 1}/{opts.repeats}")
            stem = f"{safe_name(arm.name)}_c{concurrency}_r{rep}"
            t0 = time.perf_counter()
            result = run_bench(
                server.url,
                opts,
                concurrency=concurrency,
                num_prompts=num_prompts,
                seed=opts.seed,
                out_file=raw / f"bench_{stem}.jsonl",
                log_file=raw / f"bench_{stem}.log",
                dataset_file=opts.dataset_file,
            )
            result.update(
                concurrency_requested=concurrency,
                num_prompts=num_prompts,
                repeat=rep,
                wall_seconds=round(time.perf_counter() - t0, 1),  # bench_serving start-up included
            )
            arm.runs.append(result)
            pbar.update(1)
            tok_s = result["output_throughput"]
            accept = result["accept_length"]
            pbar.write(
                f"  {arm.name:<12} c={concurrency:<4} rep {rep + 1}: {tok_s:9.1f} tok/s"
                f"  TPOT {result['median_tpot_ms']:.1f} ms  TTFT {result['median_ttft_ms']:.1f} ms"
                + (f"  accept {accept:.2f}" if accept else "")
            )
    except ServerStartError as error:
        arm.error = str(error)
        raise ABError(f"the {arm.name!r} arm's server did not start:\n{error}") from error
    except ABError as error:
        arm.error = str(error)
        raise ABError(f"the {arm.name!r} arm failed: {error}\nserver log:\n{server.log_tail(20)}") from error
    except Exception as error:  # a request to the server failed (it died, or answered an error)
        arm.error = f"{type(error).__name__}: {error}"
        raise ABError(f"the {arm.name!r} arm failed: {arm.error}\n{server.log_tail(30)}") from error
    finally:
        t0 = time.perf_counter()
        arm.stopped = server.stop()
        arm.stop_seconds = round(time.perf_counter() - t0, 1)
        live.remove(server)


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


def make_plan(concurrency: list[int], num_prompts: list[int], repeats: int) -> list[tuple[int, int, int]]:
    if len(num_prompts) == 1:
        num_prompts = num_prompts * len(concurrency)
    if len(num_prompts) != len(concurrency):
        raise ABError(
            f"--num-prompts gives {len(num_prompts)} values for {len(concurrency)} concurrency levels; "
            "give one value, or one per level."
        )
    return [(c, n, r) for c, n in zip(concurrency, num_prompts) for r in range(repeats)]
