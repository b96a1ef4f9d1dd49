"""Server arms of the GPU serving suite, on the trained pair (lab/models/pairs).

float32 arms check exact greedy identity with the plain server; bf16 arms are checked
margin-aware against a plain bf16 server's own full forward (:func:`margin_violations`).
The triton attention backend is the one the GPU bundle can serve (no FA3, no FlashInfer).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from sglang_ddtree.ab.greedy_check import BF16_MARGIN
from sglang_ddtree.launch import ServerProcess, ServerStartError

PAIR = Path(__file__).resolve().parents[2] / "lab" / "models" / "pairs" / "pycode-4l"
BUDGET = 32
GRAPH_MAX_BS = 16

COMMON = [
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--max-total-tokens", "65536",
    "--mem-fraction-static", "0.05",
    "--log-level", "info",
]  # fmt: skip
GRAPHS = ["--cuda-graph-max-bs-decode", str(GRAPH_MAX_BS)]
EAGER = ["--disable-cuda-graph"]
FP32 = ["--dtype", "float32"]
BF16 = ["--dtype", "bfloat16"]


def _spec(algorithm: str) -> list[str]:
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(PAIR / "drafter")]
    return args + (["--speculative-ddtree-budget", str(BUDGET)] if algorithm == "DDTREE" else [])


DDTREE, DFLASH = _spec("DDTREE"), _spec("DFLASH")

# The pair's drafter with `rope_is_neox_style` true: its trained weights read with the other
# RoPE style propose worse, the same in every arm that serves it, and take SGLang's fused
# context-KV path (neox only) as the published Kimi drafters do. Written by write_neox_drafter
# (the suite's fleet, once, before its servers start).
NEOX_DRAFTER = Path(tempfile.gettempdir()) / "sglang-ddtree-pycode-4l-drafter-neox"
DDTREE_NEOX = [
    "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(NEOX_DRAFTER),
    "--speculative-ddtree-budget", str(BUDGET),
]  # fmt: skip


def write_neox_drafter() -> Path:
    NEOX_DRAFTER.mkdir(parents=True, exist_ok=True)
    for source in (PAIR / "drafter").iterdir():
        shutil.copy(source, NEOX_DRAFTER / source.name)
    config = json.loads((PAIR / "drafter" / "config.json").read_text())
    (NEOX_DRAFTER / "config.json").write_text(json.dumps({**config, "rope_is_neox_style": True}, indent=1))
    return NEOX_DRAFTER


PAGE16_CHUNKED = ["--page-size", "16", "--chunked-prefill-size", "64"]
# Lets a request carry a custom logit processor; a server's other requests are served as without it.
CUSTOM_LOGITS = ["--enable-custom-logit-processor"]
ONLINE_BUDGET = (
    ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(PAIR / "drafter")]
    + ["--speculative-ddtree-budget", "auto", "--speculative-num-draft-tokens", str(BUDGET + 1)]
    + ["--speculative-ddtree-stats-interval", "20"]
)

ARMS: dict[str, list[str]] = {
    "plain_fp32": FP32 + EAGER,
    # Chunked prefill changes the prefill's float32 rounding: the DDTREE arm with it is
    # compared with a plain server that chunks the same way.
    "plain_fp32_page16_chunked": FP32 + EAGER + PAGE16_CHUNKED,
    # The request features' reference (test_gpu_features.py): without overlap, SGLang 0.5.23's
    # plain server counts penalties as plain decoding does (docs/features.md); custom logit
    # processors allowed, here and on the DDTREE arm they are compared with.
    "plain_fp32_sync": FP32 + EAGER + ["--disable-overlap-schedule"] + CUSTOM_LOGITS,
    "ddtree_fp32_graphs": FP32 + GRAPHS + DDTREE + CUSTOM_LOGITS,
    "ddtree_fp32_graphs_page16_no_overlap_chunked": FP32
    + GRAPHS
    + DDTREE
    + PAGE16_CHUNKED
    + ["--disable-overlap-schedule"],
    "ddtree_fp32_eager": FP32 + EAGER + DDTREE,
    # the drafter KV append outside CUDA graphs (arm_env): the graph append must write the same
    "ddtree_fp32_graphs_eager_kv": FP32 + GRAPHS + DDTREE,
    "plain_bf16_graphs": BF16 + GRAPHS,
    "ddtree_bf16_graphs": BF16 + GRAPHS + DDTREE,
    "dflash_bf16_graphs": BF16 + GRAPHS + DFLASH,
    # the online budget: a width per step up to the suite's budget, eager and in per-width graphs
    "ddtree_fp32_eager_auto": FP32 + EAGER + ONLINE_BUDGET,
    "ddtree_fp32_graphs_auto": FP32 + GRAPHS + ONLINE_BUDGET,
    # the same with an injected cost table (WIDTH1_COST_TABLE) that makes every batched step
    # verify the root alone in width 1's graphs (no drafter replay) and bs 1 run the largest tree
    "ddtree_fp32_graphs_auto_width1": FP32 + GRAPHS + ONLINE_BUDGET,
    # the same with the roots' drafter KV appended eagerly (arm_env), not inside width 1's graphs
    "ddtree_fp32_graphs_auto_width1_eager_kv": FP32 + GRAPHS + ONLINE_BUDGET,
    # the pair's drafter read with neox-style RoPE (NEOX_DRAFTER; the published Kimi drafters'
    # style): SGLang's fused context-KV path, captured in the append's graphs, against its
    # eager append (arm_env)
    "ddtree_fp32_graphs_neox": FP32 + GRAPHS + DDTREE_NEOX,
    "ddtree_fp32_graphs_neox_eager_kv": FP32 + GRAPHS + DDTREE_NEOX,
}
ONLINE_BUDGET_ARMS = (
    "ddtree_fp32_eager_auto",
    "ddtree_fp32_graphs_auto",
    "ddtree_fp32_graphs_auto_width1",
    "ddtree_fp32_graphs_auto_width1_eager_kv",
)
NEOX_ARMS = ("ddtree_fp32_graphs_neox", "ddtree_fp32_graphs_neox_eager_kv")
# Started only when GPU_SERVER_ARMS names them (gpu/jobs/suite.sh names every arm unless told
# otherwise; gpu/jobs/online_budget.sh), not by a bare pytest run.
OPT_IN_ARMS = ONLINE_BUDGET_ARMS + NEOX_ARMS
# The first wave compiles the kernels (float32 and bf16, plain and speculative) that
# the second reuses from the cache.
WAVES = [
    ["plain_bf16_graphs", "ddtree_fp32_graphs"],
    [arm for arm in ARMS if arm not in ("plain_bf16_graphs", "ddtree_fp32_graphs")],
]


def selected_waves() -> list[list[str]]:
    """``WAVES``, restricted to ``GPU_SERVER_ARMS`` (comma list) when set: a run of part of
    the suite (``-k bf16``) starts only the servers it needs. ``GPU_SERVER_ONE_WAVE=1``
    starts them all at once (when the carried compile caches already hold the kernels)."""
    wanted = [a for a in os.environ.get("GPU_SERVER_ARMS", "").split(",") if a]
    unknown = set(wanted) - set(ARMS)
    if unknown:
        raise ValueError(f"GPU_SERVER_ARMS: unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")
    waves = [[a for a in wave if a in wanted or (not wanted and a not in OPT_IN_ARMS)] for wave in WAVES]
    if os.environ.get("GPU_SERVER_ONE_WAVE") == "1":
        waves = [[a for wave in waves for a in wave]]
    return [w for w in waves if w]


def tp_size() -> int:
    """``GPU_SERVER_TP``: every arm served with ``--tp-size`` this (default 1)."""
    value = os.environ.get("GPU_SERVER_TP", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"GPU_SERVER_TP={value!r}: expected a positive integer")
    return int(value)


# Servers that start together must not draw the same NCCL rendezvous port (SGLang picks
# one at random below the ephemeral range): each arm takes base + its index in ARMS.
NCCL_PORT_BASE = int(os.environ.get("GPU_SERVER_NCCL_PORT_BASE", "24100"))


def parallel_args(arm: str) -> list[str]:
    """Tensor-parallel flags of ``arm``: none at TP-1."""
    if tp_size() == 1:
        return []
    return ["--tp-size", str(tp_size()), "--nccl-port", str(NCCL_PORT_BASE + list(ARMS).index(arm))]


WIDTH1_EAGER_KV = "ddtree_fp32_graphs_auto_width1_eager_kv"


def arm_env(arm: str) -> dict[str, str]:
    """Above TP-1 the DDTREE arms compare every round's trees and paths across ranks
    (``SGLANG_DDTREE_CHECK_TP_TREES``): a divergence kills the server, failing its tests."""
    env = {}
    if tp_size() > 1 and "DDTREE" in ARMS[arm]:
        env["SGLANG_DDTREE_CHECK_TP_TREES"] = "1"
    if arm in ("ddtree_fp32_graphs_eager_kv", "ddtree_fp32_graphs_neox_eager_kv", WIDTH1_EAGER_KV):
        env["SGLANG_DDTREE_EAGER_DRAFT_KV"] = "1"
    if arm in ("ddtree_fp32_graphs_auto_width1", WIDTH1_EAGER_KV):
        env["SGLANG_DDTREE_BUDGET_COST_TABLE"] = str(WIDTH1_COST_TABLE)
    if arm == "ddtree_fp32_graphs_auto_width1":
        # each decoding step's hidden states (from width 1's decode graphs) against an eager
        # width-1 verify of the same roots (tests/decode_check_plugin.py)
        tests_dir = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
        plugins = (
            os.environ.get("SGLANG_DDTREE_TEST_PLUGIN", ""),
            "decode_check_plugin",
        )  # after lab.gpu_compat
        env["SGLANG_DDTREE_TEST_PLUGIN"] = ",".join(p for p in plugins if p)
    return env


# Flat at bs 1 (the largest tree expects the most: it wins); above, a round of width w costs
# 10 w^2 ms, so no tree can pay for itself and every batched step verifies the root alone.
WIDTH1_COST_TABLE = Path(__file__).parent / "width1_cost_table.json"


# Which plain server each speculative float32 arm must match token for token.
REFERENCE = {"ddtree_fp32_graphs_page16_no_overlap_chunked": "plain_fp32_page16_chunked"}


def heldout_prompts(n: int) -> list[list[int]]:
    prompts = json.loads((PAIR / "heldout_prompts.json").read_text())
    return [p["input_ids"] for p in prompts[:n]]


# SGLang 0.5.23's start-up error when the free memory fell while the weights loaded
MEMORY_RACE = "Loaded weights leave no GPU memory for the KV cache"


class Fleet:
    """The suite's servers, started once per session; a server that failed to start
    keeps its error so that only the tests needing it fail."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.servers: dict[str, ServerProcess] = {}
        self.errors: dict[str, str] = {}
        self.start_seconds: dict[str, float] = {}

    def start(self, arm: str) -> None:
        server = ServerProcess(
            ["--model-path", str(PAIR / "target"), *COMMON, *ARMS[arm], *parallel_args(arm)],
            env=arm_env(arm),
            log_path=self.log_dir / f"{arm}.log",
            start_timeout=420.0,
            name=arm,
        )
        began = time.monotonic()
        try:
            self.servers[arm] = server.start()
        except ServerStartError as error:
            self.errors[arm] = str(error)
        self.start_seconds[arm] = round(time.monotonic() - began, 1)

    def restart_memory_races(self) -> list[str]:
        """Starts again, one at a time, every server that failed because servers starting beside
        it took the memory it measured (SGLang reads the free memory before and after loading the
        weights: another server's allocation between the two reads leaves this one "no memory for
        the KV cache"); returns those arms. Any other failure stands."""
        raced = [arm for arm, error in self.errors.items() if MEMORY_RACE in error]
        for arm in raced:
            del self.errors[arm]
            self.start(arm)
        return raced

    def __getitem__(self, arm: str) -> ServerProcess:
        self._require(arm)
        if arm in self.errors:
            raise RuntimeError(f"server {arm} did not start:\n{self.errors[arm]}")
        return self.servers[arm]

    def log_text(self, arm: str) -> str:
        self._require(arm)
        return (self.log_dir / f"{arm}.log").read_text(errors="replace")

    def _require(self, arm: str) -> None:
        """A test of an arm that GPU_SERVER_ARMS left out skips (a run of part of the suite);
        one whose server was asked for and failed to start fails."""
        if arm not in self.servers and arm not in self.errors:
            pytest.skip(f"server {arm} not started (GPU_SERVER_ARMS)")

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def greedy(server: ServerProcess, prompt: list[int], max_new_tokens: int) -> list[int]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    return server.generate({"input_ids": prompt, "sampling_params": params})["output_ids"]


