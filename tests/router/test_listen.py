"""The router's listening socket: connections it accepts carry the configured kernel send
buffer (so a client that stops reading holds little before the write-stall timer runs)."""

from __future__ import annotations

import socket

import pytest
import uvicorn

from kvroute.router.config_load import ConfigError, config_from_dict
from kvroute.router.listen import listening_socket

FLEET = {"workers": [{"name": "w0", "url": "http://127.0.0.1:8001"}]}


def _accepted_sndbuf(send_buffer_bytes: int | None) -> int:
    """SO_SNDBUF of a connection accepted by our listener (None: uvicorn's own socket)."""
    config = uvicorn.Config(app=None, host="127.0.0.1", port=0)
    if send_buffer_bytes is None:
        listener = config.bind_socket()
    else:
        listener = listening_socket(config, send_buffer_bytes)
    try:
        listener.listen()
        with socket.create_connection(listener.getsockname()[:2], timeout=5) as client:
            accepted, _ = listener.accept()
            with accepted:
                client.sendall(b"x")
                return accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        listener.close()


def test_accepted_connections_inherit_the_send_buffer() -> None:
    # Linux doubles the value for its bookkeeping and stops autotuning it
    assert _accepted_sndbuf(16384) == 2 * 16384
    # 0 leaves whatever the kernel gives uvicorn's own socket
    assert _accepted_sndbuf(0) == _accepted_sndbuf(None)


def test_send_buffer_is_validated() -> None:
    assert config_from_dict(FLEET).edge.client_send_buffer_bytes == 256 * 1024
    cfg = config_from_dict({**FLEET, "edge": {"client_send_buffer_bytes": 0}})
    assert cfg.edge.client_send_buffer_bytes == 0
    with pytest.raises(ConfigError, match=r"edge\.client_send_buffer_bytes"):
        config_from_dict({**FLEET, "edge": {"client_send_buffer_bytes": 100}})
