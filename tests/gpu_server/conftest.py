"""The GPU serving suite: real SGLang servers on a CUDA GPU (the H200, through gpu/device.sh).

Servers start in two waves, concurrently within a wave (the first wave fills the compile
caches the second reuses), and every test reads the outputs it needs from them. Results
are written to ``$GPU_RESULTS_DIR/gpu_server.json`` and each server's log to
``$GPU_RESULTS_DIR/gpu_server_logs.tar.gz``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from .arms import ARMS, NEOX_ARMS, Fleet, selected_waves, tp_size, write_neox_drafter


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch means no GPU
        return False


def pytest_collection_modifyitems(config, items):
    # The request-feature tests last: a run cut short by its time limit (gpu/jobs/suite.sh) keeps
    # the serving tests, and their records (accept lengths) do not count the feature requests.
    items.sort(key=lambda item: item.path.name == "test_gpu_features.py")
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs on the H200 through gpu/device.sh (docs/gpu.md)")
    for item in items:
        if "gpu_server" in item.keywords:
            item.add_marker(skip)


def results_dir() -> Path:
    path = Path(os.environ.get("GPU_RESULTS_DIR", "gpu_server_results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def results():
    record: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": {}}
    yield record["checks"]
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (results_dir() / "gpu_server.json").write_text(json.dumps(record, indent=1))


@pytest.fixture(scope="session")
def fleet(results):
    logs = results_dir() / "gpu_server_logs"
    logs.mkdir(exist_ok=True)
    fleet = Fleet(logs)
    waves = selected_waves()
    if set(NEOX_ARMS) & {arm for wave in waves for arm in wave}:
        write_neox_drafter()  # once, before the arms that read it start together
    try:
        for wave in waves:
            with concurrent.futures.ThreadPoolExecutor(len(wave)) as pool:
                list(pool.map(fleet.start, wave))
        results["server_restarts"] = fleet.restart_memory_races()  # alone, after every wave
        results["server_start_s"] = fleet.start_seconds
        results["tp_size"] = tp_size()
        yield fleet
    finally:
        fleet.stop_all()
        with tarfile.open(results_dir() / "gpu_server_logs.tar.gz", "w:gz") as tar:
            tar.add(logs, arcname="gpu_server_logs")
        shutil.rmtree(logs)  # the tarball is what comes back


__all__ = ["ARMS"]
