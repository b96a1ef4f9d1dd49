"""DDTREE's section of ``/server_info`` (key ``ddtree``): what the server resolved."""

from __future__ import annotations

from ..config import Settings, budget_cost_table, tree_backend_override
from .server_args import AUTO_BUDGET, BUDGET_FLAG


def server_info_section(verify_width: int, settings: Settings, cuda_graphs: bool = False) -> dict:
    """DDTREE's settings as ``/server_info`` shows them (key ``ddtree``). With the online
    budget: its candidate widths, whether each runs in its own verify graphs, and where its
    round costs come from (the per-step choices live in the scheduler process; its stats log
    line counts them)."""
    section = {
        "budget": int(verify_width) - 1,
        "budget_flag": BUDGET_FLAG,
        "max_topk": settings.max_topk,
        "stats_interval": settings.stats_interval,
        "tree_backend": tree_backend_override(),
    }
    if settings.online_budget:
        from ..budget import candidate_widths

        section["budget"] = AUTO_BUDGET
        section["online_budget"] = {
            "max_budget": int(verify_width) - 1,
            "widths": list(candidate_widths(int(verify_width) - 1)),
            "verify_graphs": "per width" if cuda_graphs else "none (eager)",
            "cost_table": _cost_source(cuda_graphs),
        }
    return section


def _cost_source(cuda_graphs: bool) -> str:
    if budget_cost_table() is not None:
        return "fixed"
    return "timed at start-up, refined by the rounds served" if cuda_graphs else "measured"
