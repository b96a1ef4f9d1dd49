"""A/B against stock SGLang: one command that launches every arm and reports who wins.

Each arm is a real SGLang server, started in turn on a free local port (a fresh server
per arm: the accept length SGLang reports is a running average over the server's life)
and driven with SGLang's own load generator, ``sglang.bench_serving``, run as a
subprocess once per (concurrency, repeat). Arms:

* ``ddtree``: ``--speculative-algorithm DDTREE --speculative-ddtree-budget B``
  (``ddtree@B`` picks another budget; several may be listed);
* ``chain``: the DFlash chain with the same drafter: stock ``--speculative-algorithm
  DFLASH`` on GPUs; on a CPU (where SGLang refuses DFLASH) DDTREE with
  ``--speculative-ddtree-max-topk 1`` and budget = block size - 1, which is the same chain;
* ``plain``: no speculation.

Before the load, every arm answers the same greedy requests (temperature 0, fixed
length, ignore_eos); their token ids must be identical in every arm, or the run fails.
The overlap-scheduler and CUDA-graph settings each server resolved are read back from
``/server_info`` and compared. Output: ``ab_<label>_<date>.json``, ``.md`` and ``.png``
in ``bench_results/``. Every server started is stopped, also on failure and Ctrl-C.

    python -m sglang_ddtree.bench.ab --model <target> --drafter <dflash drafter> \\
        --server-args "--tp 8 --trust-remote-code" --concurrency 1,4,16,64 --num-prompts 64,128,256,512
    SGLANG_USE_CPU_ENGINE=1 python -m sglang_ddtree.bench.ab --tiny --concurrency 1 --num-prompts 4 --output-len 24

See docs/ab.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..launch import ProcessGroup, ServerProcess, ServerStartError, cpu_server_args
from .ab_arms import (  # the arms and the keys the report reads (ab_report imports them there)
    BENCH_FIELDS,
    CHECK_PROMPTS,
    CONTEXT_KEYS,
    DEFAULT_ARMS,
    PARITY_KEYS,
    TINY_MAX_TOTAL_TOKENS,
    Arm,
)


class ABError(RuntimeError):
    """A run that cannot go on; the message says why (and ends with a log tail when there is one)."""


class Interrupted(BaseException):
    """SIGTERM/SIGHUP, handled like Ctrl-C: stop everything, write what was measured."""


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def is_cpu_run(server_args: list[str]) -> bool:
    return _flag_value(server_args, "--device") == "cpu"


def drafter_block_size(drafter: str) -> int:
    """Block size from the drafter's config.json (a local folder, or a hub id if it can be fetched)."""
    from ..adapter.server_args import drafter_block_size as from_config

    path = Path(drafter) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(drafter, "config.json"))
        except Exception as error:  # noqa: BLE001 - any failure means: ask for --block-size
            raise ABError(
                f"cannot read the drafter's block size from {drafter!r} ({error}); pass --block-size."
            ) from error
    return from_config(json.loads(path.read_text()))


def parse_arm_names(text: str) -> list[tuple[str, str, int | None]]:
    """``ddtree,ddtree@64,chain,plain`` -> [(name, kind, budget)]."""
    arms = []
    for raw in [t.strip() for t in text.split(",") if t.strip()]:
        match = re.fullmatch(r"(ddtree|chain|plain)(?:@(\d+))?", raw)
        if not match:
            raise ABError(f"--arms: unknown arm {raw!r}; expected ddtree, ddtree@BUDGET, chain or plain.")
        kind, budget = match.group(1), match.group(2)
        if budget is not None and kind != "ddtree":
            raise ABError(f"--arms: {raw!r}: only ddtree takes a budget (ddtree@BUDGET).")
        arms.append((raw, kind, None if budget is None else int(budget)))
    names = [a[0] for a in arms]
    if len(set(names)) != len(names):
        raise ABError(f"--arms lists an arm twice: {text!r}.")
    if not arms:
        raise ABError("--arms is empty.")
    return arms


