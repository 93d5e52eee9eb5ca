"""No request can put a line break into a log line: a real `dtp-layout serve` (text and JSON logs)
gets requests whose path, query, X-Request-ID, User-Agent and X-Forwarded-For (uvicorn trusts it from
127.0.0.1: it becomes the logged client address) carry every line break `str.splitlines` knows
(LF, CR, VT, FF, FS, GS, RS, NEL, U+2028, U+2029) followed by a forged record; the server's output,
split the broadest way, never has a line that starts with the forgery, and the JSON lines parse back
to exactly what was sent. The formatters' own rules are checked on records (tracebacks included)."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.parse

import pytest

from app.core import logs
from app.core.safe_text import LINE_BREAKS, for_log, json_escapes
from tests.patience_kit import Deadline, patient
from tests.service_kit import ServeProcess

# No comma: uvicorn splits X-Forwarded-For on commas and would log only the last part.
FORGED = "FORGED 2026-01-01 00:00:00.000 INFO dtp_layout.access: GET /admin 200"


def _raw_request(port: int, target: bytes, headers: dict[bytes, bytes]) -> bytes:
    head = b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers.items()) + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=patient(10)) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _forgeries(port: int) -> dict[str, str]:
    """Send one request per (vector, line break); returns the decoded path of each path forgery by tag."""
    paths = {}
    for i, brk in enumerate(LINE_BREAKS):
        tag = f"p{i}"
        path = f"/v1/jobs/{tag}{brk}{FORGED}"
        paths[tag] = path
        target = urllib.parse.quote(path, safe="/").encode()
        query = b"?model=" + urllib.parse.quote(f"q{i}{brk}{FORGED}").encode()
        assert _raw_request(port, target + query, {}).startswith((b"HTTP/1.1 404", b"HTTP/1.1 422"))
        # Header values cannot hold CR or LF (the parser refuses the request); bytes 0x80-0xFF can
        # (obs-text, read as latin-1: 0x85 is NEL) and so can UTF-8 bytes of U+2028 (read as latin-1).
        raw = brk.encode("latin-1") if brk == "\x85" else brk.encode()
        header = raw + FORGED.encode()
        answer = _raw_request(port, b"/healthz", {b"X-Request-ID": b"rid" + header, b"User-Agent": b"ua" + header,
                                                 b"X-Forwarded-For": b"10.0.0." + str(i).encode() + header})
        assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 400")), answer[:100]
    return paths


def _lines(serve: ServeProcess) -> list[str]:
    # The captured output (universal newlines: a raw CR there already ended a line), split on every
    # line break Python knows.
    return "".join(serve.output).splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_request_can_forge_a_log_line(tmp_path, fmt):
    serve = ServeProcess(tmp_path / "var", serve_args=("--no-worker",), DTP_LAYOUT_LOG_FORMAT=fmt)
    serve.start()
    try:
        paths = _forgeries(serve.port)
        deadline = Deadline(10)  # the access lines follow the answers: wait for the last one
        while f"/v1/jobs/p{len(LINE_BREAKS) - 1}" not in "".join(serve.output) and not deadline.expired():
            time.sleep(0.05)
    finally:
        serve.stop()
    lines = _lines(serve)
    assert not [line for line in lines if FORGED in line and not line.lstrip("{").startswith(("20", '"ts"'))], \
        "a line starts with a forgery"
    assert not [line for line in lines if line.startswith("FORGED")]
    access = [line for line in lines if "dtp_layout.access" in line]
    for tag, path in paths.items():
        mine = [line for line in access if f"/v1/jobs/{tag}" in line]
        assert len(mine) == 1, (tag, mine)  # the whole request on one line
        if fmt == "json":
            record = json.loads(mine[0])
            assert record["path"] == path  # escaped on the way out, exactly what was sent on the way back
            assert path in record["message"]
        else:
            assert for_log(path) in mine[0]
    if fmt == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        clients = {r.get("client") for r in records if r.get("logger") == "dtp_layout.access"}
        assert any(c and c.startswith("10.0.0.") and FORGED in c for c in clients), clients  # it was logged …
        assert all(line.startswith("{") for line in lines if "10.0.0." in line)  # … on its own line


def test_text_records_keep_tracebacks_as_prefixed_continuation_lines():
    formatter = logs.TextFormatter()
    record = logging.LogRecord("app.test", logging.ERROR, __file__, 1, "failed on %s", (f"/x\u2028{FORGED}",), None)
    try:
        raise ValueError(f"bad input\n{FORGED}\x85{FORGED}")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    record.request_id = f"r\n{FORGED}"
    text = formatter.format(record)
    first, *rest = text.splitlines()
    assert first.startswith("failed on /x\\u2028FORGED") or "failed on /x\\u2028FORGED" in first
    assert first.endswith(f"[request_id=r\\n{FORGED}]")
    assert rest and all(line.startswith(logs.CONTINUATION) for line in rest), rest
    assert rest[0] == logs.CONTINUATION + "Traceback (most recent call last):"
    assert any(line == logs.CONTINUATION + FORGED for line in rest)  # the exception's own line, continued


def test_json_records_escape_every_non_printable_character():
    out = logs.JsonFormatter().format(logging.LogRecord(
        "app.test", logging.INFO, __file__, 1, "path %s", ("/a" + LINE_BREAKS + "\u202e\u200b\x9b\U000e0041",), None))
    assert out.isprintable() and len(out.splitlines()) == 1
    assert json.loads(out)["message"] == "path /a" + LINE_BREAKS + "\u202e\u200b\x9b\U000e0041"
    assert json_escapes('"\u2028"') == '"\\u2028"' and json.loads(json_escapes('"\U000e0041"')) == "\U000e0041"
