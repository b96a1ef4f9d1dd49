"""Server ports (``launch.free_port``): servers starting together must not be handed a port
that another one's NCCL / ZMQ sockets can take before the HTTP server binds it."""

from __future__ import annotations

import socket

from sglang_ddtree.launch import ServerProcess, _ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    # below SGLang's own random picks (22000-29999) and the GPU jobs' fixed NCCL ports (24100+)
    assert all(1024 <= p < min(_ephemeral_low(), 22000) for p in ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_server_is_handed_its_nccl_port_unless_its_arguments_name_one():
    server = ServerProcess(["--model-path", "m"])
    nccl = int(server.args[server.args.index("--nccl-port") + 1])
    assert nccl != server.port and 1024 <= nccl < 22000
    named = ServerProcess(["--model-path", "m", "--nccl-port", "24203"])
    assert named.args.count("--nccl-port") == 1 and "24203" in named.args
    assert not any(a == "--nccl-port" for a in ServerProcess(["--nccl-port=24203"]).args)