def build_arms(opts, model: str, drafter: str | None, common: list[str], cpu: bool) -> list[Arm]:
    per_arm = _parse_arm_args(opts.arm_args)
    chain_impl = opts.chain_impl
    if chain_impl == "auto":
        chain_impl = "ddtree-topk1" if cpu else "dflash"
    # DDTree variables in this environment reach every server: show them in the report.
    inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_DDTREE_")}
    arms = []
    for name, kind, budget in parse_arm_names(opts.arms):
        extra = per_arm.pop(name, [])
        env: dict[str, str] = dict(inherited)
        if kind != "plain" and not drafter:
            raise ABError(
                f"arm {name!r} needs a drafter: pass --drafter (a DFlash drafter folder or hub id)."
            )
        if kind == "ddtree":
            budget = budget or opts.budget
            spec = [
                "--speculative-algorithm",
                "DDTREE",
                "--speculative-draft-model-path",
                drafter,
                "--speculative-ddtree-budget",
                str(budget),
            ]
            description = f"DDTREE, tree budget {budget}"
        elif kind == "chain" and chain_impl == "dflash":
            spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter]
            description = "stock SGLang DFLASH (the DFlash chain), same drafter"
        elif kind == "chain":
            block = opts.block_size or drafter_block_size(drafter)
            spec = [
                "--speculative-algorithm",
                "DDTREE",
                "--speculative-draft-model-path",
                drafter,
                "--speculative-ddtree-budget",
                str(block - 1),
                "--speculative-ddtree-max-topk",
                "1",
            ]
            description = (
                f"the DFlash chain as DDTREE with --speculative-ddtree-max-topk 1 and budget {block - 1} "
                f"(block {block} - 1): one candidate per depth (SGLang refuses DFLASH on this platform)"
            )
        else:
            spec = []
            description = "no speculation"
        args = [*common, *spec, *extra]
        if not _has_flag(args, "--decode-log-interval"):
            args += ["--decode-log-interval", "1"]  # the accept-length statistics update every N steps
        if cpu:
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        arms.append(
            Arm(
                name=name,
                kind=kind,
                description=description,
                server_args=["--model-path", model, *args],
                env=env,
            )
        )
    if per_arm:
        raise ABError(f"--arm-args names arms that are not run: {', '.join(sorted(per_arm))}.")
    return arms


