"""A TCP relay on loopback that a test can cut, to play a network between a router and a bridge.

    relay = CutRelay("127.0.0.1:50051"); port = await relay.start()
    await relay.refuse()      # connections closed, new ones refused (a dead host)
    relay.blackhole()         # connections stay open, nothing gets through (a silent cut)
    await relay.restore()

It runs in the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib

OPEN = "open"
REFUSE = "refuse"
BLACKHOLE = "blackhole"


class CutRelay:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.port = 0
        self.mode = OPEN
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.dropped_bytes = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode != OPEN:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if self.mode == OPEN:
                    writer.write(data)
                    await writer.drain()
                else:  # blackhole: read and drop, as a network that loses every packet
                    self.dropped_bytes += len(data)
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _close_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def refuse(self) -> None:
        """Close every connection and stop listening."""
        self.mode = REFUSE
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self._close_all()

    def blackhole(self) -> None:
        """Keep connections open but let nothing through, either way."""
        self.mode = BLACKHOLE

    async def restore(self) -> None:
        """Back to normal; connections that lived through a blackhole are closed (their byte
        streams lost data), so clients reconnect."""
        if self.mode == BLACKHOLE:
            self._close_all()
        self.mode = OPEN
        if self._server is None:
            await self.start()

    async def close(self) -> None:
        await self.refuse()
