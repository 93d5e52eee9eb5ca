"""The ranks' process group: rendezvous with timeouts, heartbeats, and naming the rank that failed.

Every rank joins a torch.distributed group (gloo on CPU, NCCL on GPUs) through a TCP store that
outlives the ranks: the launcher hosts it (`models.runtime.launcher`), or torchrun's agent does. A
heartbeat thread bumps `hb/<rank>` in the store a few times a second. When a collective fails or
times out, the rank reads which peers recorded an error (`failed/<rank>`) or stopped beating, and
raises a `RankFailure` that names them, instead of hanging or printing a bare gloo error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from models.runtime.errors import RankFailure

HEARTBEAT_S = 0.2
_PREFIX = "dtp-runtime"


def _key(namespace: str, what: str, rank: int) -> str:
    return f"{_PREFIX}/{namespace}/{what}/{rank}"


class RankGroup:
    """This rank's membership of the group (one per process)."""

    def __init__(self, *, rank: int, world_size: int, backend: str, store: Any, timeout_s: float,
                 namespace: str = "0", local_rank: int | None = None) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout_s = timeout_s
        self.namespace = namespace
        self.store = store
        if backend == "nccl":
            self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._stop = threading.Event()
        self._rounds = 0  # agreement rounds: every rank takes the same sequence, so the keys line up
        self._heartbeat = threading.Thread(target=self._beat, args=(store.clone(),), name="dtp-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, store=dist.PrefixStore(f"{_PREFIX}/{namespace}/pg", store),
                                    rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=self.device if backend == "nccl" else None)
        except Exception as exc:
            self._stop.set()
            raise RankFailure(f"rank {rank}: joining the {backend} group of {world_size} ranks failed "
                              f"(timeout {timeout_s:g} s): {_short(exc)}") from exc

    @classmethod
    def from_env(cls, *, backend: str, timeout_s: float) -> RankGroup:
        """Join as torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) asks."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(host, port, world_size=None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        namespace = f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-" \
                    f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(rank=rank, world_size=world, backend=backend, store=store, timeout_s=timeout_s,
                   namespace=namespace, local_rank=int(os.environ.get("LOCAL_RANK", rank)))

    # ---- heartbeats and failure reports ------------------------------------------------------------
    def _beat(self, store: Any) -> None:
        key = _key(self.namespace, "hb", self.rank)
        last_ok = time.monotonic()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
                last_ok = time.monotonic()
            except Exception as exc:
                # The store lives in the launcher (or torchrun's agent): gone for this long, nobody is
                # left to report to, so this rank must not linger as an orphan.
                if time.monotonic() - last_ok > max(10.0, self.timeout_s):
                    print(f"dtp-runtime rank {self.rank}: lost the rendezvous store ({_short(exc)}); exiting",
                          file=sys.stderr, flush=True)
                    os._exit(3)

    def _beats_of(self, rank: int) -> int:
        return int(self.store.add(_key(self.namespace, "hb", rank), 0))

    def record_failure(self, message: str) -> None:
        """Tell the other ranks why this one is about to exit (best effort)."""
        with contextlib.suppress(Exception):
            self.store.set(_key(self.namespace, "failed", self.rank), message[:2000])

    def reported_failures(self) -> dict[int, str]:
        out = {}
        for r in range(self.world_size):
            key = _key(self.namespace, "failed", r)
            try:
                if r != self.rank and self.store.check([key]):
                    out[r] = self.store.get(key).decode(errors="replace")
            except Exception:
                pass
        return out

    def unresponsive(self, window_s: float = 5 * HEARTBEAT_S) -> list[int]:
        """Ranks whose heartbeat did not move during `window_s` (dead, stopped or wedged)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = {r: self._beats_of(r) for r in others}
            time.sleep(window_s)
            return [r for r in others if self._beats_of(r) == before[r]]
        except Exception:
            return []

    def lost(self, during: str, exc: BaseException, *, waiting_for: list[int] | None = None,
             waited_s: float | None = None) -> RankFailure:
        """A RankFailure for a collective that failed or timed out, naming the peers to blame."""
        failed = self.reported_failures()
        silent = [r for r in self.unresponsive() if r not in failed]
        culprits = [f"rank {r} failed: {msg}" for r, msg in sorted(failed.items())]
        culprits += [f"rank {r} stopped responding (died or hung)" for r in silent]
        slow = [r for r in waiting_for or [] if r not in failed and r not in silent]
        culprits += [f"rank {r} did not get there within {waited_s or self.timeout_s:g} s" for r in slow]
        if not culprits:
            culprits = [f"no peer is known to have failed (collective timeout {self.timeout_s:g} s)"]
        return RankFailure(f"rank {self.rank}: {during} failed: {'; '.join(culprits)} [{_short(exc)}]")

    # ---- agreement and collectives outside the forward -----------------------------------------------
    def agree(self, error: str | None, during: str, *, timeout_s: float | None = None) -> list[tuple[int, str]]:
        """Every rank's error (or None) of a step all ranks take; returns [(rank, error)] of those that failed.

        Through the store rather than a collective, so that its own timeout applies: loading (hashing
        and reading a large shard) may take some ranks much longer than the collective timeout.
        """
        self._rounds += 1
        keys = [_key(self.namespace, f"agree-{self._rounds}", r) for r in range(self.world_size)]
        wait_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + wait_s
        progress: dict[int, tuple[int, float]] = {}  # a missing rank's heartbeat count, and since when
        try:
            self.store.set(keys[self.rank], json.dumps(error))
        except Exception as exc:
            raise self.lost(during, exc) from exc
        while True:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=1.0))
                break
            except Exception as exc:  # not there yet: give up on a rank whose heartbeat stopped, or at the limit
                now = time.monotonic()
                missing = [r for r, key in enumerate(keys) if not self._has(key)]
                stalled = False
                for r in missing:
                    beats = self._beats_or_none(r)
                    if r not in progress or beats != progress[r][0]:
                        progress[r] = (beats if beats is not None else -1, now)
                    stalled |= now - progress[r][1] > 10 * HEARTBEAT_S
                if stalled or now > deadline:
                    raise self.lost(during, exc, waiting_for=missing, waited_s=wait_s) from exc
        try:
            answers = [json.loads(self.store.get(key)) for key in keys]
        except Exception as exc:
            raise self.lost(during, exc) from exc
        return [(r, e) for r, e in enumerate(answers) if e is not None]

    def _beats_or_none(self, rank: int) -> int | None:
        try:
            return self._beats_of(rank)
        except Exception:
            return None

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def gather_objects(self, obj: Any, during: str) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj)
        except Exception as exc:
            raise self.lost(during, exc) from exc
        return gathered

    def broadcast_object(self, obj: Any, during: str) -> Any:
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            raise self.lost(during, exc) from exc
        return box[0]

    def stop_heartbeat(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]
