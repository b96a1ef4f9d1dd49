"""The A/B tool on the tiny CPU models: ``python -m lab.ab_tiny [A/B options]``.

Builds (or reuses) the tiny target and drafter (``lab.models.tiny``) and runs
``python -m sglang_ddtree.ab --cpu --model T --drafter D`` with the options given.
Needs ``SGLANG_USE_CPU_ENGINE=1``. A smoke run of the tool end to end, not a speed
measurement: the tiny drafter's weights are random.
"""

from __future__ import annotations

import sys

from lab.models.tiny import build_tiny_models
from sglang_ddtree.ab.cli import main as ab_main


def main(argv: list[str]) -> int:
    models = build_tiny_models()
    return ab_main(["--cpu", "--model", str(models.target), "--drafter", str(models.drafter), *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
