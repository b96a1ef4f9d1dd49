"""Start-up validation and resolution of DDTREE's server arguments.

Runs in the launcher while SGLang resolves its arguments, before any model
loads, so bad configuration ends the launch with one clear message instead of a
traceback from deep inside a worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os.path

from ..config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUDGET,
    ENV_BUDGET_COST_TABLE,
    ENV_LOG_TREE_STATS,
    ENV_MAX_TOPK,
    ENV_ONLINE_BUDGET,
    ENV_TEST_PLUGIN,
    DDTreeConfig,
    DDTreeConfigError,
    Settings,
    budget_cost_table,
    cpu_engine_requested,
    max_topk_override,
    online_budget_requested,
    settings_of,
    stats_log_interval,
    test_plugin_modules,
    tree_backend_override,
)
from .attention.gpu_backends import supported_backends

logger = logging.getLogger("sglang_ddtree")

BUDGET_FLAG = "--speculative-ddtree-budget"
AUTO_BUDGET = "auto"
MAX_TOPK_FLAG = "--speculative-ddtree-max-topk"
STATS_FLAG = "--speculative-ddtree-stats-interval"
CPU_ATTENTION_BACKEND = "torch_native"


def _fail(message: str):
    raise DDTreeConfigError("DDTREE: " + message)


def add_cli_args(parser) -> None:
    """Add DDTREE's own flag to SGLang's argument parser."""
    if any(BUDGET_FLAG in action.option_strings for action in parser._actions):
        return
    parser.add_argument(
        BUDGET_FLAG,
        type=parse_budget,
        default=None,
        help=(
            "DDTREE: draft-tree nodes verified per request and round (default "
            f"{DEFAULT_BUDGET}). The verify width is budget + 1; it sets "
            "--speculative-num-draft-tokens, which must not also be given differently. "
            f"'{AUTO_BUDGET}' chooses the width every step, up to --speculative-num-draft-tokens "
            f"(default {DEFAULT_BUDGET + 1}), from the drafter's predicted acceptance and measured round "
            "costs (docs/online-budget.md; --tp-size 1; with CUDA graphs one verify graph set per width)."
        ),
    )
    _add_option_flags(parser)


def parse_budget(text: str) -> int | str:
    """A budget flag value: a whole number of tree nodes, or ``auto``."""
    value = str(text).strip().lower()
    if value == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of tree nodes or '{AUTO_BUDGET}', got {text!r}"
        ) from None


def _add_option_flags(parser) -> None:
    parser.add_argument(
        MAX_TOPK_FLAG,
        type=int,
        default=None,
        help=(
            "DDTREE: at most this many candidates per tree depth (default: the budget). "
            "1 spends the budget on the drafter's top-1 spine: the DFlash chain, for A/B runs."
        ),
    )
    parser.add_argument(
        STATS_FLAG,
        type=int,
        default=None,
        help="DDTREE: log accept length, tree size and the non-argmax share every N rounds (0: never).",
    )


def apply_option_flags(args) -> None:
    """Validate the option flags (a debugging variable set by hand to another value is an
    error); :func:`settings_from_flags` makes them the server's settings."""
    from_environment = Settings.from_environment()
    for flag, attr, env, lowest, given in (
        (MAX_TOPK_FLAG, "speculative_ddtree_max_topk", ENV_MAX_TOPK, 1, from_environment.max_topk),
        (
            STATS_FLAG,
            "speculative_ddtree_stats_interval",
            ENV_LOG_TREE_STATS,
            0,
            from_environment.stats_interval,
        ),
    ):
        value = getattr(args, attr, None)
        if value is None:
            continue
        if value < lowest:
            _fail(f"{flag} must be >= {lowest}, got {value}.")
        if given and given != value:
            _fail(f"{flag} {value} contradicts {env}={given}; pass only the flag.")


def settings_from_flags(args) -> Settings:
    """The server's settings from its parsed command line: each flag given, else the
    debugging variable, else the default. Handed to every process on the ServerArgs
    (plugin.py), read back with ``config.settings_of``."""
    from_environment = Settings.from_environment()
    max_topk = getattr(args, "speculative_ddtree_max_topk", None)
    stats = getattr(args, "speculative_ddtree_stats_interval", None)
    return Settings(
        online_budget=getattr(args, "speculative_ddtree_budget", None) == AUTO_BUDGET
        or from_environment.online_budget,
        max_topk=from_environment.max_topk if max_topk is None else max_topk,
        stats_interval=from_environment.stats_interval if stats is None else stats,
    )


