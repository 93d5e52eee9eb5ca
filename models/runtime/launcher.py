"""Start one process per rank on this machine and drive them: the runtime's Python API.

    from models.runtime import DTPRuntime
    with DTPRuntime.start("runs/smollm2/shards") as rt:          # L processes, gloo on CPU
        out = rt.generate_text("In the beginning", max_new_tokens=32)
        print(out.text[0], out.ms_per_token)
        tp = rt.generate_text("In the beginning", schedule_override="tp")  # the same shards timed as TP

The launcher hosts the rendezvous store (so it outlives any rank), starts the ranks
(torch.multiprocessing; `forkserver` with the rank code preloaded, `spawn` where there is no
forkserver), and talks to each over a pipe. Every command goes to all ranks;
the launcher waits for every reply while watching the processes: a rank that dies makes the
others fail their next collective with an error naming it (`models.runtime.group`), the launcher
collects those errors, stops what is left and raises `RankFailure`. Manifest and shape mismatches
are `ShardError` and leave the ranks running (with the previous model, if any). KeyboardInterrupt
(ctrl-C, a notebook's interrupt) stops every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import signal
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.runtime.errors import RankFailure, RuntimeStopped, ShardError
from models.runtime.generation import GenerateRequest, GenerationResult, LoadInfo
from models.schedules.grammar import dtp_text

BACKENDS = ("auto", "gloo", "nccl")
WAIT_SLICE_S = 0.25  # the longest the launcher waits on its ranks before it looks at pending signals


def resolve_backend(backend: str, world_size: int) -> str:
    """auto: NCCL when there is one GPU per rank, else gloo on CPU."""
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world_size):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"backend nccl needs one GPU per rank: {world_size} ranks, {have} GPU(s) visible "
                         "(use --backend gloo on CPU)")
    return backend


def manifest_devices(shards_dir: str | Path) -> int:
    """L from manifest.json (the default world size), without reading anything else."""
    import json

    path = Path(shards_dir) / "manifest.json"
    if not path.is_file():
        raise ShardError(f"{path}: missing (expected the shards/ directory `export` writes, with manifest.json)")
    try:
        devices = json.loads(path.read_text()).get("devices")
    except (OSError, ValueError, AttributeError) as exc:
        raise ShardError(f"{path}: cannot read the shard manifest: {exc}") from exc
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ShardError(f"{path}: field 'devices' must be a positive integer, got {devices!r}")
    return devices


def _context(mp: Any) -> Any:
    """forkserver where there is one: a server process imports torch and the rank code once, and every rank
    (of this and any later runtime of this process) is forked from it, so L ranks do not each pay the
    imports; spawn elsewhere. Neither forks this process itself, whose torch threads (or CUDA) may be live."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "models.runtime.rank"])
    return ctx


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _kill_all(processes: list[Any]) -> None:
    """SIGTERM, then SIGKILL, every rank process still alive (a finalizer: no reference to the runtime)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped (SIGSTOP) rank takes its SIGTERM only once resumed
    deadline = time.monotonic() + 5.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)


def stop_forkserver() -> None:
    """End this process's forkserver now (SIGKILL), for a process about to exit (`dtp-layout generate`).

    Left to itself, the forkserver notices its parent's exit and shuts its interpreter down, with torch
    imported: 7 s on a loaded 2-core machine, and longer the more loaded, during which it still holds the
    command's process group and its stderr (a `| tee` or a test reading stderr to the end waits for it).
    It holds no state worth a clean exit: a later runtime of a process that goes on would start a new one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        server._stop()  # type: ignore[attr-defined]  # closes its pipe, reaps it, forgets it (multiprocessing's own way to stop it)


