"""DDTREE in-process (``sglang.Engine``): greedy output identical to the plain server.

The engine runs in a child Python process, a background job (tests/background.py): its
``shutdown()`` kills every child process of the process that made it, which in the test
process would take the shared servers (and any launched ahead) with it. (The KV pool
after a burst with aborts is checked in test_serving_greedy.py, on a server the greedy
checks use too.)"""

from __future__ import annotations

import json
import sys

import pytest
from background import BACKGROUND
from serving import GREEDY, PROMPTS, generate_batch, reference_server, uses_reference

from lab.models.tiny import build_tiny_models
from sglang_ddtree.launch import ProcessGroup

pytestmark = pytest.mark.server

ENGINE_SCRIPT = """
import json, sys
import sglang

tiny, prompts, params, out = json.loads(sys.argv[1])
engine = sglang.Engine(
    model_path=tiny["target"],
    device="cpu",
    attention_backend="torch_native",
    max_total_tokens=4096,
    dtype="float32",
    log_level="warning",
    speculative_algorithm="DDTREE",
    speculative_draft_model_path=tiny["drafter"],
    speculative_num_draft_tokens=17,  # budget 16 + root
    decode_log_interval=1,
)
try:
    batched = [o["output_ids"] for o in engine.generate(prompts, params)]  # batch of 8
    single = [engine.generate(p, params)["output_ids"] for p in prompts[:3]]
    info = engine.get_server_info()
finally:
    engine.shutdown()
with open(out, "w") as f:
    json.dump({"batched": batched, "single": single, "info": info}, f, default=str)
"""


TEST = "test_engine_and_pool.py::test_engine_greedy_identical_to_plain"
uses_reference(TEST)


def _run_engine(job) -> dict:
    tiny = build_tiny_models()
    out, log = job.folder / "engine.json", job.folder / "engine.log"
    argument = json.dumps(
        [{"target": str(tiny.target), "drafter": str(tiny.drafter)}, PROMPTS, GREEDY, str(out)]
    )
    with log.open("w") as stdout:
        engine = job.track(ProcessGroup([sys.executable, "-c", ENGINE_SCRIPT, argument], stdout=stdout))
    try:
        assert engine.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        engine.stop()
    return json.loads(out.read_text())


BACKGROUND.declare("engine", TEST, _run_engine)


def test_engine_greedy_identical_to_plain(tiny, servers):
    result = BACKGROUND.result("engine")
    expected = generate_batch(reference_server(servers, tiny))  # a batch of 8
    assert result["batched"] == expected
    assert result["single"] == expected[:3]
    info = result["info"]
    assert info["speculative_algorithm"] == "DDTREE" and info["speculative_num_draft_tokens"] == 17
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
