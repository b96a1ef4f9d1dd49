"""A/B against stock SGLang: one command that launches every arm and reports who wins.

Each arm is a real SGLang server, started in turn on a free local port (a fresh server
per arm: the accept length SGLang reports is a running average over the server's life)
and driven with SGLang's own load generator, ``sglang.bench_serving``, run as a
subprocess once per (concurrency, repeat). Arms:

* ``ddtree``: ``--speculative-algorithm DDTREE --speculative-ddtree-budget B``
  (``ddtree@B`` picks another budget; several may be listed; ``ddtree@auto`` / ``ddtree@autoB``
  serve the online budget, ``--speculative-ddtree-budget auto`` with trees of up to ``--budget``
  / ``B`` nodes, beside fixed budgets in the same run);
* ``chain``: the DFlash chain with the same drafter: stock ``--speculative-algorithm
  DFLASH`` on GPUs; on a CPU (where SGLang refuses DFLASH) DDTREE with
  ``--speculative-ddtree-max-topk 1`` and budget = block size - 1, which is the same chain;
* ``plain``: no speculation.

Before the load, every arm answers the same greedy requests (temperature 0, fixed
length, ignore_eos); their token ids must be identical in every arm, or the run fails.
The overlap-scheduler and CUDA-graph settings each server resolved are read back from
``/server_info`` and compared. Output: ``ab_<label>_<date>.json``, ``.md`` and ``.png``
in ``bench_results/``. Every server started is stopped, also on failure and Ctrl-C.

    python -m sglang_ddtree.ab --model <target> --drafter <dflash drafter> \\
        --server-args "--tp 8 --trust-remote-code" --concurrency 1,4,16,64 --num-prompts 64,128,256,512
    SGLANG_USE_CPU_ENGINE=1 python -m lab.ab_tiny --concurrency 1 --num-prompts 4 --output-len 24

See docs/ab.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from ..launch import ServerProcess, cpu_server_args
from . import render
from . import report as ab_report
from .arms import (
    CHECK_PROMPTS,
    CPU_MAX_TOTAL_TOKENS,
    DEFAULT_ARMS,
    ABError,
    build_arms,
    has_flag,
    is_cpu_run,
)
from .run import bench_module, int_list, make_plan, prepare_custom_dataset, run_arm, safe_name
from .stamp import git_commit


class Interrupted(BaseException):
    """SIGTERM/SIGHUP, handled like Ctrl-C: stop everything, write what was measured."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_ddtree.ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(p)
    _add_load_args(p)
    _add_check_args(p)
    _add_run_args(p)
    return p


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to serve")
    g.add_argument("--model", help="target model (folder or hub id)")
    g.add_argument("--drafter", help="DFlash drafter (folder or hub id), shared by the ddtree and chain arms")
    g.add_argument(
        "--cpu",
        action="store_true",
        help="serve on the CPU (SGLANG_USE_CPU_ENGINE=1; adds --device cpu --attention-backend "
        "torch_native --max-total-tokens 8192 --dtype float32) with small defaults for small models",
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
        help=f"comma-separated arms, run in this order (default {DEFAULT_ARMS}); ddtree@B for budget B, "
        "ddtree@auto / ddtree@autoB for the online budget (trees of up to --budget / B nodes)",
    )
    g.add_argument(
        "--budget",
        type=int,
        default=None,
        help="DDTREE budget of the ddtree arm (default 32; 16 with --cpu)",
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


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (sglang.bench_serving)")
    g.add_argument(
        "--dataset",
        choices=("random", "random-ids", "custom"),
        default=None,
        help="random: SGLang's random dataset (ShareGPT text cut to --input-len; downloads ShareGPT unless "
        "--dataset-path); random-ids: random token ids, no download; custom: prompts from --dataset-path "
        "(JSONL or a JSON array; default: built-in prompts), whose first prompts also serve the greedy "
        "check. Default: random-ids with --cpu, else random",
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
        help="random datasets: prompt tokens (default 256; 64 with --cpu)",
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


def _add_check_args(p: argparse.ArgumentParser) -> None:
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


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument(
        "--label", default=None, help="report name part (default: the model's name, -cpu on the CPU)"
    )
    g.add_argument(
        "--out-dir", default="bench_results", help="where the reports go (default ./bench_results)"
    )
    g.add_argument("--raw-dir", default=None, help="server and bench logs (default: a new temporary folder)")
    g.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds to wait for a server (240 with --cpu, else 3600)",
    )
    g.add_argument(
        "--bench-timeout", type=float, default=3600.0, help="seconds one bench_serving run may take"
    )
    g.add_argument(
        "--strict-parity", action="store_true", help="fail when the arms' overlap/CUDA-graph settings differ"
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")


def _resolve(opts) -> tuple[str, str | None, list[str], bool]:
    common = shlex.split(opts.server_args or "")
    if not opts.model:
        raise ABError("pass --model (and --drafter).")
    model, drafter = opts.model, opts.drafter
    if opts.cpu:
        common = cpu_server_args(model, common, CPU_MAX_TOTAL_TOKENS)[2:]  # drop --model-path
    cpu = is_cpu_run(common)
    if cpu and not has_flag(common, "--dtype"):
        # Greedy equality must not hinge on bf16 rounding between a batched verify and a
        # one-token decode, which can flip a near-tied argmax on a CPU (docs/ab.md).
        common += ["--dtype", "float32"]
    if opts.label is None:
        opts.label = Path(model.rstrip("/")).name + ("-cpu" if cpu else "")
    opts.label = safe_name(opts.label)
    opts.budget = opts.budget or (16 if opts.cpu else 32)
    opts.dataset = opts.dataset or ("random-ids" if opts.cpu else "random")
    opts.input_len = opts.input_len or (64 if opts.cpu else 256)
    opts.start_timeout = opts.start_timeout or (240.0 if opts.cpu else 3600.0)
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
    opts = build_parser().parse_args(argv)
    try:
        model, drafter, common, cpu = _resolve(opts)
        concurrency = int_list(opts.concurrency, "--concurrency")
        num_prompts = int_list(opts.num_prompts, "--num-prompts")
        plan = make_plan(concurrency, num_prompts, opts.repeats)
        arms = build_arms(opts, model, drafter, common, cpu)
        baseline = _baseline(opts.baseline, [a.name for a in arms])
    except ABError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    date = _dt.datetime.now()
    stem = f"ab_{opts.label}_{date.strftime('%Y%m%d-%H%M%S')}"
    raw = Path(opts.raw_dir) if opts.raw_dir else Path(tempfile.mkdtemp(prefix=stem + "_"))
    raw.mkdir(parents=True, exist_ok=True)
    try:
        dataset_info = _prepare_dataset(opts, max(num_prompts), raw)
    except (ABError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = _settings(
        opts, model, drafter, common, cpu, arms, baseline, concurrency, plan, raw, dataset_info
    )
    status, error_text = _run_arms(arms, opts, plan, raw)
    report = ab_report.build_report(
        arms=arms,
        settings=settings,
        status=status,
        error=error_text,
        command=[sys.executable, "-m", "sglang_ddtree.ab", *(sys.argv[1:] if argv is None else argv)],
        date=date,
        allow_greedy_mismatch=opts.allow_greedy_mismatch,
        strict_parity=opts.strict_parity,
    )
    paths = render.write_report(report, Path(opts.out_dir), stem, plot_png=not opts.no_plot)
    print(render.console_summary(report))
    for path in paths:
        print(f"[ab] wrote {path}")
    return _exit_code(opts, report, status, error_text)


def _baseline(requested: str | None, names: list[str]) -> str:
    baseline = requested or next((n for n in ("plain", "chain") if n in names), names[0])
    if baseline not in names:
        raise ABError(f"--baseline {baseline!r} is not one of the arms ({', '.join(names)}).")
    return baseline


def _prepare_dataset(opts, max_prompts: int, raw: Path) -> dict | None:
    """Sets ``opts.dataset_file`` and ``opts.check_texts``; returns the custom dataset's description."""
    opts.dataset_file, dataset_info = None, None
    opts.check_texts = CHECK_PROMPTS[: opts.check_prompts]
    if opts.dataset == "custom":
        opts.dataset_file, dataset_info, prompts = prepare_custom_dataset(
            opts.dataset_path, max_prompts + opts.warmup_requests, raw / "prompts.jsonl", opts.seed
        )
        if opts.dataset_path:  # check greedy equality on the served kind of text
            opts.check_texts = (prompts * opts.check_prompts)[: opts.check_prompts]
    return dataset_info


def _settings(
    opts, model, drafter, common, cpu, arms, baseline, concurrency, plan, raw, dataset_info
) -> dict:
    """What the run was asked to do, as the report records it."""
    return {
        "label": opts.label,
        "model": model,
        "drafter": drafter,
        "cpu": cpu,
        "arms": [a.name for a in arms],
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


def _run_arms(arms, opts, plan, raw: Path) -> tuple[str, str | None]:
    """Every arm in turn; every server started is stopped, also on failure and on a signal."""
    from tqdm import tqdm

    live: list[ServerProcess] = []
    status, error_text = "ok", None
    previous = _install_signal_handlers()
    names = ", ".join(a.name for a in arms)
    print(f"[ab] {len(arms)} arms ({names}), {len(plan)} runs each; logs in {raw}", flush=True)
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
    return status, error_text


def _exit_code(opts, report: dict, status: str, error_text: str | None) -> int:
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