class DTPRuntime:
    """L rank processes running inference on rank shards under their communication schedule (DTP, TP, …)."""

    def __init__(self, processes: list[Any], conns: list[Any], store: Any, *, backend: str,
                 timeout_s: float, pids: list[int]) -> None:
        self._processes = processes
        self._conns = conns
        self._store = store  # hosts the rendezvous and the heartbeats: must outlive the ranks
        self.backend = backend
        self.timeout_s = timeout_s
        self.pids = pids
        self.world_size = len(processes)
        self.info: LoadInfo | None = None
        self._tokenizer: Any = None
        self._stopped = False
        self._finalizer = weakref.finalize(self, _kill_all, processes)

    # ---- start / stop --------------------------------------------------------------------------------
    @classmethod
    def start(cls, shards_dir: str | Path | None = None, *, world_size: int | None = None, backend: str = "auto",
              timeout_s: float = 60.0, start_timeout_s: float = 180.0, threads: int | None = None) -> DTPRuntime:
        """Spawn the ranks and join them into one group; load `shards_dir` if given.

        world_size defaults to the manifest's L. timeout_s bounds every collective (and so the time to
        notice a hung rank); start_timeout_s bounds the start-up (process start, imports, rendezvous).
        threads: torch threads per rank (default: the CPU count split over the ranks).
        """
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if world_size is None:
            if shards_dir is None:
                raise ValueError("give shards_dir or world_size")
            world_size = manifest_devices(shards_dir)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError("timeout_s and start_timeout_s must be positive")
        backend = resolve_backend(backend, world_size)
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        namespace = uuid.uuid4().hex[:12]
        ctx = _context(mp)
        processes, conns = [], []
        from models.runtime.rank import rank_main

        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, name=f"dtp-rank-{rank}", daemon=True,
                               args=(rank, world_size, child, "127.0.0.1", store.port, namespace, backend,
                                     timeout_s, threads))
            proc.start()
            child.close()
            processes.append(proc)
            conns.append(parent)
        runtime = cls(processes, conns, store, backend=backend, timeout_s=timeout_s,
                      pids=[int(p.pid or 0) for p in processes])
        try:
            replies = runtime._collect("start-up", start_timeout_s, expect="ready")
            runtime.pids = [r["pid"] for r in replies]
            if shards_dir is not None:
                runtime.load(shards_dir)
        except BaseException:
            runtime._terminate()
            raise
        return runtime

    def stop(self, *, force: bool = False) -> None:
        """Ask every rank to leave the group and exit; whatever does not within 10 s is killed.

        force: terminate the ranks at once (what ctrl-C does), e.g. in the middle of a command.
        """
        if self._stopped:
            return
        if force:
            self._terminate()
            return
        self._stopped = True
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop", None))
        deadline = time.monotonic() + 10.0
        for p in self._processes:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill_all(self._processes)
        self._close()

    def _terminate(self) -> None:
        self._stopped = True
        _kill_all(self._processes)
        self._close()

    def _close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._finalizer.detach()

    @property
    def alive(self) -> bool:
        return not self._stopped and all(p.is_alive() for p in self._processes)

    def __enter__(self) -> DTPRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- commands ------------------------------------------------------------------------------------
    def load(self, shards_dir: str | Path) -> LoadInfo:
        """Every rank checks and loads its shard of `shards_dir`; ShardError (ranks kept) on any mismatch."""
        # No deadline here: the ranks bound the load themselves (rank.LOAD_TIMEOUT_S) and the launcher
        # watches the processes.
        replies = self._command("load", str(Path(shards_dir).resolve()), deadline_s=None)
        self.info = replies[0]
        self._tokenizer = None
        return self.info

    def generate(self, input_ids: Any, *, max_new_tokens: int = 32, schedule: str | None = None,
                 schedule_override: str | None = None, delta: int | None = None, last_scale: str = "sqrt",
                 temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                 stop_at_eos: bool = True, stop_ids: Sequence[int] | None = None, link_latency_us: float = 0.0,
                 return_logits: bool = False) -> GenerationResult:
        """Generate from token ids ([S] or [B, S]): prefill, then cached decoding on every rank.

        schedule: the communication schedule (`models.schedules.grammar`): None runs the shards' own (the
        manifest's); another one is refused (ShardError naming both). schedule_override runs the
        shards at another schedule anyway, e.g. "tp" (a blocking all-reduce after every module) as
        the timing baseline; its tokens are not the exported model's. delta=δ is short for
        schedule_override="dtp:δ" (0: tensor parallelism). temperature 0 is greedy; otherwise sampled with
        `seed` (top_k optional). stop_at_eos stops once every sequence has produced the config's EOS
        (or one of `stop_ids`, when given).
        link_latency_us delays each collective's completion (an emulated slow link).
        return_logits: also the prefill logits [B, S, V] and each decode step's [B, V].
        """
        info = self._loaded()
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        stops = tuple(int(t) for t in (info.eos_token_ids if stop_ids is None else stop_ids)) if stop_at_eos else ()
        if sum(x is not None for x in (schedule, schedule_override, delta)) > 1:
            raise ValueError("give at most one of schedule, schedule_override and delta (short for "
                             "schedule_override='dtp:δ')")
        if delta is not None:
            if not isinstance(delta, int) or isinstance(delta, bool) or delta < 0:
                raise ValueError(f"delta must be a non-negative integer (0 = tensor parallelism), got {delta!r}")
            schedule_override = dtp_text(delta)
        request = GenerateRequest(ids, max_new_tokens, schedule=schedule or schedule_override,
                                  override=schedule_override is not None, last_scale=last_scale,
                                  temperature=temperature, top_k=top_k, seed=seed, stop_ids=stops,
                                  link_latency_us=link_latency_us, return_logits=return_logits)
        request = request.checked(info)  # refuse a bad request here, before any rank sees it
        replies = self._command("generate", request, deadline_s=None)
        result: GenerationResult = replies[0]
        tokenizer = self.tokenizer
        if tokenizer is not None:
            result.text = [tokenizer.decode(row, skip_special_tokens=True) for row in result.tokens.tolist()]
        return result

    def generate_text(self, prompt: str, **kwargs: Any) -> GenerationResult:
        """Tokenize `prompt` with the tokenizer saved beside the shards, then `generate(...)`."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{self._loaded().shards_dir} has no tokenizer: pass token ids to generate()")
        ids = tokenizer(prompt, return_tensors="np")["input_ids"]
        if ids.size == 0:
            raise ValueError("the prompt encodes to no tokens")
        return self.generate(ids, **kwargs)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer saved beside the shards (None when there is none)."""
        info = self._loaded()
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(info.shards_dir)
        return None if self._tokenizer is False else self._tokenizer

    def _loaded(self) -> LoadInfo:
        if self.info is None:
            raise RuntimeStopped("no shards loaded: call load(shards_dir) first")
        return self.info

    # ---- talking to the ranks ------------------------------------------------------------------------
    def _command(self, command: str, payload: Any, *, deadline_s: float | None) -> list[Any]:
        if self._stopped:
            raise RuntimeStopped("the runtime was stopped: start a new one")
        dead = [(r, p.exitcode) for r, p in enumerate(self._processes) if not p.is_alive()]
        if dead:
            self._terminate()
            raise RankFailure("; ".join(f"rank {r} {_describe_exit(code)} while idle" for r, code in dead)
                              + ": the runtime was stopped")
        for conn in self._conns:
            conn.send((command, payload))
        return self._collect(command, deadline_s)

    def _collect(self, during: str, deadline_s: float | None, expect: str = "ok") -> list[Any]:
        """Every rank's reply to one command, watching the processes while waiting."""
        n = self.world_size
        replies: dict[int, tuple[str, Any]] = {}
        exits: dict[int, int | None] = {}
        now = time.monotonic()
        deadline = None if deadline_s is None else now + deadline_s
        # Once a rank has died or failed, the others get this long to report their side (a collective that
        # loses a peer fails at once; one that waits on a hung peer fails at the collective timeout).
        grace_s = min(self.timeout_s, 10.0) + 3.0
        grace_end: float | None = None
        try:
            while len(replies) + len(exits) < n:
                waiting = [r for r in range(n) if r not in replies and r not in exits]
                ends = [t for t in (deadline, grace_end) if t is not None]
                left = max(0.0, min(ends) - time.monotonic()) if ends else None
                # Never one unbounded wait: a ctrl-C the kernel delivers to another thread of this process (the
                # rendezvous store's) only sets Python's flag, and the main thread acts on it once its wait returns.
                ready = multiprocessing.connection.wait(
                    [self._conns[r] for r in waiting] + [self._processes[r].sentinel for r in waiting],
                    WAIT_SLICE_S if left is None else min(left, WAIT_SLICE_S))
                if not ready:
                    if left is not None and left <= WAIT_SLICE_S:
                        break  # the deadline (or the grace after a failure) has passed
                    continue
                for r in waiting:
                    conn, proc = self._conns[r], self._processes[r]
                    try:
                        if conn.poll():
                            replies[r] = conn.recv()
                            if replies[r][0] == "rank_failure" and grace_end is None:
                                grace_end = time.monotonic() + grace_s
                            continue
                    except (EOFError, OSError):
                        pass  # the pipe closed: the process is going away
                    if not proc.is_alive():
                        proc.join(1.0)
                        exits[r] = proc.exitcode
                        if grace_end is None:
                            grace_end = time.monotonic() + grace_s
        except KeyboardInterrupt:
            self._terminate()
            raise
        failures = [(r, msg) for r, (kind, msg) in sorted(replies.items()) if kind == "rank_failure"]
        if exits or failures or len(replies) < n:
            parts = [f"rank {r} {_describe_exit(code)}" for r, code in sorted(exits.items())
                     if replies.get(r, ("",))[0] != "rank_failure"]
            parts += [msg for _, msg in failures]
            silent = [r for r in range(n) if r not in replies and r not in exits]
            if silent:
                waited = f"{grace_s:g} s after the first failure" if grace_end is not None else f"{deadline_s:g} s"
                parts.append(f"rank(s) {', '.join(map(str, silent))} did not answer {during!r} (waited {waited})")
            self._terminate()
            raise RankFailure(f"{during} failed: " + "; ".join(parts) + "; every rank was stopped")
        kinds = {kind for kind, _ in replies.values()}
        if "shard_error" in kinds:  # every rank raised the same combined message (they agreed first)
            raise ShardError(next(msg for k, msg in replies.values() if k == "shard_error"))
        if "value_error" in kinds:
            raise ValueError(next(msg for k, msg in replies.values() if k == "value_error"))
        assert kinds == {expect}, kinds
        return [replies[r][1] for r in range(n)]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(shards_dir: str | Path) -> bool:
    """Whether `export` saved a tokenizer beside the shards (without it, transformers may build an empty one)."""
    return any((Path(shards_dir) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(shards_dir: str | Path) -> Any:
    """The tokenizer `export` saved beside the shards, or False when there is none."""
    from transformers import AutoTokenizer

    if not has_tokenizer(shards_dir):
        return False
    try:
        return AutoTokenizer.from_pretrained(str(shards_dir), trust_remote_code=False)
    except (OSError, ValueError, TypeError):
        return False
