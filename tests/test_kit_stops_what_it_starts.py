"""The suite starts no process it does not stop (issue 41: an orphaned Celery worker, parent PID 1, was left
after tests/gpu/test_gpu_worker.py). Why: `WorkerProcess.stop` sent SIGTERM to the process it started and,
after the grace, SIGKILL to that process alone. `dtp-layout worker --gpus …` (app/cli/commands/service.py
cmd_worker) forwards SIGTERM to its Celery children, whose warm shutdown waits for the task they run; past
the grace the parent was killed and each child ran on, orphaned. Now the kit kills the process group the
started process leads (start_new_session=True), and whatever of it is left once the process has ended."""

from __future__ import annotations

import os
import sys
import time

from tests.service_kit import WorkerProcess, make_settings

# A parent like cmd_worker with --gpus: a child it forwards SIGTERM to, which (like Celery finishing a
# task before its warm shutdown ends) does not stop on it.
PARENT = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child', flush=True); time.sleep(600)"])
signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
print(f"child pid {child.pid}; worker ready.", flush=True)
child.wait()
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_worker_stops_the_children_it_started(tmp_path):
    settings = make_settings(tmp_path)
    worker = WorkerProcess(settings, tmp_path / "worker.log", name="parent")
    worker.cmd = [sys.executable, "-c", PARENT]
    worker.start(timeout=60)
    child = int(worker.log().split("child pid ", 1)[1].split(";", 1)[0])
    assert alive(child) and os.getpgid(child) == worker.proc.pid
    t0 = time.monotonic()
    worker.stop(grace=1)
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; its reaping (init) may lag a little
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), f"the worker's child {child} outlived the worker (parent PID 1)"
    assert time.monotonic() - t0 < 10