def _parse_arm_args(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        if not sep or not name.strip():
            raise ABError(f"--arm-args {item!r}: expected NAME='--flag value ...'.")
        out.setdefault(name.strip(), []).extend(shlex.split(rest))
    return out


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
    log = raw / f"server_{_safe(arm.name)}.log"
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
            stem = f"{_safe(arm.name)}_c{concurrency}_r{rep}"
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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def _int_list(text: str, what: str) -> list[int]:
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


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_ddtree.bench.ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to serve")
    g.add_argument("--model", help="target model (folder or hub id)")
    g.add_argument("--drafter", help="DFlash drafter (folder or hub id), shared by the ddtree and chain arms")
    g.add_argument(
        "--tiny",
        action="store_true",
        help="build the tiny CPU models and add the CPU serving flags (--device cpu "
        "--attention-backend torch_native --max-total-tokens 8192 --dtype float32)",
    )
    g.add_argument("--server-args", default="", help="extra flags for every arm's server (one string)")
    g.add_argument(
        "--arm-args",
        action="append",
        default=[],
        metavar="ARM='--flag ...'",
        help="extra flags for one arm only (repeatable), e.g. ddtree='--speculative-dflash-block-size 8'",
    )
    g.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"comma-separated arms, run in this order (default {DEFAULT_ARMS}); ddtree@B for budget B",
    )
    g.add_argument(
        "--budget",
        type=int,
        default=None,
        help="DDTREE budget of the ddtree arm (default 32; 16 with --tiny)",
    )
    g.add_argument(
        "--chain-impl",
        choices=("auto", "dflash", "ddtree-topk1"),
        default="auto",
        help="chain arm: stock DFLASH, or DDTREE with MAX_TOPK=1 and budget=block-1 (auto: DFLASH unless --device cpu)",
    )
    g.add_argument(
        "--block-size", type=int, default=None, help="drafter block size (default: its config.json)"
    )
    g.add_argument(
        "--baseline", default=None, help="arm the others are compared with (default: plain, else chain)"
    )

    g = p.add_argument_group("load (sglang.bench_serving)")
    g.add_argument(
        "--dataset",
        choices=("random", "random-ids", "custom"),
        default=None,
        help="random: SGLang's random dataset (ShareGPT text cut to --input-len; downloads ShareGPT unless "
        "--dataset-path); random-ids: random token ids, no download; custom: prompts from --dataset-path "
        "(JSONL or a JSON array; default: built-in prompts), whose first prompts also serve the greedy "
        "check. Default: random-ids with --tiny, else random",
    )
    g.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON for random, or a prompts file for custom"
    )
    g.add_argument(
        "--apply-chat-template", action="store_true", help="custom dataset: wrap prompts in the chat template"
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer for bench_serving (default: the server's)")
    g.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random datasets: prompt tokens (default 256; 64 with --tiny)",
    )
    g.add_argument("--output-len", type=int, default=256, help="output tokens per request (ignore_eos)")
    g.add_argument(
        "--range-ratio", type=float, default=1.0, help="random datasets: lengths drawn from [ratio*len, len]"
    )
    g.add_argument("--concurrency", default="1,4,16,64", help="comma-separated --max-concurrency values")
    g.add_argument(
        "--num-prompts", default="64", help="prompts per run: one value, or one per concurrency level"
    )
    g.add_argument("--repeats", type=int, default=1, help="runs per concurrency level (medians are reported)")
    g.add_argument("--seed", type=int, default=1, help="dataset seed, the same for every arm")
    g.add_argument(
        "--warmup-requests", type=int, default=1, help="bench_serving warm-up requests before each run"
    )
    g.add_argument("--bench-args", default="", help="extra flags for every bench_serving run (one string)")

    g = p.add_argument_group("greedy side-check")
    g.add_argument(
        "--check-prompts",
        type=int,
        default=4,
        help=f"greedy prompts per arm (0..{len(CHECK_PROMPTS)}; 0: off)",
    )
    g.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt")
    g.add_argument(
        "--allow-greedy-mismatch",
        action="store_true",
        help="report greedy mismatches without failing (bf16 on GPUs can flip a near-tied argmax)",
    )

    g = p.add_argument_group("run")
    g.add_argument("--label", default=None, help="report name part (default: tiny-cpu, or the model's name)")
    g.add_argument(
        "--out-dir", default="bench_results", help="where the reports go (default ./bench_results)"
    )
    g.add_argument("--raw-dir", default=None, help="server and bench logs (default: a new temporary folder)")
    g.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds to wait for a server (240 with --tiny, else 3600)",
    )
    g.add_argument(
        "--bench-timeout", type=float, default=3600.0, help="seconds one bench_serving run may take"
    )
    g.add_argument(
        "--strict-parity", action="store_true", help="fail when the arms' overlap/CUDA-graph settings differ"
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def _resolve(opts) -> tuple[str, str | None, list[str], bool]:
    common = shlex.split(opts.server_args or "")
    if opts.tiny:
        from ..models.tiny import build_tiny_models

        models = build_tiny_models()
        if opts.model or opts.drafter:
            raise ABError("--tiny builds its own target and drafter; leave out --model and --drafter.")
        model, drafter = str(models.target), str(models.drafter)
        common = cpu_server_args(model, common, TINY_MAX_TOTAL_TOKENS)[2:]  # drop --model-path
        opts.block_size = opts.block_size or models.spec.block_size
        opts.label = opts.label or "tiny-cpu"
    else:
        if not opts.model:
            raise ABError("pass --model (and --drafter), or --tiny for the tiny CPU models.")
        model, drafter = opts.model, opts.drafter
    cpu = is_cpu_run(common)
    if cpu and not _has_flag(common, "--dtype"):
        # Greedy equality must not hinge on bf16 rounding between a batched verify and a
        # one-token decode, which can flip a near-tied argmax on a CPU (docs/ab.md).
        common += ["--dtype", "float32"]
    if opts.label is None:
        opts.label = Path(model.rstrip("/")).name + ("-cpu" if cpu else "")
    opts.label = _safe(opts.label)
    opts.budget = opts.budget or (16 if opts.tiny else 32)
    opts.dataset = opts.dataset or ("random-ids" if opts.tiny else "random")
    opts.input_len = opts.input_len or (64 if opts.tiny else 256)
    opts.start_timeout = opts.start_timeout or (240.0 if opts.tiny else 3600.0)
    if not 0 <= opts.check_prompts <= len(CHECK_PROMPTS):
        raise ABError(f"--check-prompts must be between 0 and {len(CHECK_PROMPTS)}.")
    if opts.repeats < 1:
        raise ABError("--repeats must be >= 1.")
    if opts.output_len < 4 and opts.dataset == "custom":
        raise ABError("--output-len must be >= 4 with the custom dataset (bench_serving's limit).")
    return model, drafter, common, cpu


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


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from . import ab_report
    from ._stamp import git_commit

    opts = build_parser().parse_args(argv)
    try:
        model, drafter, common, cpu = _resolve(opts)
        concurrency = _int_list(opts.concurrency, "--concurrency")
        num_prompts = _int_list(opts.num_prompts, "--num-prompts")
        plan = make_plan(concurrency, num_prompts, opts.repeats)
        arms = build_arms(opts, model, drafter, common, cpu)
    except ABError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    names = [a.name for a in arms]
    baseline = opts.baseline or next((n for n in ("plain", "chain") if n in names), names[0])
    if baseline not in names:
        print(f"error: --baseline {baseline!r} is not one of the arms ({', '.join(names)}).", file=sys.stderr)
        return 2

    date = _dt.datetime.now()
    stem = f"ab_{opts.label}_{date.strftime('%Y%m%d-%H%M%S')}"
    raw = Path(opts.raw_dir) if opts.raw_dir else Path(tempfile.mkdtemp(prefix=stem + "_"))
    raw.mkdir(parents=True, exist_ok=True)
    opts.dataset_file, dataset_info = None, None
    opts.check_texts = CHECK_PROMPTS[: opts.check_prompts]
    if opts.dataset == "custom":
        try:
            opts.dataset_file, dataset_info, prompts = prepare_custom_dataset(
                opts.dataset_path, max(num_prompts) + opts.warmup_requests, raw / "prompts.jsonl", opts.seed
            )
        except (ABError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if opts.dataset_path:  # check greedy equality on the served kind of text
            opts.check_texts = (prompts * opts.check_prompts)[: opts.check_prompts]
    settings = {
        "label": opts.label,
        "tiny": opts.tiny,
        "model": model,
        "drafter": drafter,
        "cpu": cpu,
        "arms": names,
        "baseline": baseline,
        "server_args_common": common,
        "dataset": opts.dataset,
        "dataset_path": opts.dataset_path,
        "dataset_info": dataset_info,
        "input_len": opts.input_len if opts.dataset != "custom" else None,
        "output_len": opts.output_len,
        "range_ratio": opts.range_ratio if opts.dataset != "custom" else None,
        "concurrency": concurrency,
        "num_prompts": [n for c, n, r in plan if r == 0],
        "repeats": opts.repeats,
        "seed": opts.seed,
        "warmup_requests": opts.warmup_requests,
        "bench_module": bench_module(),
        "bench_args": opts.bench_args,
        "check_prompts": opts.check_texts,
        "check_tokens": opts.check_tokens,
        "raw_dir": str(raw),
        "commit_at_start": git_commit(),  # the code that ran; the stamp's commit is taken at the end
    }

    live: list[ServerProcess] = []
    status, error_text = "ok", None
    previous = _install_signal_handlers()
    print(f"[ab] {len(arms)} arms ({', '.join(names)}), {len(plan)} runs each; logs in {raw}", flush=True)
    pbar = tqdm(total=len(arms) * (1 + len(plan)), unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        for arm in arms:
            run_arm(arm, opts, plan, raw, pbar, live)
    except ABError as error:
        status, error_text = "failed", str(error)
    except (KeyboardInterrupt, Interrupted) as error:
        status, error_text = (
            "interrupted",
            f"interrupted ({error or 'Ctrl-C'}); every server started was stopped",
        )
    finally:
        for server in list(live):  # normally empty: run_arm stops its own
            server.stop()
        pbar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    report = ab_report.build_report(
        arms=arms,
        settings=settings,
        status=status,
        error=error_text,
        command=[sys.executable, "-m", "sglang_ddtree.bench.ab", *(sys.argv[1:] if argv is None else argv)],
        date=date,
        allow_greedy_mismatch=opts.allow_greedy_mismatch,
        strict_parity=opts.strict_parity,
    )
    paths = ab_report.write_report(report, Path(opts.out_dir), stem, plot_png=not opts.no_plot)
    print(ab_report.console_summary(report))
    for path in paths:
        print(f"[ab] wrote {path}")
    if status == "interrupted":
        print(f"error: {error_text}", file=sys.stderr)
        return 130
    if status == "failed":
        print(f"error: {error_text}", file=sys.stderr)
        return 2
    if not report["greedy_check"]["ok"] and not opts.allow_greedy_mismatch:
        print(f"error: {report['greedy_check']['message']}", file=sys.stderr)
        return 1
    if opts.strict_parity and not report["parity"]["ok"]:
        print(f"error: {report['parity']['message']}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
