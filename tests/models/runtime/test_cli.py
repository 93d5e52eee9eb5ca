"""`dtp-layout generate` and `python -m models.runtime` as a user runs them: locally launched ranks,
ranks started by torchrun, clear errors before any rank starts, and ctrl-C stopping every rank."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.cli.supervisor import share_priority
from models.runtime.sampling import Sampling
from tests.models.runtime.reference import simulator_generation
from tests.patience_kit import patient
from tests.tiny import tokens

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    ids = tokens(1, 6, seed=11).numpy()[0]
    path = tmp_path_factory.mktemp("cli") / "prompt.npy"
    np.save(path, ids)
    return path, ids


def _expected(shards_dir: Path, ids: np.ndarray, new_tokens: int) -> list[int]:
    import torch

    _, _, want = simulator_generation(shards_dir, torch.as_tensor(ids)[None], new_tokens - 1, 1, Sampling())
    return want[0].tolist()


def test_generate_json_matches_the_simulator(shards: Any, prompt: Any) -> None:
    shards_dir = shards("qwen3", 2, 1)
    path, ids = prompt
    proc = subprocess.run([str(BIN / "dtp-layout"), "generate", str(shards_dir), "--ids", str(path),
                           "--max-new-tokens", "6", "--ignore-eos", "--json", "--threads", "1"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == [ids.tolist()] and out["devices"] == 2 and out["delta"] == 1
    assert out["mode"] == "dtp" and out["backend"] == "gloo" and out["text"] is None
    assert out["generated_ids"] == [_expected(shards_dir, ids, 6)]
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["decode_steps"] == 5 and r["ms_per_token"] > 0 and 0 <= r["blocked_ms_per_token"] <= r["ms_per_token"]
    assert "generating" in proc.stderr  # progress on stderr, stdout is the JSON alone


def test_torchrun_starts_the_ranks(shards: Any, prompt: Any) -> None:
    shards_dir = shards("qwen3", 2, 1)
    path, ids = prompt
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "models.runtime",
                           str(shards_dir), "--ids", str(path), "--max-new-tokens", "6", "--ignore-eos", "--json"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # rank 0 alone prints
    assert out["generated_ids"] == [_expected(shards_dir, ids, 6)]
    assert len(out["ranks"]) == 2


@pytest.mark.parametrize("args, message", [
    (["--ids", "PROMPT"], r"manifest\.json: missing"),
    (["--prompt", "hello"], r"has no tokenizer \(tokenizer\.json\): pass --ids"),
    (["--ids", "nonexistent.npy"], r"--ids nonexistent\.npy: no such file"),
], ids=["no-shards", "no-tokenizer", "no-ids-file"])
def test_user_errors_exit_2_before_any_rank_starts(shards: Any, prompt: Any, tmp_path: Path, args: list[str],
                                                    message: str) -> None:
    import re

    target = tmp_path if "manifest" in message else shards("llama", 2, 1)
    args = [str(prompt[0]) if a == "PROMPT" else a for a in args]
    # `python -m models.runtime` is the same command without the dtp-layout CLI's start-up; one case runs both.
    commands = [[sys.executable, "-m", "models.runtime"]]
    if "tokenizer" in message:
        commands.append([str(BIN / "dtp-layout"), "generate"])
    for command in commands:
        t0 = time.monotonic()
        proc = subprocess.run([*command, str(target), *args], capture_output=True, text=True, env=ENV, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert re.search(message, proc.stderr), proc.stderr
        assert "Traceback" not in proc.stderr
        assert time.monotonic() - t0 < 60


# Start-up (the forkserver importing torch, two ranks joining and loading) took 25–35 s alone on the loaded
# 2-core machine; the runtime bounds it itself (start_timeout_s 180 s), so does this test, a little above.
START_BOUND_S = 240.0


def _stderr_lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """proc's stderr, line by line, read by a thread (None at its end): every wait on it has a deadline. A
    blocking readline()/read() waits for every process holding the pipe, the forkserver included, whose
    shutdown with torch imported outlived the command by 7 s here, and far longer on a machine more loaded."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _until(lines: queue.Queue[str | None], deadline: float, want: str | None) -> tuple[bool, str]:
    """Lines until one contains `want` (True) or the end of stderr (want None: True), by the deadline."""
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            return want is None, "".join(seen)
        seen.append(line)
        if want is not None and want in line:
            return True, "".join(seen)
    return False, "".join(seen)


