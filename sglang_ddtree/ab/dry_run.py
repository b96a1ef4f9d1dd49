"""``--dry-run``: what a run would start and measure, and every arm's server flags checked with
SGLang's own parser, with nothing started."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .arms import ABError
from .run import read_prompts


def check_server_flags(arms) -> list[str]:
    """Each arm's server flags through SGLang's own parser (with DDTREE's flags): the problems
    found, one line per arm. Nothing is started; SGLang's checks of the values, which need the
    model and the device, are not run."""
    import argparse as _argparse
    import contextlib
    import io

    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as error:  # noqa: BLE001 - SGLang absent or broken here: say so
        return [f"SGLang's argument parser could not be loaded ({type(error).__name__}: {error})"]
    from ..adapter.server_args import add_cli_args

    problems = []
    for arm in arms:
        parser = _argparse.ArgumentParser(prog=f"{arm.name} server")
        ServerArgs.add_cli_args(parser)
        add_cli_args(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(arm.server_args)
        except SystemExit:
            problems.append(f"{arm.name}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


def dry_run(arms, levels, opts, series: str, chosen, added: list[str]) -> int:
    starts = opts.starts if chosen.name == "alternating" else 1
    passes = len(arms) * len(levels) * opts.repeats * starts
    print(f"series {series} -> {Path(opts.results_dir) / series}.{{json,md,png}}")
    print(f"schedule {chosen.name}: {chosen.reason}" + (f"; added {' '.join(added)}" if added else ""))
    print(
        "levels: "
        + ", ".join(f"c={c} x {n} prompts" for c, n in levels)
        + f"; {opts.repeats} repeats"
        + (f" x {starts} starts" if starts > 1 else "")
        + f": {passes} passes"
    )
    info = f"{opts.dataset}" + (f" from {opts.dataset_path}" if opts.dataset_path else "")
    if opts.dataset == "custom" and opts.dataset_path:
        try:
            info += f" ({len(read_prompts(opts.dataset_path))} prompts)"
        except (ABError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    print(f"load: {info}, output {opts.output_len} tokens (range ratio {opts.range_ratio})")
    for arm, concurrency in getattr(opts, "profile_specs", ()):
        print(f"profile: {arm} at c={concurrency}, {opts.profile_steps} steps under SGLang's torch profiler")
    if getattr(opts, "prelaunch", False):
        print(
            "each next server is launched during the current one's passes, held at its gate until that one stops"
        )
    if getattr(opts, "wait_file", None):
        print(f"the first pass waits for {opts.wait_file}")
    for arm in arms:
        env = " ".join(f"{k}={v}" for k, v in arm.env.items())
        print(f"[{arm.name}] {arm.description}\n    {env + ' ' if env else ''}{shlex.join(arm.command())}")
    problems = check_server_flags(arms)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    print("server flags: " + ("refused, above" if problems else "every arm's parse"))
    return 2 if problems else 0
