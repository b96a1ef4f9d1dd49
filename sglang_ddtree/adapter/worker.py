"""Placeholder worker: the stock DFlash V2 worker."""
import logging

from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

logger = logging.getLogger("sglang_ddtree")


class DDTreeWorker(DFlashWorkerV2):
    def __init__(self, *args, **kwargs):
        logger.warning("DDTREE is running the stock DFlash V2 worker (chain drafts).")
        super().__init__(*args, **kwargs)
