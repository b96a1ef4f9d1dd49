"""The split tree-attention kernel's prefix pass under each tile config, per shape.

A config's tile holds ``BLOCK_M`` query rows (heads x W) and reads the whole prefix once per
tile, so the row count decides how often the prefix is read: at 8 heads, W 8 is one tile of 64
rows, W 9 two of 64 or three of 32. ``mla_tree_attention --configs`` times each named config in
every row of its sweep beside the one ``kernels/mla_verify.config_for`` serves.
"""

from __future__ import annotations

from sglang_ddtree.kernels.mla_tree_attention import CANDIDATE_CONFIGS, SplitTreeAttention
from sglang_ddtree.kernels.mla_verify import config_for


def time_configs(problem, labels, sms: int, timer) -> dict:
    """``{"served_config": label, "prefix_ms_by_config": {label: ms}}`` for ``problem``."""
    by_config = {}
    for cfg in (c for c in CANDIDATE_CONFIGS if c.label() in labels):
        att = SplitTreeAttention(problem, cfg, sms)
        by_config[cfg.label()] = timer(lambda att=att: att._launch_partial(False, False))
    return {
        "served_config": config_for(problem.heads, problem.n_nodes).label(),
        "prefix_ms_by_config": by_config,
    }


def config_lines(rows: list[dict]) -> list[str]:
    """Markdown: per timed shape, each config's prefix pass, the served one and the fastest."""
    from lab.bench._stamp import md_table

    rows = [r for r in rows if "prefix_ms_by_config" in r]
    if not rows:
        return []
    labels = list(rows[0]["prefix_ms_by_config"])
    table = [
        [r["heads"], r["n_nodes"], r["bs"], r["prefix"], r["served_config"],
         *(r["prefix_ms_by_config"][c] for c in labels), min(labels, key=r["prefix_ms_by_config"].get)]
        for r in rows
    ]  # fmt: skip
    return [
        "## The prefix pass under each config (ms)",
        "",
        "A config's tile of `BLOCK_M` query rows (heads x W) reads the whole prefix once per tile; "
        "`served`: the config `kernels/mla_verify.config_for` picks for the shape.",
        "",
        md_table(["heads", "W", "bs", "prefix", "served", *labels, "fastest"], table),
        "",
    ]
