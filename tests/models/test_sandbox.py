"""models.io.sandbox: a parser run in a child process comes back as its value, or as one ChildFailed (a
ValueError) saying which limit or crash ended it and what the child was reading — never as a dead or
hung caller. Each way out is driven for real: an allocation past RLIMIT_AS, a loop past RLIMIT_CPU, a
sleep past the wall clock, a segfault, a BaseException the caller's `except Exception` would miss."""

from __future__ import annotations

import os
import signal
import time

import pytest

from models.io.sandbox import ChildFailed, ChildLimits, run_limited

LIMITS = ChildLimits(memory_bytes=256 << 20, cpu_s=2, timeout_s=20, memory_setting="MEM", cpu_setting="CPU",
                     timeout_setting="WALL")


def _value(x, report):
    report("value.json")
    return {"twice": 2 * x}


def _allocate(report):
    report("huge.bin")
    held = [bytearray(1 << 30) for _ in range(4)]  # 4 GiB, past the 256 MiB the child may add
    return len(held)


def _spin(report):
    report("spin.json")
    while True:
        pass


def _sleep(report):
    report("slow.json")
    time.sleep(60)


def _segfault(report):
    report("crash.gguf")
    os.kill(os.getpid(), signal.SIGSEGV)


class PanicException(BaseException):
    pass


def _panic(report):
    report("tokenizer.json")
    raise PanicException("Onig: retry-limit-in-match over")


def test_the_value_comes_back():
    assert run_limited(_value, (21,), limits=LIMITS, what="x") == {"twice": 42}


@pytest.mark.serial  # CPU-second and wall-clock limits, a wall-time bound
@pytest.mark.parametrize(("target", "reason", "words"), [
    (_allocate, "memory", "huge.bin: reading it needs more than 256 MiB of memory (MEM)"),
    (_spin, "cpu", "spin.json: reading it took more than 2 CPU seconds (CPU)"),
    (_sleep, "timeout", "slow.json: not done within 1.5 s (WALL)"),
    (_segfault, "signal", "crash.gguf: the parser crashed on it (exit -11)"),
    (_panic, "raised", "tokenizer.json: the parser failed on it (PanicException: Onig"),
], ids=["memory", "cpu", "wall-clock", "segfault", "panic"])
def test_each_way_a_child_ends_is_one_value_error_naming_what_it_read(target, reason, words):
    limits = ChildLimits(**{**LIMITS.__dict__, "timeout_s": 1.5 if target is _sleep else 20})
    t0 = time.monotonic()
    with pytest.raises(ChildFailed) as failed:
        run_limited(target, (), limits=limits, what="the upload")
    assert isinstance(failed.value, ValueError) and failed.value.reason == reason, str(failed.value)
    assert words in str(failed.value), str(failed.value)
    assert time.monotonic() - t0 < 15
