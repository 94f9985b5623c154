"""Running uvicorn on a listening socket the router prepares itself.

The one thing uvicorn does not set is each client connection's kernel send buffer. Linux
grows it on demand (up to several MiB), so a client that stops reading a stream would first
absorb that much of the answer before a send waits and `edge.write_stall_s` starts counting,
and every such client would pin that much kernel memory. Accepted connections inherit
SO_SNDBUF from the listening socket, so setting it there caps both.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn
from uvicorn.supervisors import Multiprocess

# what uvicorn.run's caller sees when the server never started (uvicorn uses 3 as well)
STARTUP_FAILURE = 3


def listening_socket(config: uvicorn.Config, send_buffer_bytes: int) -> socket.socket:
    """uvicorn's listening socket for `config`; with `send_buffer_bytes` > 0 every connection
    it accepts has a kernel send buffer of that size (Linux doubles it for bookkeeping)."""
    sock = config.bind_socket()
    if send_buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    return sock


def run(app: Any, options: dict[str, Any], processes: int, send_buffer_bytes: int) -> int:
    """Serve `app` (an ASGI app, or an import string of a factory when `processes` > 1) with
    uvicorn `options` until stopped; the exit status: 0, or STARTUP_FAILURE."""
    config = uvicorn.Config(app, workers=processes, factory=processes > 1, **options)
    sock = listening_socket(config, send_buffer_bytes)
    try:
        if processes > 1:
            Multiprocess(config, sockets=[sock]).run()
            return 0
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()
    return 0 if server.started else STARTUP_FAILURE
