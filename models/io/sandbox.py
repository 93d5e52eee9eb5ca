"""Running a parser that cannot be bounded from outside (a tokenizer's regex engine, a third-party
reader of a tenant's file) where its failure cannot take the caller with it: a child process with an
address-space limit (RLIMIT_AS) and a CPU-time limit (RLIMIT_CPU), waited for with a wall-clock
timeout. A panic (the `tokenizers` library's PanicException is a BaseException that `except Exception`
misses), a MemoryError, a signal or a limit comes back as one `ChildFailed` (a ValueError: the worker
fails the job once, naming it; the API answers 422), never as a dead or hung caller.

    value = run_limited(parse, (path,), limits=ChildLimits(memory_bytes=1 << 30, cpu_s=60, timeout_s=120),
                        what="tokenizer.json")

The memory limit is what the child may add to the address space it starts with: a forked child of a
worker inherits the mappings of the model it holds (and CUDA's reservations), which RLIMIT_AS counts.
`target(*args, report)` runs in the child; `report(text)` says what it is working on (the failure
names it: "while reading tokenizer.json"). Its return value must pickle. Linux (resource, fork, prctl).

The child is the caller's work, and ends with it: it runs in a process group of its own, with SIGTERM's
default action (a forked child of a Celery worker would inherit the worker's handler, which only notes
a shutdown: the child ignored SIGTERM), and dies with the thread that started it (PR_SET_PDEATHSIG).
While it runs the caller's `StopSignal` (models.base.progress: a job's cancel, lost lease, stall or
shutdown) is read every POLL_S; once it is set, or the call ends any other way, the child's group gets
SIGTERM and, STOP_GRACE_S later, SIGKILL, and the call raises `Cancelled`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from models.base.progress import Cancelled, current_stop

_CPU_GRACE_S = 5  # between RLIMIT_CPU's soft limit (SIGXCPU) and its hard one (SIGKILL)
POLL_S = 0.1  # how often the caller's stop signal is read while the child runs
STOP_GRACE_S = 1.0  # between SIGTERM to the child's group and SIGKILL
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildLimits:
    """Bytes of address space the child may add, CPU seconds, wall-clock seconds; and the setting
    that names each (for the message a tenant reads)."""

    memory_bytes: int
    cpu_s: int
    timeout_s: float
    memory_setting: str = ""
    cpu_setting: str = ""
    timeout_setting: str = ""
    nice: int = 0  # added to the child's niceness: a check must not slow the process that serves others


@dataclass(frozen=True)
class TokenizerLimits:
    """The tokenizer's child process (the settings TOKENIZER_MEMORY_BYTES, TOKENIZER_CPU_S,
    TOKENIZER_CPU_S_PER_MTOKEN): address space it may add beyond what it inherits, plus
    `bytes_per_token` per token asked (the ids, their pieces and the copy sent back); CPU seconds, plus
    `cpu_s_per_mtoken` per million tokens; twice the CPU time as wall clock."""

    memory_bytes: int = 2 << 30
    cpu_s: int = 300
    cpu_s_per_mtoken: float = 120.0
    bytes_per_token: int = 32

    def for_tokens(self, tokens: int) -> ChildLimits:
        cpu = int(self.cpu_s + self.cpu_s_per_mtoken * tokens / 1e6)
        return ChildLimits(memory_bytes=self.memory_bytes + self.bytes_per_token * tokens, cpu_s=cpu,
                           timeout_s=2.0 * cpu, memory_setting="DTP_LAYOUT_TOKENIZER_MEMORY_BYTES",
                           cpu_setting="DTP_LAYOUT_TOKENIZER_CPU_S", timeout_setting="twice DTP_LAYOUT_TOKENIZER_CPU_S")


class ChildFailed(ValueError):
    """The child hit a limit, crashed, or raised: `reason` is memory, cpu, timeout, signal or raised;
    `during` what it last reported working on."""

    def __init__(self, reason: str, message: str, during: str | None) -> None:
        super().__init__(message)
        self.reason, self.during = reason, during


def _address_space() -> int:
    """Bytes of address space this process has mapped now (VmSize)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def limit_self(limits: ChildLimits) -> None:
    """Apply the limits to the calling process (the child, first thing). Garbage the child inherited is
    collected first: freed after the limit was set, it would give the child its address space as headroom."""
    gc.collect()
    cap = _address_space() + limits.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime)  # a forked child starts with its parent's count at zero
    resource.setrlimit(resource.RLIMIT_CPU, (spent + limits.cpu_s, spent + limits.cpu_s + _CPU_GRACE_S))
    if limits.nice:
        os.nice(limits.nice)


