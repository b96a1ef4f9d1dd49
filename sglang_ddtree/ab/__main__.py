"""``python -m sglang_ddtree.ab``: the A/B tool (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
