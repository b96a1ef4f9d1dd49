"""The A/B tool on the tiny CPU models: ``python -m lab.ab_tiny [A/B options]``.

Builds (or reuses) the tiny target and drafter (``lab.models.tiny``) and runs
``python -m sglang_ddtree.ab --cpu --model T --drafter D`` with the options given (the series
is named ``tiny_cpu_ab`` unless ``--label``/``--series`` say otherwise). Needs
``SGLANG_USE_CPU_ENGINE=1``. A run of the tool end to end, not a speed measurement: the tiny
drafter's weights are random.
"""

from __future__ import annotations

import sys

from lab.models.tiny import build_tiny_models
from sglang_ddtree.ab.cli import main as ab_main


def main(argv: list[str]) -> int:
    models = build_tiny_models()
    label = (
        []
        if any(a in ("--label", "--series") or a.startswith(("--label=", "--series=")) for a in argv)
        else ["--label", "tiny"]
    )
    args = ["--cpu", "--model", str(models.target), "--drafter", str(models.drafter), *label, *argv]
    return ab_main(args, command=["python", "-m", "lab.ab_tiny", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
