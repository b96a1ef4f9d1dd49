"""One log line per substitution, the first time it serves: the CPU-mode fallbacks and the
GPU-bundle compatibility patches run on every step, and the log must say that they ran
without repeating it thousands of times."""

from __future__ import annotations

import logging


class FirstUseLog:
    """``log(name, detail)`` writes ``"<what>: name (detail)"`` once per name, at INFO."""

    def __init__(self, logger_name: str, what: str):
        self.logger = logging.getLogger(logger_name)
        self.what = what
        self.served: set[str] = set()

    def __call__(self, name: str, detail: str) -> None:
        if name not in self.served:
            self.served.add(name)
            self.logger.info("%s: %s (%s)", self.what, name, detail)
