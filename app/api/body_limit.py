"""Request bodies over DTP_LAYOUT_MAX_BODY_BYTES get 413 before they are read; bodies that do not
arrive within DTP_LAYOUT_BODY_TIMEOUT_S get 408.

A pure ASGI middleware: a Content-Length over the limit is answered at once, without reading a byte
of the body; a chunked body is counted as it arrives and answered 413 as soon as it passes the
limit. Either way no more than the limit is ever held in memory. The body's deadline runs from the
start of the request (its headers are in: app/api/http_timeouts.py bounds those): a client that stops
sending half-way gets 408 and its connection closed, instead of holding a request open for ever.
After the body is complete, `receive` is passed through untouched (a streaming answer waits on it
for the client's disconnect as long as it needs).

`Wider` routes take a larger body under their own limit and deadline: an upload's part
(DTP_LAYOUT_UPLOAD_PART_BYTES within DTP_LAYOUT_UPLOAD_PART_TIMEOUT_S), matched by method and path.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _answer(status: int, detail: str, error: str) -> tuple[Message, Message]:
    body = json.dumps({"detail": detail, "field": "body", "error": error}).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Wider:
    """A route whose bodies may be larger (and slower) than the default limit's."""

    method: str
    path: str  # a regular expression over the whole path
    max_bytes: int
    timeout_s: float
    setting: str  # what the 413 names
    timeout_setting: str


class _Limit:
    def __init__(self, max_bytes: int, timeout_s: float, setting: str, timeout_setting: str) -> None:
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.too_large = _answer(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                                      f"({setting})", "payload_too_large")
        self.too_slow = _answer(408, f"the request body did not arrive within {timeout_s:g} s ({timeout_setting})",
                                "request_timeout")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0, wider: tuple[Wider, ...] = ()) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self._default = _Limit(max_bytes, timeout_s, "DTP_LAYOUT_MAX_BODY_BYTES", "DTP_LAYOUT_BODY_TIMEOUT_S")
        self._wider = [(w.method, re.compile(w.path), _Limit(w.max_bytes, w.timeout_s, w.setting, w.timeout_setting))
                       for w in wider]

    def _limit(self, scope: Scope) -> _Limit:
        for method, path, limit in self._wider:
            if scope.get("method") == method and path.fullmatch(scope.get("path", "")):
                return limit
        return self._default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit.max_bytes + 1  # unparseable: refuse rather than guess
                if declared > limit.max_bytes:
                    for message in limit.too_large:
                        await send(message)
                    return
        deadline = asyncio.get_running_loop().time() + limit.timeout_s
        received = 0
        started = rejected = complete = False

        async def guarded_receive() -> Message:
            # Past the limit or the deadline: answer now and tell the app the client left (it stops reading).
            nonlocal received, rejected, complete
            if rejected:
                return {"type": "http.disconnect"}
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await reject(limit.too_slow)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.max_bytes:
                    return await reject(limit.too_large)
                complete = not message.get("more_body", False)
            return message

        async def reject(answer: tuple[Message, Message]) -> Message:
            nonlocal rejected
            rejected = True
            if not started:
                for message in answer:
                    await send(message)
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413/408 went out; whatever the app answers to the "disconnect" is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, guarded_receive, guarded_send)


def install(app: Any, max_bytes: int, timeout_s: float = 30.0, wider: tuple[Wider, ...] = ()) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_bytes, timeout_s=timeout_s, wider=wider)
