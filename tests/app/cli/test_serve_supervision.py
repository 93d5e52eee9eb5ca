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


@pytest.mark.skipif(not Path("/proc/self/autogroup").is_file(), reason="no autogroup scheduling in this kernel")
def test_a_worker_in_its_own_session_keeps_the_servers_nice_value(tmp_path):
    """Autogroup scheduling makes a new session a group of its own at nice 0, where a nice value inherited
    from the server would count for nothing: `share_priority` gives the worker's session the server's nice
    (checked in a child at nice 7 and one at its start value; a priority cannot be raised back)."""
    import subprocess
    import sys

    code = """
import os, subprocess, sys
from app.cli.supervisor import share_priority
start = os.nice(0)
if sys.argv[1] == "lowered":
    os.nice(7 - start if start < 7 else 0)
child = subprocess.Popen(["sleep", "30"], start_new_session=True)
share_priority(child.pid)
print(os.nice(0), open(f"/proc/{child.pid}/autogroup").read().split()[-1])
child.kill()
"""
    repo = Path(__file__).resolve().parents[3]
    for case in ("lowered", "as-started"):
        out = subprocess.run([sys.executable, "-c", code, case], capture_output=True, text=True, check=True,
                             cwd=str(repo)).stdout.split()
        own, group = int(out[0]), int(out[1])
        assert group == (own if own > 0 else 0), (case, out)  # the group's nice: the server's, never below 0
