"""Shared fixtures: the tiny models, and real SGLang servers in CPU mode."""

from __future__ import annotations

import os

import pytest

from sglang_ddtree.models.tiny import build_tiny_models


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return
    skip = pytest.mark.skip(reason="needs the CPU serving mode: SGLANG_USE_CPU_ENGINE=1 (make test sets it)")
    for item in items:
        if "server" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny():
    return build_tiny_models()
