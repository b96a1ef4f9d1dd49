"""A bounded soak of a DDTREE server (CPU mode): a few minutes of mixed traffic -
lengths up to the context limit, stop strings, n > 1, streams aborted midway,
refused requests - from several clients at once. Afterwards the server still
answers, every finished greedy request equals the plain server's answer, and the
KV pool is back to idle (SGLang's strict idle check would kill the scheduler)."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import urllib.error
import urllib.request

import pytest
from serving import PROMPTS, ddtree_args, plain_args, run_server
from transformers import AutoTokenizer

pytestmark = [pytest.mark.server, pytest.mark.slow]

CONTEXT = 192
SOAK_SECONDS = 120
CLIENTS = 4
STRICT_IDLE = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


def _greedy_requests(tokenizer, count: int, seed: int = 7) -> list[dict]:
    """Greedy requests of mixed lengths, many ending at or near the context limit."""
    rng = random.Random(seed)
    ids = tokenizer(" ".join(PROMPTS) * 10)["input_ids"]
    requests = []
    for i in range(count):
        prompt_len = rng.choice([4, 17, 60, 120, 150, CONTEXT - 40])
        end = rng.choice([CONTEXT, CONTEXT - 1, CONTEXT - 17, prompt_len + rng.randint(1, 30)])
        params = {"max_new_tokens": max(1, min(end, CONTEXT) - prompt_len), "temperature": 0.0}
        if i % 3 == 0:
            params["ignore_eos"] = True
        if i % 4 == 1:
            params["stop"] = [tokenizer.decode(ids[i % 50 : i % 50 + 2])]
        if i % 5 == 2:
            params["n"] = 2
        requests.append({"input_ids": ids[i : i + prompt_len], "sampling_params": params})
    return requests


def _post(url: str, payload: dict, timeout: float = 600) -> tuple[int, object]:
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read().decode())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _aborted_stream(url: str, request: dict) -> None:
    """Read a couple of streamed chunks, then hang up (the server aborts the request)."""
    payload = {**request, "stream": True}
    payload["sampling_params"] = {**request["sampling_params"], "n": 1}
    req = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as response:
        for _ in range(2):
            response.readline()


def _outputs(body) -> list[list[int]]:
    items = body if isinstance(body, list) else [body]
    return [item["output_ids"] for item in items]


def _client(url: str, requests: list[dict], worker: int, deadline: float) -> dict[int, list]:
    """One client's loop until the deadline; returns finished greedy answers by request index."""
    answers = {}
    step = worker
    while time.monotonic() < deadline:
        index = step % len(requests)
        step += CLIENTS
        if step % 7 == 3:
            _aborted_stream(url, requests[index])
            continue
        if step % 11 == 5:
            status, _ = _post(url, {"text": "", "sampling_params": {"max_new_tokens": 4}})
            assert status == 400
            continue
        status, body = _post(url, requests[index])
        assert status == 200, body
        answers.setdefault(index, []).append(_outputs(body))
    return answers


def test_soak_ddtree_server_stays_exact_and_idle(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    requests = _greedy_requests(tokenizer, 24)
    limit = ["--context-length", str(CONTEXT)]
    with run_server(ddtree_args(tiny, budget=16, extra=limit), env=STRICT_IDLE, name="ddtree") as server:
        deadline = time.monotonic() + SOAK_SECONDS
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(_client, server.url, requests, w, deadline) for w in range(CLIENTS)]
            results = [f.result() for f in futures]
        time.sleep(5)  # idle: the scheduler runs its strict pool check
        status, body = _post(server.url, requests[0])
        assert status == 200 and server.process.poll() is None, body
    finished = {}
    for answers in results:
        for index, outs in answers.items():
            finished.setdefault(index, []).extend(outs)
    assert len(finished) >= 4, "the soak finished too few requests to compare"
    with run_server(plain_args(tiny, limit), name="plain") as plain:
        for index, outs in sorted(finished.items()):
            expected = _outputs(plain.generate(requests[index]))
            assert all(out == expected for out in outs), (
                f"request {index}: {requests[index]['sampling_params']}"
            )