def greedy_batch(server: ServerProcess, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """All requests in flight at once (the scheduler batches them)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda pl: greedy(server, *pl), zip(prompts, lengths)))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# bf16 logits of the same prefix differ between a batched verify and a prefill by rounding.
# This pair's logits lie within |16|..|32|, where one bf16 step is 0.125; two independently
# rounded logits can trade places by up to two steps. A token is a violation only if the
# full forward prefers another token by more than that (the A/B tool's margin, 0.25 nats).


# Float32 logits of one prefix still differ by rounding between kernels of different shapes (a
# bs-11 decode, a width-17 verify, a prefill), and the plain server breaks such ties differently
# itself: at 27ce76a its decode emitted token 302 where its own prefill of the same prefix ranks
# token 2709 first by 5.2e-5 nats (bench_results/gpu_server_h200_27ce76a.json, tag bench-results-archive). A difference is a
# float32 tie only where the two tokens are the reference forward's top two and lie within
# FP32_TIE of each other: 260-520 float32 steps at this pair's logit scale (|16|..|32|), 250x
# below BF16_MARGIN, and far below what a wrong tree or a stale KV entry produces.
FP32_TIE = 1e-3  # nats


def is_float32_tie(top2: list[tuple[float, int]], expected: int, got: int) -> bool:
    """Whether ``expected`` (plain's token) and ``got`` (the speculative arm's) are the
    reference forward's two best tokens at that position, within ``FP32_TIE``."""
    (first_logprob, first), (second_logprob, second) = top2
    return {first, second} == {expected, got} and first_logprob - second_logprob <= FP32_TIE


def top2_logprobs(reference: ServerProcess, prompt: list[int], output: list[int]):
    """``reference``'s full forward of ``prompt + output``: for every output token, its
    log-prob and the two best ``(log-prob, token)`` at its position."""
    response = reference.generate(
        {
            "input_ids": prompt + output,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": 2,
        }
    )
    meta = response["meta_info"]
    chosen = meta["input_token_logprobs"][-len(output) :]
    tops = meta["input_top_logprobs"][-len(output) :]
    rows = []
    for i, ((logprob, token, *_), top) in enumerate(zip(chosen, tops)):
        if token != output[i]:
            raise AssertionError(f"logprob rows misaligned at output token {i}: {token} != {output[i]}")
        rows.append((logprob, [(t[0], t[1]) for t in top[:2]]))
    return rows


def margin_violations(reference: ServerProcess, prompt: list[int], output: list[int]) -> dict:
    """Check every emitted token against ``reference``'s full forward of its prefix: the
    token must be the argmax wherever the argmax leads by more than ``BF16_MARGIN``."""
    violations, near_ties = [], []
    for i, (logprob, top) in enumerate(top2_logprobs(reference, prompt, output)):
        token = output[i]
        best_logprob, best_token = top[0]
        if best_token == token:
            continue
        if best_logprob - logprob > BF16_MARGIN:
            violations.append(
                {"index": i, "emitted": token, "argmax": best_token, "gap": best_logprob - logprob}
            )
        else:
            near_ties.append(round(best_logprob - logprob, 4))
    return {"violations": violations, "near_ties": near_ties}