def _group_pids(pgid: int) -> list[int]:
    """The processes in process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                found.append(int(entry.name))
    return found


def _group_members(pgid: int, command: str) -> list[str]:
    """The command lines, containing `command`, of the processes in process group `pgid`."""
    found = []
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if command in cmdline:
                found.append(cmdline)
    return found


def _group_state(pgid: int) -> list[str]:
    """Each process of the group: pid, state, the kernel function it sleeps in, its threads, its command line."""
    found = []
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            proc = Path(f"/proc/{pid}")
            state = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            threads = len(list(proc.joinpath("task").iterdir()))
            found.append(f"{pid} {state} {proc.joinpath('wchan').read_text() or '-'} {threads} thread(s): {cmd}")
    return found


def _ctrl_c(pgid: int, thread: str) -> None:
    """The terminal's ctrl-C: SIGINT to every process of the group. The kernel gives a process's copy to any of
    its threads that does not block it; `thread="other"` makes it one of the command's other threads (the
    rendezvous store's), which only sets Python's flag: the main thread must still act on it."""
    if thread == "main":
        os.killpg(pgid, signal.SIGINT)
        return
    others = [int(t) for t in os.listdir(f"/proc/{pgid}/task") if int(t) != pgid]
    assert others, "the command has one thread only"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pgid, others[0], signal.SIGINT) == 0, ctypes.get_errno()
    for member in _group_pids(pgid):
        if member != pgid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGINT)


SYS_TGKILL = 234  # x86-64; the suite runs on x86-64 Linux (CI and this machine)


@pytest.mark.parametrize("thread", ["main", "other"])
def test_ctrl_c_stops_every_rank(shards: Any, prompt: Any, thread: str) -> None:
    """SIGINT to the terminal's process group mid-generation: exit 130, and no rank process is left (nor the
    forkserver the ranks came from: generate ends it, else it outlives the command by seconds). `other`: the
    command's own copy lands on a thread other than its main one, as the kernel may choose: it waited for its
    ranks without a bound then, and the command never exited (1 run in ~3 of the full suite)."""
    proc = subprocess.Popen([str(BIN / "dtp-layout"), "generate", str(shards("llama", 2, 1)), "--ids",
                             str(prompt[0]), "--max-new-tokens", "1000000", "--ignore-eos", "--link-latency-us", "2000",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    share_priority(proc.pid)  # a session of its own: keep this test process's priority (tests/xdist_kit.py)
    try:
        lines = _stderr_lines(proc)
        # every rank has loaded; the bounds below stretch with the machine's load (tests/patience_kit.py): a
        # busy machine (a job beside the suite) took them past the figures written for an idle one
        started, said = _until(lines, time.monotonic() + patient(START_BOUND_S), "generating")
        assert started, said
        time.sleep(1.0)
        _ctrl_c(proc.pid, thread)
        t0, stop_bound = time.monotonic(), patient(15)
        try:
            code = proc.wait(timeout=patient(30))
        except subprocess.TimeoutExpired:  # say where it hangs: the group's processes and what stderr said
            _, said_after = _until(lines, time.monotonic() + 1.0, None)
            pytest.fail(f"no exit {patient(30):.0f} s after ctrl-C; the group: {_group_state(proc.pid)}; stderr "
                        f"after the ctrl-C: {said_after!r}")
        time.sleep(1.0)
        assert _group_members(proc.pid, "multiprocessing.forkserver") == []  # generate ended it before exiting
        ended, rest = _until(lines, t0 + stop_bound, None)  # stderr ends when every process holding it has exited
        assert code == 130, rest
        assert "interrupted; every rank was stopped" in rest
        assert ended, f"a process of the command still held its stderr {stop_bound:.0f} s after ctrl-C: {rest}"
        deadline = t0 + stop_bound
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # anything left in the session (the rank processes, the forkserver)?
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("rank processes survived ctrl-C")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
