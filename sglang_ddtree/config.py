"""The one configuration object of the plugin, and the one place that reads
environment variables.

Configuration flows one way: server arguments (validated at start-up, before
any model loads) -> :class:`DDTreeConfig` -> worker.

How DDTree maps onto SGLang's speculative fields:

* ``speculative_num_draft_tokens`` is the **verify width**: ``budget + 1`` tokens
  per request (the root plus ``budget`` tree nodes). SGLang sizes KV reservations
  and captures verify CUDA graphs from it, so it must be the tree's width.
* ``speculative_dflash_block_size`` is the drafter's block size (the draft
  forward still runs ``block_size`` tokens: the root and ``block_size - 1`` masks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ALGORITHM_NAME = "DDTREE"  # --speculative-algorithm
DEFAULT_BUDGET = 32
MAX_BUDGET = 1024
DEFAULT_BLOCK_SIZE = 16

ENV_CPU_ENGINE = "SGLANG_USE_CPU_ENGINE"
ENV_TREE_BACKEND = "SGLANG_DDTREE_TREE_BACKEND"  # auto | cuda | cpp | python
ENV_TEST_PLUGIN = (
    "SGLANG_DDTREE_TEST_PLUGIN"  # tests and the lab: modules whose install() runs at registration
)
ENV_LOG_TREE_STATS = "SGLANG_DDTREE_LOG_STATS_EVERY"  # steps between stats log lines
ENV_MAX_TOPK = "SGLANG_DDTREE_MAX_TOPK"  # siblings per depth (1 = the DFlash chain)
ENV_PHASE_TIMES = "SGLANG_DDTREE_PHASE_TIMES"  # debugging: rounds between host phase-time log lines
ENV_EAGER_TREE_STEP = "SGLANG_DDTREE_EAGER_TREE_STEP"  # debugging: keep the tree step out of the draft graph
ENV_EAGER_DRAFT_KV = "SGLANG_DDTREE_EAGER_DRAFT_KV"  # debugging: the drafter KV append outside CUDA graphs
ENV_CHECK_TP_TREES = "SGLANG_DDTREE_CHECK_TP_TREES"  # debugging: every round, ranks compare trees and paths
ENV_CACHE_DIR = "SGLANG_DDTREE_CACHE_DIR"  # root of every cache: ext/, tiny-models/, pair-data/
ENV_ONLINE_BUDGET = "SGLANG_DDTREE_ONLINE_BUDGET"  # tests/debugging: auto where no flag was parsed
# benchmarks/debugging: steps between the online budget's own log lines (its widths per cell)
ENV_ONLINE_BUDGET_LOG_EVERY = "SGLANG_DDTREE_ONLINE_BUDGET_LOG_EVERY"
ENV_VERIFY_ATTENTION = (
    "SGLANG_DDTREE_VERIFY_ATTENTION"  # debugging: "sglang" keeps SGLang's MLA verify kernel
)
ENV_BUDGET_COST_TABLE = "SGLANG_DDTREE_BUDGET_COST_TABLE"  # tests/debugging: a fixed T(bs, width) JSON file
# benchmarks/debugging: the online budget does all its work every step, then runs the widest tree
ENV_ONLINE_BUDGET_PIN_WIDEST = "SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST"
# tests/debugging: "0" keeps the online budget's width-1 steps inside the speculative frame
ENV_PLAIN_STEPS = "SGLANG_DDTREE_PLAIN_STEPS"
# benchmarks/debugging: the longest run of width-1 steps without a draft; "0": no width-1 step
# drafts once a prediction is made (what a width-1 step itself costs, apart from its refreshes)
ENV_ONLINE_BUDGET_REFRESH_EVERY = "SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY"


class DDTreeConfigError(ValueError):
    """A configuration problem found at start-up, with a message for the user."""


def cache_root() -> Path:
    """The one cache folder (compiled C++ builder, tiny models, pair data): ``$SGLANG_DDTREE_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/sglang-ddtree`` (``~/.cache/sglang-ddtree``)."""
    root = os.environ.get(ENV_CACHE_DIR, "").strip()
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "sglang-ddtree"


def compiler_override() -> str | None:
    """The C++ compiler the build's convention names (``$CXX``) for the C++ tree builder."""
    return os.environ.get("CXX") or None


