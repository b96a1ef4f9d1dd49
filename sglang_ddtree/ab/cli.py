"""A/B against stock SGLang: one command that serves every arm and says, per concurrency level,
which arm wins, with how much confidence.

Each arm is a real SGLang server on a free local port, driven by SGLang's own load generator
(``sglang.bench_serving``, kept loaded in one worker process), every arm with the same requests.
Arms:

* ``plain``: no speculation (the baseline by default);
* ``dflash``: stock ``--speculative-algorithm DFLASH`` with the drafter (on a CPU, where SGLang
  refuses DFLASH, the chain below stands in for it);
* ``chain``: the DFlash chain as DDTREE: ``--speculative-ddtree-max-topk 1``, budget = block - 1;
* ``ddtree`` / ``ddtree@B``: DDTREE with tree budget ``--budget`` / ``B``;
* ``ddtree@auto`` / ``ddtree@autoB``: the online budget (a width per step, trees of up to
  ``--budget`` / ``B`` nodes);
* ``ARM+again``: a second server of ``ARM``, the run's own A/A; ``ARM+phases``: ``ARM`` with the
  DDTREE worker's phase timer on (host time per round phase, from its log, in the report);
  ``ARM+heapq``: ``ARM`` with its tree built by Python's heapq on the host (SGLang's own DDTree's
  builder); ``ARM+name``: a variant of ``ARM`` with its own ``--arm-args`` / ``--arm-env``.

Schedules (``--schedule``): **interleaved**, every server up at once and each repeat running one
pass of every arm in a rotated order; **alternating**, one server at a time, A B A B ...
(``--starts`` rounds), every start measured. ``auto`` picks interleaved where the servers fit in
memory together (always on a CPU). Every arm is compared with the baseline (and every DDTREE arm
with the chain) by the median of the paired ratios of tok/s, with a 90% bootstrap interval; the
verdict is ``wins`` / ``loses`` only where that interval excludes 1 and lies outside the A/A
spread, else ``unresolved``.

Before the load every server answers the same greedy requests (temperature 0, fixed length,
ignore_eos): their token ids must be identical in every arm, or the run fails. The overlap-
scheduler, CUDA-graph and attention settings each server resolved are read back from
``/server_info`` and compared. Output: one file set per series, ``<model>_<device>_<what>``
``.json``, ``.md`` and ``.png`` in ``--results-dir`` (a re-run replaces it), and the folder's
index, ``README.md``. Every server started is stopped, also on failure and Ctrl-C.

    python -m sglang_ddtree.ab --model <target> --drafter <dflash drafter> \\
        --server-args "--tp 8 --trust-remote-code" --arms plain,dflash,ddtree,dflash+again
    SGLANG_USE_CPU_ENGINE=1 python -m lab.ab_tiny --concurrency 1 --num-prompts 4 --output-len 24

See docs/ab.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
import tempfile
from pathlib import Path

from ..launch import cpu_server_args
from . import options, render
from . import report as ab_report
from . import schedule as ab_schedule
from .arms import (
    CHECK_PROMPTS,
    CPU_MAX_TOTAL_TOKENS,
    ABError,
    build_arms,
    chain_reference,
    has_flag,
    is_cpu_run,
)
from .dry_run import dry_run
from .engine import Engine
from .index import write_index
from .profiling import parse_specs
from .run import bench_module, int_list, make_levels, prepare_prompt_rows, safe_name
from .stamp import device_name, git_commit


def build_parser(prog: str = "python -m sglang_ddtree.ab") -> argparse.ArgumentParser:
    return options.build_parser(prog, __doc__)


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
    opts.label = safe_name(opts.label or Path(model.rstrip("/")).name)
    opts.budget = opts.budget or (16 if opts.cpu else 32)
    opts.dataset = opts.dataset or ("random-ids" if opts.cpu else "random")
    opts.input_len = opts.input_len or (64 if opts.cpu else 256)
    opts.start_timeout = opts.start_timeout or (600.0 if cpu else 3600.0)
    if not 0 <= opts.check_prompts <= len(CHECK_PROMPTS):
        raise ABError(f"--check-prompts must be between 0 and {len(CHECK_PROMPTS)}.")
    if opts.repeats < 1 or opts.starts < 1:
        raise ABError("--repeats and --starts must be >= 1.")
    if opts.profile_steps < 1:
        raise ABError("--profile-steps must be >= 1.")
    if not 0.0 < opts.range_ratio <= 1.0:
        raise ABError("--range-ratio must be in (0, 1].")
    if opts.output_len < 4 and opts.dataset == "custom":
        raise ABError("--output-len must be >= 4 with the custom dataset (bench_serving's limit).")
    if opts.warmup_requests != "auto":
        try:
            if int(opts.warmup_requests) < 0:
                raise ValueError
        except ValueError:
            raise ABError(f"--warmup-requests: a count or auto, got {opts.warmup_requests!r}.") from None
    if opts.apply_chat_template and opts.dataset != "custom":
        raise ABError("--apply-chat-template is for the custom dataset.")
    return model, drafter, common, cpu


def main(argv: list[str] | None = None, *, command: list[str] | None = None, on_server_ready=None) -> int:
    """The tool; ``command``: the command line to record (default this process's), and
    ``on_server_ready``: a preset's hook (``Engine``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    opts = build_parser().parse_args(args)
    command = command or ["python", "-m", "sglang_ddtree.ab", *args]
    try:
        model, drafter, common, cpu = _resolve(opts)
        levels = make_levels(int_list(opts.concurrency, "--concurrency"), opts.num_prompts)
        arms = build_arms(opts, model, drafter, common, cpu)
        baseline = _baseline(opts.baseline, [a.name for a in arms])
        opts.reference_arm = baseline  # the greedy check's reference: it keeps its two best log-probs
        opts.profile_specs = parse_specs(opts.profile, [a.name for a in arms], [c for c, _ in levels])
        chosen = ab_schedule.choose(opts.schedule, arms, cpu, model, drafter)
        if opts.prelaunch and chosen.name != "alternating":
            raise ABError(
                f"--prelaunch holds the next server of the alternating schedule; this run is {chosen.name}"
            )
    except ABError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    opts.schedule = chosen.name
    added = ab_schedule.apply(chosen, arms)
    if not opts.device_name:
        opts.device_name = device_name(cpu, ab_schedule.parallel_size(common))
    series = safe_name(opts.series or f"{opts.label}_{opts.device_name}_{opts.what}")
    print(f"[ab] series {series}: {chosen.name} schedule ({chosen.reason})", flush=True)
    if opts.dry_run:
        return dry_run(arms, levels, opts, series, chosen, added)

    date = _dt.datetime.now()
    raw = Path(opts.raw_dir) if opts.raw_dir else Path(tempfile.mkdtemp(prefix=f"ab_{series}_"))
    raw.mkdir(parents=True, exist_ok=True)
    opts.raw = raw
    try:
        dataset_info = _prepare_dataset(opts, max(n for _, n in levels), raw)
    except (ABError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = _settings(opts, series, model, drafter, cpu, arms, baseline, chosen, added, common, levels)
    settings |= {"dataset_info": dataset_info, "raw_dir": str(raw), "commit_at_start": git_commit()}
    engine = Engine(arms, opts, levels, on_server_ready=on_server_ready)
    status, error_text = engine.run()
    report = ab_report.build_report(
        arms=arms,
        settings=settings,
        status=status,
        error=error_text,
        command=command,
        date=date,
        allow_greedy_mismatch=opts.allow_greedy_mismatch,
        strict_parity=opts.strict_parity,
        skipped=engine.skipped,
        dropped=engine.dropped,
        load_generator=engine.worker_record,
        timing=engine.timing,
    )
    results = Path(opts.results_dir)
    paths = render.write_report(report, results, series, plot_png=not opts.no_plot)
    if not opts.no_index:
        paths.append(write_index(results))
    print(render.console_summary(report))
    for path in paths:
        print(f"[ab] wrote {path}")
    return _exit_code(opts, report, status, error_text)


def _settings(opts, series, model, drafter, cpu, arms, baseline, chosen, added, common, levels) -> dict:
    """What the run was asked to do, as the report records it (with the dataset read, the raw
    folder and the commit that ran, added by the caller)."""
    return {
        "series": series,
        "label": opts.label,
        "device_name": opts.device_name,
        "model": model,
        "drafter": drafter,
        "cpu": cpu,
        "arms": [a.name for a in arms],
        "baseline": baseline,
        "chain": chain_reference([a.name for a in arms]),
        "schedule": chosen.name,
        "schedule_reason": chosen.reason,
        "schedule_added_args": added,
        "server_args_common": common,
        "dataset": opts.dataset,
        "dataset_path": opts.dataset_path,
        "input_len": opts.input_len if opts.dataset != "custom" else None,
        "output_len": opts.output_len,
        "range_ratio": opts.range_ratio,
        "concurrency": [c for c, _ in levels],
        "num_prompts": [n for _, n in levels],
        "repeats": opts.repeats,
        "starts": opts.starts if chosen.name == "alternating" else 1,
        "time_limit": opts.time_limit,
        "seed": opts.seed,
        "warmup_requests": opts.warmup_requests,
        "bench_module": bench_module(),
        "bench_args": opts.bench_args,
        "check_prompts": opts.check_texts,
        "check_tokens": opts.check_tokens,
        "allow_greedy_mismatch": opts.allow_greedy_mismatch,
        "greedy_margin": opts.greedy_margin,
        "profile": [f"{arm}@{c}" for arm, c in opts.profile_specs],
        "profile_steps": opts.profile_steps,
        "wait_file": opts.wait_file,
        "prelaunch": opts.prelaunch,
    }


def _baseline(requested: str | None, names: list[str]) -> str:
    baseline = requested or next((n for n in ("plain", "dflash", "chain") if n in names), names[0])
    if baseline not in names:
        raise ABError(f"--baseline {baseline!r} is not one of the arms ({', '.join(names)}).")
    return baseline


def _prepare_dataset(opts, max_prompts: int, raw: Path) -> dict | None:
    """Sets ``opts.dataset_file`` and ``opts.check_texts``; returns the local dataset's description."""
    opts.dataset_file, dataset_info = None, None
    opts.check_texts = CHECK_PROMPTS[: opts.check_prompts]
    opts.profile_prompts = list(CHECK_PROMPTS)  # --profile's requests: the run's own prompts where local
    if opts.dataset == "custom":
        opts.dataset_file, dataset_info, prompts = prepare_prompt_rows(
            opts.dataset_path,
            max_prompts,
            raw / "prompts.jsonl",
            opts.seed,
            opts.output_len,
            opts.range_ratio,
        )
        if opts.dataset_path:  # check greedy equality on the served kind of text
            opts.check_texts = (prompts * opts.check_prompts)[: opts.check_prompts]
        opts.profile_prompts = prompts
    return dataset_info


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
