"""A small TCP proxy (asyncio, in the harness's process) between one daemon and one etcd member,
so the election simulator can cut that daemon off from etcd while the rest of the cluster keeps
talking to it.

``cut()`` is a network partition, not a refused connection: bytes stop flowing both ways (each
pump holds what it read until ``heal()``), connections stay open, and new connections are
accepted but carry nothing.  What the daemon's etcd client sees is silence: its keepalives get
no answer, exactly as when a switch drops its packets.  ``heal()`` lets the held bytes through,
as TCP's retransmissions would after a short partition; a connection the client gave up on
meanwhile is closed by the client itself.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK_BYTES = 65_536


class EtcdProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self.connections = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> EtcdProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._pumps):
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            await self._open.wait()
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return  # etcd is down: the client sees its connection close
            self._writers.add(up_writer)
            pumps = [
                asyncio.ensure_future(self._pump(reader, up_writer)),
                asyncio.ensure_future(self._pump(up_reader, writer)),
            ]
            self._pumps.update(pumps)
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                self._pumps.difference_update(pumps)
                up_writer.close()
                self._writers.discard(up_writer)
        finally:
            writer.close()
            self._writers.discard(writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    return
                await self._open.wait()  # a partition holds the bytes here
                writer.write(data)
                await writer.drain()
