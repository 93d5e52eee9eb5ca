"""The worker `dtp-layout serve` runs beside its API: started, watched, restarted when it dies, stopped
with its whole process group when the server stops.

    WorkerSupervisor(cmd, env=..., log_path=...).start()   the worker runs; a thread watches it
      worker exits (crash, OOM kill, SIGKILL)    → "restarting in N s", back-off 1, 2, 4 … 60 s
                                                   (back to 1 s once a worker lived 60 s)
      stop()                                     → SIGTERM to the worker's process group, SIGKILL
                                                   after `grace` seconds: no orphan survives

The worker runs in its own session (a Ctrl-C in the terminal reaches the server only, which then
stops the worker) and, on Linux, with a parent-death signal: should the server itself be SIGKILLed,
the kernel kills the worker too; it keeps the server's CPU priority (`share_priority`). Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it (the watcher) dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def share_priority(pid: int) -> None:
    """Give process `pid`, just started by this one in a session of its own, this process's nice value as
    its session's. Under Linux's autogroup scheduling (on by default in many kernels) a new session is a
    scheduling group of its own at nice 0, and a nice value counts only within its group: without this, the
    worker of a `nice dtp-layout serve` takes the CPU at full weight. Best effort: nothing where there are
    no autogroups; an unprivileged change is refused within 0.1 s of the last one on the machine (retried)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return
    for _ in range(10):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:  # EAGAIN: the kernel's once-per-0.1-s limit on unprivileged changes
            time.sleep(0.1)
        except OSError:  # no autogroups (no such file), the process gone, or not allowed
            return


def _say(message: str) -> None:
    print(f"dtp-layout serve: {message}", file=sys.stderr, flush=True)


class WorkerSupervisor:
    def __init__(self, cmd: list[str], *, env: dict[str, str], log_path: Path, grace: float = 10.0,
                 min_backoff: float = 1.0, max_backoff: float = 60.0, healthy_after: float = 60.0,
                 say: Callable[[str], None] = _say) -> None:
        self.cmd, self.env, self.log_path, self.grace = cmd, env, log_path, grace
        self.min_backoff, self.max_backoff, self.healthy_after = min_backoff, max_backoff, healthy_after
        self.say = say
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="worker-supervisor", daemon=True)

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 30.0) -> WorkerSupervisor:
        self._thread.start()
        self._started.wait(timeout)
        return self

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        share_priority(proc.pid)
        return proc

    def _watch(self) -> None:
        # Popen runs in this thread, which lives as long as the supervisor: the parent-death signal
        # fires when the server process dies, not when some short-lived thread ends.
        backoff = self.min_backoff
        while not self._stopping.is_set():
            with self._lock:
                if self._stopping.is_set():
                    break
                self._proc = proc = self._spawn()
            if self.restarts:
                self.say(f"worker restarted: pid {proc.pid} (restart {self.restarts}, log {self.log_path})")
            self._started.set()
            t0 = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                break
            if time.monotonic() - t0 >= self.healthy_after:
                backoff = self.min_backoff
            self.say(f"the worker (pid {proc.pid}) exited with status {code}; restarting in {backoff:g} s "
                     f"(see {self.log_path}); its job resumes when its lease expires")
            if self._stopping.wait(backoff):
                break
            backoff = min(self.max_backoff, backoff * 2)
            self.restarts += 1
        self._started.set()

    def stop(self) -> None:
        """SIGTERM to the worker's process group (Celery's warm shutdown), SIGKILL after `grace`."""
        with self._lock:
            self._stopping.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.say(f"the worker (pid {proc.pid}) did not stop within {self.grace:g} s; killing it")
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc is not None:
            # Anything the worker left in its group (it ran in its own session, so its pid is the group).
            _signal_group(proc.pid, signal.SIGKILL)
        self._thread.join(timeout=5)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
