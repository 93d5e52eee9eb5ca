"""Slow and incomplete requests are timed out, on a real server: raw sockets against `dtp-layout serve`
(header timeout 1 s, body timeout 2 s). Half a request's headers, nothing at all, headers dripped a
byte at a time, a second request on a kept-alive connection that stalls, a body that stops half-way:
each connection is closed after its deadline (with a 408 when a request was started), while complete
requests, slow bodies within the deadline and pipelined requests are answered. uvicorn's h11 protocol
gets the same header deadline (app/api/http_timeouts.py wraps both)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from app.api.http_timeouts import protocol
from tests.service_kit import ServeProcess, free_port

# serial: every case bounds when the server closes the connection to within a second and a half
pytestmark = pytest.mark.serial
HEADER_S, BODY_S = 1.0, 2.0


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    process = ServeProcess(tmp_path_factory.mktemp("slow") / "var", serve_args=("--no-worker",),
                           DTP_LAYOUT_HEADER_TIMEOUT_S=str(HEADER_S), DTP_LAYOUT_BODY_TIMEOUT_S=str(BODY_S))
    process.start()
    yield process
    process.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (monotonic)."""
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer, time.monotonic()


def one_answer(sock: socket.socket) -> bytes:
    """One whole answer (headers and Content-Length bytes of body) from a kept-alive connection."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def logged(serve: ServeProcess, text: str, timeout: float = 10.0) -> bool:
    """Whether `text` shows up in the server's output (the access line follows the answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in "".join(serve.output):
            return True
        time.sleep(0.05)
    return False


def body_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_half_the_headers_then_nothing_is_408_and_closed(serve):
    with connect(serve.port) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: slow")
        answer, closed = until_closed(sock)
    print(f"half the headers: 408 and closed after {(closed - t0) * 1e3:.0f} ms")
    assert answer.startswith(b"HTTP/1.1 408")
    assert body_of(answer) | {"detail": None} == {"detail": None, "field": "headers", "error": "request_timeout"}
    assert HEADER_S - 0.05 <= closed - t0 < HEADER_S + 1.5


def test_a_connection_that_sends_nothing_is_closed(serve):
    with connect(serve.port) as sock:
        t0 = time.monotonic()
        answer, closed = until_closed(sock)
    print(f"idle new connection: closed after {(closed - t0) * 1e3:.0f} ms")
    assert answer == b"" and HEADER_S - 0.05 <= closed - t0 < HEADER_S + 1.5


def test_headers_dripped_a_byte_at_a_time_do_not_keep_the_connection(serve):
    """Every byte arrives well within the deadline; the headers as a whole do not."""
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"s" * 40 + b"\r\n\r\n"
    with connect(serve.port) as sock:
        t0 = time.monotonic()
        try:
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)  # 4.7 s for the whole request
        except OSError:
            pass  # the server closed it: sending fails
        answer, closed = until_closed(sock)
    print(f"dripped headers: closed after {(closed - t0) * 1e3:.0f} ms")
    assert answer.startswith(b"HTTP/1.1 408") and closed - t0 < HEADER_S + 1.5


def test_a_stalled_second_request_on_a_kept_alive_connection_is_closed(serve):
    with connect(serve.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = one_answer(sock)
        t0 = time.monotonic()
        sock.sendall(b"GET /heal")
        answer, closed = until_closed(sock)
    assert first.startswith(b"HTTP/1.1 200")
    assert answer.startswith(b"HTTP/1.1 408") and HEADER_S - 0.05 <= closed - t0 < HEADER_S + 1.5


def test_pipelined_requests_are_all_answered(serve):
    with connect(serve.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        time.sleep(HEADER_S + 0.5)  # past the header deadline: none of the three may be cut
        answer = b""
        while answer.count(b"HTTP/1.1 200") < 3:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.count(b"HTTP/1.1 200") == 3


def test_a_body_that_stops_half_way_is_408_and_closed(serve):
    with connect(serve.port) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        answer, closed = until_closed(sock)
    print(f"body stalled: 408 and closed after {(closed - t0) * 1e3:.0f} ms")
    assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower()
    assert body_of(answer) | {"detail": None} == {"detail": None, "field": "body", "error": "request_timeout"}
    assert BODY_S - 0.05 <= closed - t0 < BODY_S + 1.5
    assert logged(serve, "POST /v1/jobs 408")  # logged and counted like any answer


def test_a_slow_body_within_the_deadline_is_read(serve):
    body = b'{"model": {"id": "x"}}'
    with connect(serve.port) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 8):
            time.sleep(0.3)
            sock.sendall(body[i:i + 8])
        answer, _ = until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 422"), answer[:200]  # parsed: it names the missing fields
    assert "devices" in {e["field"] for e in body_of(answer)["detail"]}


def _uvicorn_in_thread(http: type[asyncio.Protocol]):
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, thread, port


@pytest.mark.parametrize("h11", [False, True], ids=["httptools", "h11"])
def test_both_uvicorn_protocols_get_the_header_deadline(h11):
    server, thread, port = _uvicorn_in_thread(protocol(HEADER_S, h11=h11))
    try:
        with connect(port) as sock:
            t0 = time.monotonic()  # the deadline runs from the second answer, sent after this
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # two pipelined requests, answered
            time.sleep(0.2)
            sock.sendall(b"GET / HTTP/1.1\r\nHo")
            answer, closed = until_closed(sock)
        assert answer.count(b"HTTP/1.1 200") == 2, answer
        assert answer.rstrip().endswith(b'"error": "request_timeout"}')
        assert HEADER_S - 0.05 <= closed - t0 < HEADER_S + 1.5
    finally:
        server.should_exit = True
        thread.join(timeout=10)
