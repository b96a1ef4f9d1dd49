"""The A/B tool's arms: what each one serves (``build_arms``), and the ``/server_info`` keys
every arm is compared on (read by ``run.py``, which runs the arms, and ``report.py``)."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ENV_PHASE_TIMES, ENV_TREE_BACKEND
from ..launch import has_flag

PHASE_INTERVAL = 50  # ARM+phases: rounds per logged phase line, unless its --arm-env says otherwise

ARM_KINDS = ("plain", "dflash", "chain", "ddtree")


DEFAULT_ARMS = "plain,dflash,ddtree,dflash+again"


AGAIN = "+again"  # a second server of the same arm: the run's own A/A
PHASES = "+phases"  # ARM with the DDTREE worker's phase timer on (phase_log.py)
# ARM with its tree built by Python's heapq on the host, as SGLang's own DDTree builds it: what a
# service on SGLang's DDTree runs today, beside the plugin's GPU tree step (a debugging switch of
# the plugin's tree builder, ENV_TREE_BACKEND)
HEAPQ = "+heapq"


CPU_MAX_TOTAL_TOKENS = 8192


# Greedy side-check prompts: short, varied, fixed.
CHECK_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10",
    "for i in range(10):\n    print(i, i * i)\n",
    "A draft tree holds many candidate continuations; the target checks all of them at once.",
    "Letters: a b c d e f g h i j k l m n o p.",
    "Question: what is 17 times 23? Answer:",
]


# Read back from /server_info. Parity keys must be equal in every arm for a fair A/B;
# context keys are reported when they differ.
PARITY_KEYS = (
    "disable_overlap_schedule",
    "disable_cuda_graph",
    "disable_decode_cuda_graph",
    "disable_prefill_cuda_graph",
    "cuda_graph_config.decode.backend",
    "cuda_graph_config.decode.max_bs",
    "cuda_graph_config.prefill.backend",
    "enable_torch_compile",
    "enable_two_batch_overlap",
    # DDTREE may pick a tree-capable backend where SGLang would pick another for the other arms.
    "attention_backend",
    "decode_attention_backend",
    "prefill_attention_backend",
)


# The flags that set each parity key, to tell a setting given here from one SGLang chose.
PARITY_FLAGS = {
    "disable_overlap_schedule": ("--disable-overlap-schedule",),
    "disable_cuda_graph": ("--disable-cuda-graph",),
    "disable_decode_cuda_graph": ("--disable-decode-cuda-graph", "--disable-cuda-graph"),
    "disable_prefill_cuda_graph": ("--disable-prefill-cuda-graph", "--disable-cuda-graph"),
    "cuda_graph_config.decode.backend": (
        "--cuda-graph-backend-decode",
        "--disable-decode-cuda-graph",
        "--disable-cuda-graph",
        "--cuda-graph-config",
    ),
    "cuda_graph_config.decode.max_bs": (
        "--cuda-graph-max-bs-decode",
        "--cuda-graph-bs-decode",
        "--cuda-graph-config",
    ),
    "cuda_graph_config.prefill.backend": (
        "--cuda-graph-backend-prefill",
        "--disable-prefill-cuda-graph",
        "--disable-cuda-graph",
        "--cuda-graph-config",
    ),
    "enable_torch_compile": ("--enable-torch-compile",),
    "enable_two_batch_overlap": ("--enable-two-batch-overlap",),
    "attention_backend": ("--attention-backend",),
    "decode_attention_backend": ("--decode-attention-backend", "--attention-backend"),
    "prefill_attention_backend": ("--prefill-attention-backend", "--attention-backend"),
}


CONTEXT_KEYS = (
    "device",
    "dtype",
    "tp_size",
    "dp_size",
    "ep_size",
    "page_size",
    "kv_cache_dtype",
    "quantization",
    "max_running_requests",
    "chunked_prefill_size",
    "max_total_tokens",
    "mem_fraction_static",
    "disable_radix_cache",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_dflash_block_size",
    "speculative_draft_model_path",
    "effective_max_running_requests_per_dp",
)


SPEC_KEYS = (
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_dflash_block_size",
    "speculative_draft_model_path",
)


BENCH_FIELDS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_throughput",
    "median_tpot_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "median_ttft_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "median_e2e_latency_ms",
    "concurrency",
    "max_concurrent_requests",
    "accept_length",
)


class ABError(RuntimeError):
    """A run that cannot go on; the message says why (and ends with a log tail when there is one)."""


@dataclass
class Arm:
    name: str  # as given in --arms, e.g. ddtree@32, dflash+again, ddtree@32+py
    kind: str  # plain | dflash | chain | ddtree
    description: str
    server_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    base: str = ""  # the name without its +variant suffix
    variant: str | None = None  # "+again", "+py", ... or None
    # Filled while the arm runs: one record per server start (several in the alternating
    # schedule), and one record per timed pass.
    servers: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)  # --profile ARM@C: one summary per profile
    error: str | None = None

    @property
    def again(self) -> bool:
        return self.variant == AGAIN

    @property
    def readback(self) -> dict:
        """The settings the arm's first server resolved (``/server_info``)."""
        return next((s["readback"] for s in self.servers if s.get("readback")), {})

    def command(self) -> list[str]:
        return ["python", "-m", "sglang.launch_server", *self.server_args]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "base": self.base,
            "variant": self.variant,
            "description": self.description,
            "launch_command": shlex.join(self.command()),
            "server_args": self.server_args,
            "env": self.env,
            "servers": self.servers,
            "runs": self.runs,
            "profiles": self.profiles,
            "error": self.error,
        }


