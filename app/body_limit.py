"""Request bodies over DTP_LAYOUT_MAX_BODY_BYTES get 413 before they are read.

A pure ASGI middleware: a Content-Length over the limit is answered at once, without reading a byte
of the body; a chunked body is counted as it arrives and answered 413 as soon as it passes the
limit. Either way no more than the limit is ever held in memory.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send: Send) -> None:
        body = json.dumps({"detail": f"the request body is larger than this server's limit of {self.max_bytes} "
                                     "bytes (DTP_LAYOUT_MAX_BODY_BYTES)", "field": "body",
                           "error": "payload_too_large"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.max_bytes + 1  # unparseable: refuse rather than guess
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        received = 0
        started = rejected = False

        async def counting_receive() -> Message:
            # Past the limit: answer 413 now and tell the app the client left (it stops reading).
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    if not started:
                        await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 went out; whatever the app answers to the "disconnect" is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)


def install(app: Any, max_bytes: int) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_bytes)
