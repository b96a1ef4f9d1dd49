"""SGLang's load generator, kept loaded: ``python -m sglang_ddtree.ab.bench_worker --bench-module M``.

The A/B tool runs one ``bench_serving`` pass per arm, level and repeat, often hundreds per run.
A fresh ``python -m sglang.bench_serving`` imports SGLang each time (several seconds on a GPU
host, 20 s on a small CPU); this worker imports it once and runs the stock tool's own
``run_benchmark`` for each pass, with the command line that pass would have had: the same
parser, requests, warm-up, cache flush, timing and result file as the stock command.

Protocol: one JSON object per line on stdin, ``{"argv": [...], "log": PATH, "rows": PATH|null}``;
one line per pass on stdout, ``@@ab-pass {"ok": bool, "error": str|null}``. The pass's own
output goes to ``log``. ``rows`` (a local prompt file the tool prepared: one JSON object per
line, ``{"prompt": text or token ids, "output_len": N}``) replaces the stock dataset's requests
with those rows, in order (token ids are sent as ``input_ids``, as ``--tokenize-prompt`` does).

Two lookups that are not timed are cached across passes: the tokenizer, and whether the model
has a chat template (each loaded the tokenizer again). The stock module imports every dataset it
knows at its top, among them two that need packages a serving image may lack (``datasets`` for
MMMU, Pillow for images): where one is missing, an empty stand-in module takes its place (the
datasets that need it fail if asked for; no other pass touches it), and the log says so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
import traceback

REPLY = "@@ab-pass "


# Packages the stock load generator imports at its top for datasets the A/B tool does not use.
OPTIONAL_PACKAGES = ("datasets", "PIL", "pybase64")


class _Missing:
    """Whatever a stand-in module is asked for: more of itself; called, an ImportError."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        root = self._name.split(".")[0]
        raise ImportError(f"{root} is not installed here (sglang_ddtree.ab.bench_worker stood in for it)")


def _stand_in(name: str):
    import types

    module = types.ModuleType(name)
    module.__path__ = []  # a package, whose submodules get stand-ins of their own

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{name}.{attr}")

    module.__getattr__ = attribute
    return module


def import_with_stand_ins(name: str, optional=OPTIONAL_PACKAGES) -> tuple[object, list[str]]:
    """``importlib.import_module(name)``, with a stand-in for each package of ``optional`` (or
    module in one) it imports but this environment lacks; returns the module and the stand-ins.
    (A module whose import failed is not kept by Python: the retry imports it afresh.)"""
    stood_in: list[str] = []
    while True:
        try:
            return importlib.import_module(name), stood_in
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if missing.split(".")[0] not in optional or missing in stood_in:
                raise
            sys.modules[missing] = _stand_in(missing)
            stood_in.append(missing)


def _parse(module, argv: list[str]):
    """The stock parser's namespace for ``argv`` (its ``cli_main`` run with ``run_benchmark``
    caught)."""
    captured = {}
    saved = module.run_benchmark, sys.argv
    module.run_benchmark = lambda args: captured.setdefault("args", args)
    sys.argv = ["bench_serving", *argv]
    try:
        module.cli_main()
    finally:
        module.run_benchmark, sys.argv = saved
    return captured["args"]


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def rows_dataset(module, rows: list[dict]):
    """A ``get_dataset`` that serves ``rows`` (cycled to ``--num-prompts``) as the stock
    dataset rows."""
    row_type = module.DatasetRow

    def get_dataset(args, tokenizer, model_id=None):
        out = []
        for i in range(args.num_prompts):
            row = rows[i % len(rows)]
            prompt = row["prompt"]
            if isinstance(prompt, str):
                if getattr(args, "apply_chat_template", False):
                    prompt = tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}],
                        add_generation_prompt=True,
                        tokenize=False,
                        return_dict=False,
                    )
                    if tokenizer.bos_token:
                        prompt = prompt.replace(tokenizer.bos_token, "")
                prompt_len = len(tokenizer.encode(prompt))
            else:
                prompt = [int(t) for t in prompt]
                prompt_len = len(prompt)
            out.append(row_type(prompt=prompt, prompt_len=prompt_len, output_len=int(row["output_len"])))
        return out

    return get_dataset


def run_pass(module, job: dict) -> None:
    args = _parse(module, job["argv"])
    saved = module.get_dataset
    if job.get("rows"):
        module.get_dataset = rows_dataset(module, read_rows(job["rows"]))
    try:
        module.run_benchmark(args)
    finally:
        module.get_dataset = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench-module", default="sglang.benchmark.serving")
    opts = p.parse_args(argv)
    module, stood_in = import_with_stand_ins(opts.bench_module)
    if stood_in:
        print(f"[bench_worker] not installed, stood in for: {', '.join(stood_in)}", flush=True)
    if not hasattr(module, "cli_main") or not hasattr(module, "run_benchmark"):
        print(f"{REPLY}{json.dumps({'ok': False, 'error': f'{opts.bench_module} has no cli_main'})}")
        return 2
    module.get_tokenizer = functools.lru_cache(maxsize=4)(module.get_tokenizer)
    if hasattr(module, "check_chat_template"):
        module.check_chat_template = functools.lru_cache(maxsize=4)(module.check_chat_template)
    reply = sys.stdout
    print(f"{REPLY}{json.dumps({'ok': True, 'ready': True})}", file=reply, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        error = None
        with open(job["log"], "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            print("$ bench_serving " + " ".join(job["argv"]), flush=True)
            try:
                run_pass(module, job)
            except SystemExit as exit_:  # the stock tool exits on a bad argument or a server not ready
                if exit_.code not in (None, 0):
                    error = f"bench_serving exited with code {exit_.code}"
            except BaseException as exc:  # noqa: BLE001 - reported to the tool, which stops the run
                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, KeyboardInterrupt):
                    raise
        print(f"{REPLY}{json.dumps({'ok': error is None, 'error': error})}", file=reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
