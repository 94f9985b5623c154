"""The simulated engine answers without Nagle delays, as vLLM does.

vLLM serves on uvloop, which turns Nagle's algorithm off (TCP_NODELAY) on every connection.
The simulated engine serves on a plain asyncio loop, which does so only for sockets whose
proto is IPPROTO_TCP; before `bind_socket` said so, a response's body, written after its
headers, waited for the client's delayed ACK (40 ms on Linux), and vllm-router paid that on
every request in benchmark 1."""

from __future__ import annotations

import socket

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread, bind_socket


def test_listener_is_a_tcp_socket_so_accepted_connections_get_nodelay() -> None:
    with bind_socket() as sock:
        assert sock.proto == socket.IPPROTO_TCP


def test_every_accepted_connection_has_nagle_off() -> None:
    sim = SimEngineThread(EngineConfig(speed=50, num_blocks=64, max_model_len=256), None).start()
    try:
        assert sim.running is not None
        host, port = sim.running.host, sim.running.port
        with (
            socket.create_connection((host, port)) as a,
            socket.create_connection((host, port)) as b,
        ):
            for c in (a, b):
                c.sendall(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
                assert c.recv(4096).startswith(b"HTTP/1.1 200")
            conns = list(sim.running.server.server_state.connections)
            assert len(conns) == 2
            for proto in conns:
                server_side = proto.transport.get_extra_info("socket")
                assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sim.stop()
