"""DDTREE in-process (``sglang.Engine``), and the KV pool after a burst with aborts."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.error
import urllib.request

import pytest
from serving import GREEDY, PROMPTS, ddtree_args, generate_batch, reference_server, run_server

from sglang_ddtree.launch import http_json

pytestmark = pytest.mark.server


def _engine(tiny, **spec):
    import sglang

    return sglang.Engine(
        model_path=str(tiny.target),
        device="cpu",
        attention_backend="torch_native",
        max_total_tokens=4096,
        dtype="float32",
        log_level="warning",
        **spec,
    )


def test_engine_greedy_identical_to_plain(tiny, servers):
    engine = _engine(
        tiny,
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=str(tiny.drafter),
        speculative_num_draft_tokens=17,  # budget 16 + root
        decode_log_interval=1,
    )
    try:
        batched = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]  # batch of 8
        single = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS[:3]]
        info = engine.get_server_info()
    finally:
        engine.shutdown()  # it kills every child process of this one: shared servers too
    # The shared plain server (started after the shutdown), a batch of 8.
    expected = generate_batch(reference_server(servers, tiny))
    assert batched == expected
    assert single == expected[:3]
    assert info["speculative_algorithm"] == "DDTREE" and info["speculative_num_draft_tokens"] == 17
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0


def test_no_kv_leak_after_burst_with_aborts(tiny, tmp_path):
    """SGLang's idle invariant check (strict: a leak kills the scheduler) must stay
    quiet after a burst in which half of the requests are aborted mid-decode."""
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    args = ddtree_args(tiny, budget=16, extra=["--log-level", "info", "--max-running-requests", "8"])
    with run_server(args, env=env, name="burst", tmp=tmp_path) as server:
        long = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}

        def request(i):
            payload = {"text": PROMPTS[i % len(PROMPTS)], "sampling_params": long, "rid": f"burst-{i}"}
            try:
                return server.generate(payload)["meta_info"]["finish_reason"]["type"]
            except urllib.error.HTTPError as error:
                return f"http-{error.code}"

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(request, i) for i in range(12)]
            # abort the even requests while they run or wait (repeated: a request may
            # reach the scheduler after the first abort)
            for _ in range(6):
                time.sleep(0.5)
                for i in range(0, 12, 2):
                    http_json(f"{server.url}/abort_request", {"rid": f"burst-{i}"})
            reasons = [f.result() for f in futures]
        assert reasons.count("length") >= 5, reasons
        assert any(r != "length" for r in reasons), reasons  # some aborts landed
        time.sleep(4.0)  # idle: the scheduler runs its pool invariant checks
        with urllib.request.urlopen(f"{server.url}/health_generate", timeout=60) as response:
            assert response.status == 200
        after = server.generate({"text": PROMPTS[2], "sampling_params": GREEDY})
        assert len(after["output_ids"]) == GREEDY["max_new_tokens"]
    log = (tmp_path / "burst.log").read_text()
    assert "memory leak" not in log and "double free" not in log
