"""A/B against stock SGLang (``python -m sglang_ddtree.ab``; docs/ab.md).

``arms`` says what each arm serves, ``run`` runs one arm (server, greedy check, load),
``report`` analyses the runs (``greedy_check``: the greedy side-check) and ``render`` writes them out; ``cli`` ties them together.
``phase_log`` reads an ``ARM+phases`` server's phase times from its log, ``profiling`` takes and
summarises ``--profile ARM@C``'s torch profiles.
"""