def cpu_engine_requested() -> bool:
    return os.environ.get(ENV_CPU_ENGINE, "").strip().lower() in ("1", "true", "yes", "on")


def tp_tree_check_requested() -> bool:
    """Whether every round compares its trees and accepted paths across the TP ranks
    (a collective and a host read per round: for debugging and the TP serving job)."""
    return os.environ.get(ENV_CHECK_TP_TREES, "").strip().lower() in ("1", "true", "yes", "on")


def tree_backend_override() -> str:
    value = os.environ.get(ENV_TREE_BACKEND, "auto").strip().lower()
    if value not in ("auto", "cuda", "cpp", "python"):
        raise DDTreeConfigError(f"{ENV_TREE_BACKEND}={value!r}: expected auto, cuda, cpp or python")
    return value


def serving_ddtree(spec_algorithm) -> bool:
    """Whether SGLang's speculative algorithm (by name) is this plugin's."""
    return getattr(spec_algorithm, "name", None) == ALGORITHM_NAME


def sglang_verify_attention_requested() -> bool:
    """Keep SGLang's own attention kernels where the plugin routes around them (debugging): the
    MLA target's verify (the split tree kernel) and the drafter's block (the split-KV decode)."""
    value = os.environ.get(ENV_VERIFY_ATTENTION, "split").strip().lower()
    if value not in ("split", "sglang"):
        raise DDTreeConfigError(f"{ENV_VERIFY_ATTENTION}={value!r}: expected split or sglang")
    return value == "sglang"


def test_plugin_modules() -> list[str]:
    """Modules of the tests and the lab (a comma list) that the plugin's ``register`` imports
    and installs: the tests' scripted drafter, the lab's replay drafter, the GPU bundle's
    compatibility hooks. Never set in a normal launch."""
    return [name.strip() for name in os.environ.get(ENV_TEST_PLUGIN, "").split(",") if name.strip()]