def check_cli_namespace(args) -> None:
    """Checks that must run on the parsed command line, before SGLang's argument
    resolution imports anything that needs a GPU or reads the drafter."""
    apply_budget_flag(args)
    apply_option_flags(args)
    if str(getattr(args, "speculative_algorithm", None) or "").upper() != "DDTREE":
        return
    _default_cpu_attention_backend(args)
    _check_device(args)
    _check_environment(args)
    read_drafter_config(getattr(args, "speculative_draft_model_path", None))


def apply_budget_flag(args) -> None:
    """Fold ``--speculative-ddtree-budget`` into ``speculative_num_draft_tokens``
    (a ServerArgs field, so it reaches every scheduler process)."""
    budget = getattr(args, "speculative_ddtree_budget", None)
    if budget is None:
        return
    if budget == AUTO_BUDGET:
        apply_online_budget(args)
        return
    if online_budget_requested():
        _fail(f"{BUDGET_FLAG} {budget} contradicts {ENV_ONLINE_BUDGET}=1; pass only the flag.")
    if budget < 1:
        _fail(f"{BUDGET_FLAG} must be >= 1, got {budget}.")
    width = getattr(args, "speculative_num_draft_tokens", None)
    if width is not None and int(width) != budget + 1:
        _fail(
            f"{BUDGET_FLAG} {budget} implies --speculative-num-draft-tokens {budget + 1} "
            f"(budget + root), but {width} was given. Pass only one of them."
        )
    args.speculative_num_draft_tokens = budget + 1


def apply_online_budget(args) -> None:
    """``--speculative-ddtree-budget auto``: the largest tree stays the server's verify width
    (``--speculative-num-draft-tokens``, default budget + 1); each step runs a width up to it
    (``adapter/widths.py``; under CUDA graphs in that width's own verify graphs,
    ``adapter/width_graphs.py``)."""
    cpu = str(getattr(args, "device", None) or "") == "cpu"
    if not cpu and not getattr(args, "disable_cuda_graph", False):
        _refuse_graph_swaps(args)
    if int(getattr(args, "tp_size", 1) or 1) > 1:
        _fail(
            f"{BUDGET_FLAG} {AUTO_BUDGET} needs --tp-size 1: the ranks would time their rounds apart "
            "and could choose different widths."
        )
    width = int(getattr(args, "speculative_num_draft_tokens", None) or DEFAULT_BUDGET + 1)
    if width < 2:
        _fail(f"{BUDGET_FLAG} {AUTO_BUDGET} needs --speculative-num-draft-tokens >= 2, got {width}.")
    args.speculative_num_draft_tokens = width
    _check_cost_table(width - 1)


# What cannot run with a target attention backend and verify graph runner swapped per step:
# the reasons SGLang 0.5.23 gives for EAGLE's --speculative-adaptive, which swaps them the same
# way (speculative/adaptive_spec_params.py: adaptive_unsupported_reason).
GRAPH_SWAP_CONFLICTS = (
    ("enable_two_batch_overlap", "--enable-two-batch-overlap", "the swap would drop the TBO wrapper"),
    ("enable_pdmux", "--enable-pdmux", "the swap does not update the PD-multiplexing backend group"),
    ("enable_dp_attention", "--enable-dp-attention", "the width would not be synchronised across DP ranks"),
)


def _refuse_graph_swaps(args) -> None:
    for attr, flag, why in GRAPH_SWAP_CONFLICTS:
        if getattr(args, attr, False):
            _fail(f"{BUDGET_FLAG} {AUTO_BUDGET} with CUDA graphs does not run with {flag}: {why}.")
    if int(getattr(args, "attn_dp_size", None) or 1) > 1:
        _fail(
            f"{BUDGET_FLAG} {AUTO_BUDGET} with CUDA graphs does not run with --attn-dp-size > 1: "
            "the width would not be synchronised across DP ranks."
        )


def _check_cost_table(max_budget: int) -> None:
    from ..budget import candidate_widths

    table = budget_cost_table()
    widths = list(candidate_widths(max_budget))
    if table is not None and list(table["widths"]) != widths:
        _fail(
            f"{ENV_BUDGET_COST_TABLE}: the table's widths {table['widths']} must be the candidates {widths}."
        )


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _vocab_size(config: dict) -> int | None:
    text = config.get("text_config") or config
    value = text.get("vocab_size", config.get("vocab_size"))
    return int(value) if value is not None else None


