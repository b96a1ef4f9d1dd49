"""``python -m sglang_ddtree.bench.ab``: the A/B tool (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