def max_topk_override() -> int | None:
    value = os.environ.get(ENV_MAX_TOPK, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DDTreeConfigError(f"{ENV_MAX_TOPK}={value!r}: expected a positive integer")
    return int(value)


def _env_count(name: str) -> int | None:
    """A non-negative integer from the environment; None where unset or empty."""
    value = os.environ.get(name, "").strip()
    if value and not value.isdigit():
        raise DDTreeConfigError(f"{name}={value!r}: expected a non-negative integer")
    return int(value) if value else None


def stats_log_interval() -> int:
    return _env_count(ENV_LOG_TREE_STATS) or 0


def eager_tree_step_requested() -> bool:
    return os.environ.get(ENV_EAGER_TREE_STEP, "").strip().lower() in ("1", "true", "yes", "on")


def online_budget_pinned() -> bool:
    """Whether the online budget runs the widest tree whatever it chose (what its own work costs
    beside a fixed budget of that width, apart from what its choices cost)."""
    return os.environ.get(ENV_ONLINE_BUDGET_PIN_WIDEST, "").strip().lower() in ("1", "true", "yes", "on")


def online_budget_refresh_every(default: int) -> int:
    """The longest run of width-1 steps without a draft (``adapter/refresh.py``): ``default``
    unless ``$SGLANG_DDTREE_ONLINE_BUDGET_REFRESH_EVERY`` names another; 0: none drafts."""
    count = _env_count(ENV_ONLINE_BUDGET_REFRESH_EVERY)
    return default if count is None else count


def eager_draft_kv_requested() -> bool:
    return os.environ.get(ENV_EAGER_DRAFT_KV, "").strip().lower() in ("1", "true", "yes", "on")


def plain_steps_enabled() -> bool:
    """Whether the online budget's width-1 steps may run as SGLang's own decode steps
    (``adapter/plain_steps.py``; on unless the environment turns them off)."""
    return os.environ.get(ENV_PLAIN_STEPS, "1").strip().lower() not in ("0", "false", "no", "off")


def phase_times_interval() -> int:
    """Rounds between log lines of the round's host time per phase (0 = not measured)."""
    return _env_count(ENV_PHASE_TIMES) or 0


def online_budget_log_every(default: int) -> int:
    """Steps between the online budget's own log lines (``default`` unless the environment
    asks for another interval; 0 = none)."""
    count = _env_count(ENV_ONLINE_BUDGET_LOG_EVERY)
    return default if count is None else count


def online_budget_requested() -> bool:
    """Whether the environment asks for the online budget (tests, ``sglang.Engine``)."""
    return os.environ.get(ENV_ONLINE_BUDGET, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """What the user chose with the ``--speculative-ddtree-*`` flags, parsed and validated
    once in the launcher (``adapter/server_args.py``) and carried to every scheduler process
    on SGLang's server arguments (:func:`settings_of`). Where no flag was parsed (an
    ``sglang.Engine(...)`` built in code) the debugging variables stand in."""

    online_budget: bool = False  # --speculative-ddtree-budget auto
    max_topk: int | None = None  # --speculative-ddtree-max-topk
    stats_interval: int = 0  # --speculative-ddtree-stats-interval

    @classmethod
    def from_environment(cls) -> Settings:
        return cls(online_budget_requested(), max_topk_override(), stats_log_interval())


# Where the launcher leaves the settings on SGLang's ServerArgs: an underscore attribute is
# the record's bookkeeping, which pickling hands to the scheduler processes with it.
SETTINGS_ATTR = "_ddtree_settings"


def settings_of(server_args) -> Settings:
    """The settings a launch carries (:class:`Settings`), else the environment's."""
    settings = getattr(server_args, SETTINGS_ATTR, None)
    return settings if isinstance(settings, Settings) else Settings.from_environment()


def budget_cost_table() -> dict | None:
    """A fixed round-cost table for the online budget (tests and debugging), instead of the
    one measured while serving: ``{"batch_sizes": [...], "widths": [...], "ms": [[...]]}`` in
    the JSON file ``$SGLANG_DDTREE_BUDGET_COST_TABLE``, one row per batch size."""
    path = os.environ.get(ENV_BUDGET_COST_TABLE, "").strip()
    if not path:
        return None
    try:
        table = json.loads(Path(path).read_text())
        batch_sizes, widths, ms = table["batch_sizes"], table["widths"], table["ms"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DDTreeConfigError(f"{ENV_BUDGET_COST_TABLE}={path!r}: not a cost table ({error})") from None
    if len(ms) != len(batch_sizes) or any(len(row) != len(widths) for row in ms):
        raise DDTreeConfigError(f"{ENV_BUDGET_COST_TABLE}={path!r}: ms must be [batch sizes][widths]")
    return {"batch_sizes": batch_sizes, "widths": widths, "ms": ms}


@dataclass(frozen=True)
class DDTreeConfig:
    budget: int  # tree nodes per request, root excluded
    block_size: int  # drafter block: root + block_size - 1 masked positions
    max_topk: int | None = None  # candidates per depth; None = budget (the paper's choice)

    @property
    def depth(self) -> int:
        """Deepest tree level: one per masked draft position."""
        return self.block_size - 1

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    def topk(self, vocab: int) -> int:
        """Candidates kept per depth: ``min(budget, vocab)``, capped by ``max_topk``."""
        from .tree.round import draft_k

        return draft_k(self.budget, vocab, self.max_topk)

    @classmethod
    def from_spec_fields(
        cls, num_draft_tokens: int, block_size: int, max_topk: int | None = None
    ) -> DDTreeConfig:
        return cls(budget=int(num_draft_tokens) - 1, block_size=int(block_size), max_topk=max_topk)

    def validate(self) -> None:
        if self.block_size < 2:
            raise DDTreeConfigError(f"DDTREE needs a drafter block size >= 2, got {self.block_size}.")
        if self.budget < 1:
            raise DDTreeConfigError(f"--speculative-ddtree-budget must be >= 1, got {self.budget}.")
        if self.budget > MAX_BUDGET:
            raise DDTreeConfigError(
                f"--speculative-ddtree-budget {self.budget} exceeds the largest supported "
                f"verify tree ({MAX_BUDGET} nodes)."
            )
        if self.budget < self.depth:
            raise DDTreeConfigError(
                f"--speculative-ddtree-budget {self.budget} is smaller than the drafter's depth "
                f"({self.depth} = block size {self.block_size} - 1): every round verifies at "
                f"least a full block, so use a budget >= {self.depth} (equal to it is the chain)."
            )
