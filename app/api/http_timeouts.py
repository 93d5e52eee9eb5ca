"""Uvicorn's HTTP/1.1 protocols with a header read timeout.

Uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but stops that
clock at the first byte of the next request, and never starts one on a new connection: a client that
sends half a request line, or headers one byte a minute, holds its connection (and a file descriptor)
forever; a few thousand of them exhaust the server (slowloris). This module's protocols give the
headers of each request a deadline: from the moment the connection is made, or the previous response
was sent, the request's headers must be complete within DTP_LAYOUT_HEADER_TIMEOUT_S. Past it the
connection is closed, after a 408 when the client had started a request. Once the headers are in, the
body has its own deadline (DTP_LAYOUT_BODY_TIMEOUT_S, app/api/body_limit.py, an ASGI middleware) and the
route as long as it needs.

`dtp-layout serve` uses `protocol(settings.header_timeout_s)`; under plain uvicorn pass
`--http app.api.http_timeouts:HeaderTimeoutProtocol` (it reads the timeout from the environment's
settings). Both wrap uvicorn's httptools protocol (h11 where httptools is missing) through the hooks
the two share: `connection_made`, the end of a request's headers (`on_headers_complete` for
httptools, a new request/response cycle after `handle_events` for h11), `on_response_complete` and
`connection_lost`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # pragma: no cover - uvicorn without httptools (the package depends on it)
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]
from uvicorn.protocols.http.h11_impl import H11Protocol


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps({"detail": f"the request's headers did not arrive within {seconds:g} s "
                                 "(DTP_LAYOUT_HEADER_TIMEOUT_S)", "field": "headers",
                       "error": "request_timeout"}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


class _HeaderDeadline:
    """The mixin: one timer per connection, armed while the server waits for a request's headers.

    `_awaiting` counts requests whose headers are in and whose response is not finished yet (more
    than one when httptools parses pipelined requests ahead). The timer runs only while it is zero:
    from connection_made and from each response's end, until the next request's headers are in."""

    header_timeout_s: float | None = None  # None: the settings' DTP_LAYOUT_HEADER_TIMEOUT_S
    # The attributes of uvicorn's protocols this relies on (set by their __init__ / connection_made).
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        seconds = self.header_timeout_s
        if seconds is None:
            from app.core.settings import get_settings

            seconds = get_settings().header_timeout_s
        self._header_seconds = float(seconds)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = False  # a byte of the awaited request arrived
        self._awaiting = 0

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_bytes = False
        self._header_timer = self.loop.call_later(self._header_seconds, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._header_bytes:  # a request was started: say why it ends; an idle connection just closes
            self.transport.write(_timeout_answer(self._header_seconds))
        self.transport.close()

    def _headers_complete(self) -> None:
        self._cancel_header_timer()
        self._awaiting += 1

    # ---- uvicorn's hooks ----
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None and data:
            self._header_bytes = True
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._awaiting = max(0, self._awaiting - 1)
        if self._awaiting == 0 and not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]


class HttpToolsHeaderTimeout(_HeaderDeadline, _Base):  # type: ignore[misc]
    def on_headers_complete(self) -> None:
        self._headers_complete()
        super().on_headers_complete()


class H11HeaderTimeout(_HeaderDeadline, H11Protocol):  # type: ignore[misc]
    def handle_events(self) -> None:
        # h11 has no headers-complete callback: a request's headers are in when handle_events starts
        # a new request/response cycle (uvicorn's h11 protocol handles one request at a time).
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._headers_complete()
        elif self.transport.get_protocol() is not self:  # upgraded (WebSocket): no longer this protocol's
            self._cancel_header_timer()


HeaderTimeoutProtocol: type[asyncio.Protocol] = (HttpToolsHeaderTimeout if _Base is not H11Protocol
                                                 else H11HeaderTimeout)


def protocol(header_timeout_s: float, *, h11: bool = False) -> type[asyncio.Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this header timeout."""
    base = H11HeaderTimeout if h11 else HeaderTimeoutProtocol
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})