def read_drafter_config(draft_path: str | None) -> dict:
    if not draft_path:
        _fail("--speculative-draft-model-path is required (a DFlash drafter checkpoint folder).")
    config_path = os.path.join(draft_path, "config.json")
    if not os.path.isdir(draft_path):
        _fail(f"draft model path {draft_path!r} does not exist or is not a folder.")
    if not os.path.isfile(config_path):
        _fail(f"draft model folder {draft_path!r} has no config.json.")
    config = _load_json(config_path)
    architectures = config.get("architectures") or []
    if not any("DFlash" in arch for arch in architectures) and "dflash_config" not in config:
        _fail(
            f"the drafter at {draft_path!r} is not a DFlash model (architectures={architectures}); "
            "DDTREE needs a DFlash block drafter (e.g. architectures ['DFlashDraftModel'])."
        )
    return config


def drafter_block_size(config: dict) -> int:
    dflash = config.get("dflash_config") or {}
    value = dflash.get("block_size", config.get("block_size"))
    return int(value) if value is not None else DEFAULT_BLOCK_SIZE


def _check_vocab_match(target_path: str | None, draft_config: dict) -> None:
    if not target_path or not os.path.isfile(os.path.join(target_path, "config.json")):
        return  # a hub id or remote path: SGLang itself resolves it later
    target_vocab = _vocab_size(_load_json(os.path.join(target_path, "config.json")))
    draft_vocab = _vocab_size(draft_config)
    if target_vocab and draft_vocab and target_vocab != draft_vocab:
        _fail(
            f"the drafter's vocabulary ({draft_vocab}) does not match the target's ({target_vocab}); "
            "a DFlash drafter projects through the target's LM head and must share its tokenizer."
        )


def _check_device(cfg) -> None:
    device = str(getattr(cfg, "device", None) or "")
    if device != "cpu":
        return
    if not cpu_engine_requested():
        _fail(
            "--device cpu needs the CPU serving mode: set SGLANG_USE_CPU_ENGINE=1 "
            "(and install its start-up hook once: python -m sglang_ddtree.cpu install-hook)."
        )
    from ..cpu.hook import hook_path

    if not hook_path().exists():
        _fail(
            f"the CPU serving mode's start-up hook is not installed ({hook_path()}); "
            "SGLang's scheduler processes would fail to import sgl_kernel. "
            "Run: python -m sglang_ddtree.cpu install-hook"
        )
    _check_cpu_attention_backends(cfg)


CPU_BACKEND_FLAGS = (
    "attention_backend",
    "decode_attention_backend",
    "prefill_attention_backend",
    "speculative_draft_attention_backend",
)


def _default_cpu_attention_backend(args) -> None:
    """With --device cpu SGLang would pick intel_amx, which the CPU serving mode
    cannot run; DDTREE's CPU path is torch_native."""
    if str(getattr(args, "device", None) or "") == "cpu" and getattr(args, "attention_backend", None) is None:
        args.attention_backend = CPU_ATTENTION_BACKEND


def _check_cpu_attention_backends(cfg) -> None:
    """The CPU serving mode runs attention through torch only: any other backend
    would load both models and then fail in its first GPU kernel."""
    for name in CPU_BACKEND_FLAGS:
        backend = getattr(cfg, name, None)
        if backend is not None and backend != CPU_ATTENTION_BACKEND:
            _fail(
                f"--{name.replace('_', '-')} {backend} does not run with --device cpu; "
                f"the CPU serving mode needs {CPU_ATTENTION_BACKEND}."
            )


def _check_environment(cfg) -> None:
    """The debugging/test variables DDTREE reads, checked before any model loads."""
    try:
        backend = tree_backend_override()
        max_topk_override()
        stats_log_interval()
    except (DDTreeConfigError, ValueError) as error:
        _fail(str(error))
    if backend == "cuda" and str(getattr(cfg, "device", None) or "") == "cpu":
        _fail("SGLANG_DDTREE_TREE_BACKEND=cuda needs a GPU; with --device cpu use auto, cpp or python.")
    import importlib.util

    for plugin in test_plugin_modules():
        if importlib.util.find_spec(plugin) is None:
            _fail(f"{ENV_TEST_PLUGIN}: {plugin!r}: no such module on the Python path.")