def flag_value(args: list[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(args):  # the last one wins, as in argparse
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def is_cpu_run(server_args: list[str]) -> bool:
    return flag_value(server_args, "--device") == "cpu"


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


ARM_PATTERN = re.compile(r"(plain|dflash|chain|ddtree)(?:@(\d+|auto\d*))?(\+[A-Za-z0-9_-]+)?")


def parse_arm_names(text: str) -> list[tuple[str, str, int | str | None]]:
    """``ddtree,ddtree@64,ddtree@auto32,dflash,dflash+again,plain`` -> [(name, kind, budget)];
    the online budget's arms (``ddtree@auto``, ``ddtree@autoN``) carry the budget ``"auto"`` /
    ``"autoN"``. A ``+suffix`` names a variant of an arm (``+again``: a second server of it)."""
    arms = []
    for raw in [t.strip() for t in text.split(",") if t.strip()]:
        match = ARM_PATTERN.fullmatch(raw)
        if not match:
            raise ABError(
                f"--arms: unknown arm {raw!r}; expected plain, dflash, chain, ddtree, ddtree@BUDGET or "
                "ddtree@auto[BUDGET], optionally with a +variant suffix (+again: the same arm's second server)."
            )
        kind, budget = match.group(1), match.group(2)
        if budget is not None and kind != "ddtree":
            raise ABError(f"--arms: {raw!r}: only ddtree takes a budget (ddtree@BUDGET).")
        arms.append((raw, kind, budget if budget is None or budget.startswith("auto") else int(budget)))
    names = [a[0] for a in arms]
    if len(set(names)) != len(names):
        raise ABError(f"--arms lists an arm twice: {text!r} (name a second server of an arm ARM+again).")
    if not arms:
        raise ABError("--arms is empty.")
    for name in names:
        base, variant = split_variant(name)
        if variant is not None and base not in names:
            raise ABError(f"--arms: {name!r} is a variant of {base!r}, which is not an arm of the run.")
    return arms


def split_variant(name: str) -> tuple[str, str | None]:
    """``ddtree@32+again`` -> (``ddtree@32``, ``+again``); ``plain`` -> (``plain``, None)."""
    base, plus, suffix = name.partition("+")
    return (base, plus + suffix) if plus else (name, None)


def build_arms(opts, model: str, drafter: str | None, common: list[str], cpu: bool) -> list[Arm]:
    """The arms of ``opts.arms``: each one's server flags (``common``, its speculative flags, then
    its ``--arm-args``) and environment (``--arm-env``). A variant ``X+v`` gets ``X``'s flags and
    environment and then its own; ``X+again`` may have none of its own (it is ``X`` again)."""
    per_arm = _parse_arm_args(getattr(opts, "arm_args", None))
    per_env = parse_arm_env(getattr(opts, "arm_env", None))
    names = [n for n, _, _ in parse_arm_names(opts.arms)]
    for what, given in (("--arm-args", per_arm), ("--arm-env", per_env)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ABError(f"{what} names arms that are not run: {', '.join(unknown)}.")
        own = sorted(n for n in given if split_variant(n)[1] == AGAIN)
        if own:
            raise ABError(
                f"{what} {', '.join(own)}: an +again arm is a second server of its arm, with that arm's "
                "flags and environment; name another variant (ARM+name) for a different setting."
            )
    # DDTree variables in this environment reach every server: show them in the report.
    inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_DDTREE_")}
    arms = []
    for name, kind, budget in parse_arm_names(opts.arms):
        if kind != "plain" and not drafter:
            raise ABError(
                f"arm {name!r} needs a drafter: pass --drafter (a DFlash drafter folder or hub id)."
            )
        base, variant = split_variant(name)
        spec, description = _arm_spec(opts, kind, budget, drafter, cpu)
        if variant == AGAIN:
            description += "; a second server of the same arm (the run's A/A)"
        elif variant == PHASES:
            if kind == "plain" or (kind == "dflash" and not cpu):
                raise ABError(
                    f"--arms: {name!r}: the phase timer is DDTREE's (ddtree, chain, or dflash on a CPU)."
                )
            description += (
                f"; the DDTREE worker logs its host time per round phase ({ENV_PHASE_TIMES}; the timer "
                f"costs host time: compare with {base})"
            )
        elif variant == HEAPQ:
            if kind not in ("ddtree", "chain"):
                raise ABError(f"--arms: {name!r}: the heapq tree builder is DDTREE's (ddtree or chain arms).")
            description += (
                "; its tree built by Python's heapq on the host, as SGLang's own DDTree builds it "
                f"({ENV_TREE_BACKEND}=python)"
            )
        elif variant is not None:
            description += f"; variant {variant} (its own flags and environment below)"
        args = [*common, *spec, *per_arm.get(base, [])]
        env: dict[str, str] = {**inherited, **per_env.get(base, {})}
        if variant == PHASES:
            env[ENV_PHASE_TIMES] = str(PHASE_INTERVAL)
        elif variant == HEAPQ:
            env[ENV_TREE_BACKEND] = "python"
        if variant is not None:
            args += per_arm.get(name, [])
            env.update(per_env.get(name, {}))
        if cpu and not has_flag(args, "--decode-log-interval"):
            # SGLang adds up its accept-length statistics every N decode steps (default 40), with
            # a log line: short CPU passes get every step counted. A GPU server keeps SGLang's
            # default, as a service runs it (a log line per step would cost every arm host time).
            args += ["--decode-log-interval", "1"]
        if cpu:
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        arms.append(
            Arm(
                name=name,
                kind=kind,
                description=description,
                server_args=["--model-path", model, *args],
                env=env,
                base=base,
                variant=variant,
            )
        )
    return arms


def _arm_spec(
    opts, kind: str, budget: int | str | None, drafter: str | None, cpu: bool
) -> tuple[list[str], str]:
    """The speculative flags of one arm, and a sentence saying what it serves."""
    if kind == "ddtree" and isinstance(budget, str):  # the online budget: a width per step
        largest = int(budget.removeprefix("auto") or opts.budget)
        spec = ddtree_flags(drafter, f"auto{largest}")
        return spec, f"DDTREE, online budget (a verify width per step, trees of up to {largest} nodes)"
    if kind == "ddtree":
        budget = budget or opts.budget
        return ddtree_flags(drafter, budget), f"DDTREE, tree budget {budget}"
    if kind == "dflash" and not cpu:
        spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter]
        return spec, "stock SGLang DFLASH (the DFlash chain), same drafter"
    if kind in ("dflash", "chain"):
        block = getattr(opts, "block_size", None) or drafter_block_size(drafter)
        spec = [*ddtree_flags(drafter, block - 1), "--speculative-ddtree-max-topk", "1"]
        description = (
            f"the DFlash chain as DDTREE with --speculative-ddtree-max-topk 1 and budget {block - 1} "
            f"(block {block} - 1): one candidate per depth"
        )
        if kind == "dflash":
            description += " (stands in for stock DFLASH, which SGLang refuses on a CPU)"
        return spec, description
    return [], "no speculation"


def ddtree_flags(drafter: str, budget: int | str) -> list[str]:
    """DDTREE's server flags at a tree budget of ``budget`` nodes, or at ``"autoN"``: the online
    budget with trees of up to N nodes (its verify window: N + 1 slots)."""
    from ..adapter.server_args import AUTO_BUDGET

    flags = ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", drafter]
    if isinstance(budget, str) and budget.startswith(AUTO_BUDGET):
        largest = int(budget.removeprefix(AUTO_BUDGET))
        return flags + [
            "--speculative-ddtree-budget",
            AUTO_BUDGET,
            "--speculative-num-draft-tokens",
            str(largest + 1),
        ]
    return flags + ["--speculative-ddtree-budget", str(budget)]


def _parse_arm_args(items: list[str] | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        if not sep or not name.strip():
            raise ABError(f"--arm-args {item!r}: expected NAME='--flag value ...'.")
        out.setdefault(name.strip(), []).extend(shlex.split(rest))
    return out


def parse_arm_env(items: list[str] | None) -> dict[str, dict[str, str]]:
    """``--arm-env ARM='K=V K2=V2'`` (repeatable) -> {ARM: {K: V, K2: V2}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        pairs = shlex.split(rest)
        if not sep or not name.strip() or not pairs:
            raise ABError(f"--arm-env {item!r}: expected NAME='VAR=value ...'.")
        env = out.setdefault(name.strip(), {})
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ABError(f"--arm-env {item!r}: {pair!r} is not VAR=value.")
            env[key] = value
    return out


def chain_reference(names: list[str]) -> str | None:
    """The arm every DDTREE arm is also compared with: stock DFLASH where it runs, else the chain."""
    return next((n for n in ("dflash", "chain") if n in names), None)
