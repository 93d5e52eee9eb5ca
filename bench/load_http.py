"""The load generator's HTTP clients (bench/load.py): a minimal keep-alive HTTP/1.1 client on asyncio streams
and the same interface over httpx, and the errors a request may end in."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams, for load generation only (the server
    under test is what is measured): one small pool per simulated client, Content-Length and chunked
    bodies. Several times cheaper in CPU than httpx, which matters when the generator shares two cores
    with the server. A request on a reused connection that fails before any byte of the answer (the
    server closed it as idle: the keep-alive race) is sent again once on a new connection, as HTTP
    clients do for idempotent requests."""

    IDLE_S = 2.0  # reuse a connection idle for less than this (uvicorn closes them after 5 s)

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port or 80
        self.host_header = f"{self.host}:{self.port}".encode()
        self.timeout = timeout
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        now = time.monotonic()
        while self.idle:
            reader, writer, at = self.idle.pop()
            if now - at < self.IDLE_S and not reader.at_eof():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        return reader, writer, False

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Answer:
        for attempt in (0, 1):
            reader, writer, reused = await self._connection()
            head = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self.host_header]
            head += [f"{k}: {v}".encode() for k, v in headers.items()]
            if body or method == "POST":
                head += [b"Content-Type: application/json", f"Content-Length: {len(body)}".encode()]
            try:
                writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
                answer, keep = await asyncio.wait_for(self._read(reader), self.timeout)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                writer.close()
                if reused and attempt == 0 and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                    continue  # the server closed the idle connection as we sent: once more, on a new one
                raise
            except BaseException:
                writer.close()
                raise
            if keep:
                self.idle.append((reader, writer, time.monotonic()))
            else:
                writer.close()
            return answer
        raise AssertionError("unreachable")

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[Answer, bool]:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                fields[name.strip().lower()] = value.strip()
        if "content-length" in fields:
            body = await reader.readexactly(int(fields["content-length"]))
        elif fields.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                parts.append(await reader.readexactly(size + 2))
                if size == 0:
                    break
            body = b"".join(p[:-2] for p in parts)
        else:
            body = b""
        return Answer(status, body), fields.get("connection", "").lower() != "close"

    async def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()


class HttpxHTTP:
    """The same interface over httpx (`--client httpx`)."""

    def __init__(self, url: str) -> None:
        # As many keep-alive connections as connections: a pool that closes surplus idle connections can
        # close one it has just handed to a queued request, which then hangs (encode/httpcore#1110; seen
        # here as thousands of requests stuck with client and server idle). One pool per simulated client:
        # httpcore's pool does work in queued requests × connections on every request, so one shared pool
        # of hundreds of connections makes the generator itself the bottleneck. Keep-alive shorter than
        # the server's (uvicorn: 5 s).
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, verify=False, timeout=httpx.Timeout(30.0))

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Answer:
        if body:
            headers = {**headers, "Content-Type": "application/json"}
        response = await self.client.request(method, path, headers=headers, content=body or None)
        return Answer(response.status_code, response.content)

    async def close(self) -> None:
        await self.client.aclose()


CLIENT_ERRORS = (httpx.HTTPError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                 TimeoutError, ValueError, OSError)