def target_uses_mla(model_path: str | None) -> bool:
    """Whether a local target checkpoint is DeepSeek-style MLA (Kimi K2.x, DeepSeek V3)."""
    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        return False
    config = _load_json(os.path.join(model_path, "config.json"))
    text = config.get("text_config") or config
    return text.get("kv_lora_rank") is not None


def _check_attention_backend(cfg) -> None:
    is_mla = target_uses_mla(getattr(cfg, "model_path", None))
    allowed = supported_backends(is_mla)
    for name in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        backend = getattr(cfg, name, None)
        if backend is not None and backend not in allowed:
            kind = "MLA" if is_mla else "this"
            _fail(
                f"--{name.replace('_', '-')} {backend} has no tree-masked verify path for {kind} "
                f"target in DDTREE. Supported: {', '.join(allowed)} (docs/backends.md)."
            )


def _check_unsupported_features(cfg) -> None:
    if int(getattr(cfg, "pp_size", 1) or 1) != 1:
        _fail("pipeline parallelism (--pp-size > 1) is not supported.")
    if getattr(cfg, "speculative_draft_window_size", None) is not None:
        _fail("--speculative-draft-window-size (compact draft cache) is not supported yet.")
    if getattr(cfg, "speculative_adaptive", False):
        _fail("--speculative-adaptive is not supported; the tree budget is fixed per server.")
    if getattr(cfg, "disaggregation_mode", "null") not in (None, "null"):
        _fail("prefill/decode disaggregation is not supported.")


def resolve_config(cfg) -> DDTreeConfig:
    """The DDTree configuration these arguments describe (validated)."""
    draft_config = read_drafter_config(cfg.speculative_draft_model_path)
    block = cfg.speculative_dflash_block_size or drafter_block_size(draft_config)
    width = cfg.speculative_num_draft_tokens or DEFAULT_BUDGET + 1
    config = DDTreeConfig.from_spec_fields(width, block, settings_of(cfg).max_topk)
    try:
        config.validate()
    except DDTreeConfigError as error:
        _fail(str(error))
    return config


def validate_server_args(cfg) -> None:
    """SGLang's ``validate_server_args`` hook: reject bad configuration early."""
    _check_device(cfg)
    _check_environment(cfg)
    _check_attention_backend(cfg)
    _check_unsupported_features(cfg)
    draft_config = read_drafter_config(cfg.speculative_draft_model_path)
    _check_vocab_match(cfg.model_path, draft_config)
    resolve_config(cfg)


def _is_hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def serves_cuda_graphs(cfg) -> bool:
    """Whether the target's decode (verify) steps run in CUDA graphs."""
    if str(getattr(cfg, "device", None) or "") == "cpu" or getattr(cfg, "disable_cuda_graph", False):
        return False
    return str(getattr(cfg, "cuda_graph_backend_decode", None) or "").lower() != "disabled"


def resolve_server_args(cfg) -> None:
    """SGLang's ``handle_server_args`` hook: set what DFLASH's handler would set,
    with DDTREE's verify width. ``cfg`` records the writes."""
    config = resolve_config(cfg)
    cfg.speculative_num_steps = 1
    cfg.speculative_eagle_topk = 1
    cfg.speculative_num_draft_tokens = config.verify_width
    cfg.speculative_dflash_block_size = config.block_size
    if cfg.attention_backend is None and str(cfg.device) != "cpu":
        # SGLang's automatic choice may be a backend without a tree-masked verify
        # path (e.g. FlashInfer MLA); pick one that has it.
        cfg.attention_backend = "fa3" if _is_hopper() else "triton"
        logger.info(
            "DDTREE: --attention-backend not given; using %s (tree-masked verify)", cfg.attention_backend
        )
    if cfg.speculative_draft_attention_backend is None:
        decode = cfg.decode_attention_backend or cfg.attention_backend
        if decode is None:
            decode = CPU_ATTENTION_BACKEND if str(cfg.device) == "cpu" else "triton"
        cfg.speculative_draft_attention_backend = decode
    if cfg.max_running_requests is None:
        cfg.max_running_requests = 48
    logger.info(
        "DDTREE: budget=%d nodes, verify width=%d, drafter block=%d, draft attention=%s",
        config.budget,
        config.verify_width,
        config.block_size,
        cfg.speculative_draft_attention_backend,
    )
