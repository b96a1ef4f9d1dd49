"""Server ports (``launch.free_port``): servers starting together must not be handed a port
that another one's NCCL / ZMQ sockets can take before the HTTP server binds it."""

from __future__ import annotations

import socket

from sglang_ddtree.launch import _ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < min(_ephemeral_low(), 32768) for p in ports)
    assert not any(24100 <= p < 24400 for p in ports)  # the GPU jobs' NCCL ports
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
