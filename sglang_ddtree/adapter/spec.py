"""The ``DDTREE`` algorithm as SGLang's scheduler sees it.

DDTree drafts with a DFlash block drafter, so everywhere SGLang branches on the
DFlash family (KV pools sized for a block drafter, target hidden-state capture,
spec-v2 overlap relay through the FutureMap) DDTREE must take the DFlash branch.
The spec class therefore answers the DFlash predicates like
``SpeculativeAlgorithm.DFLASH`` does. What differs is the verify width: the target
verifies ``budget + 1`` tree slots while the drafter still runs one block.
"""

from __future__ import annotations

import logging

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from ..config import ALGORITHM_NAME  # noqa: F401 - re-exported: callers import it from here

logger = logging.getLogger("sglang_ddtree")


class DDTreeSpecAlgo(CustomSpecAlgo):
    # --- DFlash-family predicates (see module docstring) ---
    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        # The worker builds the per-node grammar masks after the scheduler's
        # grammar barrier (request_features.py), like the DFlash worker.
        return True

    def supports_mixed_chunk(self) -> bool:
        return False

    def has_draft_kv(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return None

    def handle_server_args(self, server_args) -> None:
        from .server_args import resolve_server_args

        resolve_server_args(server_args)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        # The drafter's TARGET_VERIFY-mode forward runs one block; the target's
        # verify runs the whole tree.
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec

            return int(get_spec().speculative_dflash_block_size)
        return int(num_draft_tokens)


def _worker_factory(server_args):
    from .worker import DDTreeWorker

    return DDTreeWorker


def _validate(server_args) -> None:
    from .server_args import validate_server_args

    validate_server_args(server_args)


def register_algorithm() -> bool:
    """Register ``DDTREE`` with SGLang once per process. Returns True if it was new."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return False
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=True,
        validate_server_args=_validate,
        spec_class=DDTreeSpecAlgo,
    )(_worker_factory)
    return True
