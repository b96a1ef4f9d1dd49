"""Requests SGLang's scheduler cannot serve are refused with a 400 before they
reach it, on every server the plugin is loaded in (plain ones included): an empty
prompt and an out-of-vocabulary token id used to kill the scheduler."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from serving import GREEDY, reference_server, uses_reference

pytestmark = pytest.mark.server
uses_reference("test_serving_admission.py::")

BAD_REQUESTS = {
    "empty-text": ({"text": ""}, "The prompt is empty"),
    "empty-ids": ({"input_ids": []}, "empty"),  # SGLang refuses this one itself
    "out-of-vocabulary": ({"input_ids": [1, 2, 999999]}, "token id 999999, outside the model's vocabulary"),
    "negative-id": ({"input_ids": [5, -3]}, "token id -3"),
    "batch-with-empty": ({"text": ["The", ""]}, "The prompt is empty"),
}


def _post(url: str, payload: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_bad_prompts_get_a_400_and_the_server_keeps_serving(tiny, servers):
    server = reference_server(servers, tiny)
    expected = server.generate({"text": "The", "sampling_params": GREEDY})["output_ids"]
    for name, (prompt, message) in BAD_REQUESTS.items():
        status, body = _post(server.url, {**prompt, "sampling_params": GREEDY})
        assert status == 400, f"{name}: {status} {body[:500]}"
        assert message in body, f"{name}: {body[:500]}"
    assert server.generate({"text": "The", "sampling_params": GREEDY})["output_ids"] == expected
    assert server.process.poll() is None
