"""`dtp-layout serve` supervises its worker: a worker that dies is restarted (and the server says so),
and SIGTERM — how systemd, docker and supervisors stop a service — stops the worker with the server:
no worker process outlives it."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.service_kit import ServeProcess, make_settings, provision

pytestmark = [pytest.mark.worker]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_output(serve: ServeProcess, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(serve.output):
            if m := re.search(pattern, line):
                return m
        time.sleep(0.1)
    raise TimeoutError(f"no {pattern!r} in the output of serve:\n{''.join(serve.output[-40:])}\n{serve.worker_log()}")


def test_worker_restarted_when_killed_and_stopped_with_serve_on_sigterm(tmp_path):
    var = tmp_path / "var"
    provision(make_settings(var))
    serve = ServeProcess(var)
    try:
        first = int(re.search(r"worker +pid (\d+)", serve.start().banner()).group(1))
        assert alive(first)
        os.kill(first, signal.SIGKILL)
        wait_output(serve, rf"the worker \(pid {first}\) exited with status -9; restarting in 1 s", 15)
        second = int(wait_output(serve, r"worker restarted: pid (\d+)", 15).group(1))
        assert second != first and alive(second)

        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=40) == 0, "".join(serve.output[-40:])
        deadline = time.monotonic() + 5
        while alive(second) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(second), f"worker {second} survived serve's SIGTERM"
    finally:
        serve.stop()