def _own_group() -> None:
    """In the child, first: a process group of its own (its caller kills the group), SIGTERM and SIGINT
    back to their default action, and SIGKILL should the thread that started it die."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child(conn: Connection, target: Callable[..., Any], args: tuple[Any, ...], limits: ChildLimits) -> None:
    def report(text: str) -> None:
        conn.send(("doing", text))

    _own_group()
    faulthandler.disable()  # a crash is the parent's to report (exit status), not a traceback on stderr
    try:
        limit_self(limits)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the CPU limit counts them all
        conn.send(("ok", target(*args, report)))
    except MemoryError:
        conn.send(("memory", "MemoryError"))
    except BaseException as exc:  # a panic, a RecursionError, anything: said, never hidden
        conn.send(("raised", f"{type(exc).__name__}: {str(exc)[:300]}"))
    finally:
        conn.close()


def _context(start_method: str) -> Any:
    return multiprocessing.get_context(start_method)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def end_child(process: Any, grace_s: float = STOP_GRACE_S) -> None:
    """The child's process group: SIGTERM, then SIGKILL after `grace_s` if the child still runs; reaped."""
    if process.is_alive():
        _signal_group(process.pid, signal.SIGTERM)
        process.join(grace_s)
    if process.is_alive():
        _signal_group(process.pid, signal.SIGKILL)
        process.kill()  # should it not have reached its own group yet
    process.join(5)


def run_limited(target: Callable[..., Any], args: tuple[Any, ...], *, limits: ChildLimits, what: str,
                start_method: str = "fork") -> Any:
    """`target(*args, report)` in a child process under `limits`; its return value, or ChildFailed
    naming `what` (or what the child last reported) and the limit or the crash."""
    ctx = _context(start_method)
    ours, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(theirs, target, args, limits), daemon=True)
    process.start()
    with contextlib.suppress(OSError):  # the child does it too; whichever runs first, the group is its pid
        os.setpgid(process.pid, process.pid)
    theirs.close()
    during: str | None = None
    deadline = time.monotonic() + limits.timeout_s
    stop = current_stop()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed("timeout", f"{during or what}: not done within {limits.timeout_s:g} s "
                                             f"({limits.timeout_setting or 'the wall-clock limit'})", during)
            if stop is not None and stop.is_set():
                end_child(process)
                raise Cancelled(f"{stop.reason or 'stopped'} (the child reading {during or what} was ended)")
            if not ours.poll(min(left, POLL_S if stop is not None else 1.0)):
                continue
            try:
                kind, value = ours.recv()
            except EOFError:  # the child died without a word: a signal (the CPU limit's, or a crash)
                break
            if kind == "doing":
                during = value
            elif kind == "ok":
                return value
            elif kind == "memory":
                raise ChildFailed("memory", f"{during or what}: reading it needs more than "
                                            f"{limits.memory_bytes >> 20} MiB of memory "
                                            f"({limits.memory_setting or 'the memory limit'})", during)
            else:
                raise ChildFailed("raised", f"{during or what}: the parser failed on it ({value})", during)
        process.join(5)
        code = process.exitcode
        if code == -signal.SIGXCPU:
            raise ChildFailed("cpu", f"{during or what}: reading it took more than {limits.cpu_s} CPU seconds "
                                     f"({limits.cpu_setting or 'the CPU limit'})", during)
        if code == -signal.SIGKILL:  # the CPU limit's hard stop, or the kernel out of memory
            raise ChildFailed("signal", f"{during or what}: the parser was killed (past {limits.cpu_s} CPU "
                                        f"seconds, or the machine out of memory)", during)
        raise ChildFailed("signal", f"{during or what}: the parser crashed on it (exit {code})", during)
    finally:
        ours.close()
        end_child(process)
