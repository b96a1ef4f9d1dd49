"""The A/B tool's arms and the ``/server_info`` keys every arm is compared on (shared by
``ab.py``, which runs them, and ``ab_report.py``, which reports them)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

ARM_KINDS = ("ddtree", "chain", "plain")
DEFAULT_ARMS = "ddtree,chain,plain"
TINY_MAX_TOTAL_TOKENS = 8192

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


# --------------------------------------------------------------------------- arms


@dataclass
class Arm:
    name: str
    kind: str  # ddtree | chain | plain
    description: str
    server_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Filled while the arm runs.
    port: int | None = None
    pid: int | None = None
    log: str | None = None
    start_seconds: float | None = None
    check_seconds: float | None = None
    stop_seconds: float | None = None
    readback: dict = field(default_factory=dict)
    greedy: list[list[int]] | None = None
    runs: list[dict] = field(default_factory=list)
    stopped: bool | None = None
    error: str | None = None

    def command(self) -> list[str]:
        return ["python", "-m", "sglang.launch_server", *self.server_args]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "launch_command": shlex.join(self.command()),
            "server_args": self.server_args,
            "env": self.env,
            "port": self.port,
            "pid": self.pid,
            "log": self.log,
            "start_seconds": self.start_seconds,
            "check_seconds": self.check_seconds,
            "stop_seconds": self.stop_seconds,
            "server_info_readback": self.readback,
            "greedy_output_ids": self.greedy,
            "runs": self.runs,
            "stopped": self.stopped,
            "error": self.error,
        }
