"""Failures of what surrounds a job rather than of the job: a full storage volume and an unreachable
database. `worker.failures.ended_by` asks these before it decides how a job ends.

- Disk full: the job ends `failed` with "no space left on the storage volume …" (not the library's
  wording, which varies: numpy reports a short write without an errno, safetensors a Rust I/O error),
  and the attempt's work directory, partial files included, is removed: a failed job is not resumed,
  and the space is what the next job needs.
- Database unreachable: the job cannot be marked anything; it stays `running` under its lease, which
  expires, and a sweeper re-enqueues it once the database answers again (a retry, counted as an
  attempt). Marking it failed when the database happens to be back by the time the error is handled
  would turn a passing outage into a lost job.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

log = logging.getLogger("dtp_layout.worker")

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
LOW_SPACE_BYTES = 1 << 20  # after a failed write, less than this free on the volume: it filled up


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def free_bytes(path: Path) -> int | None:
    """Free bytes on the volume holding `path` (its nearest existing parent); None if unknown."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def disk_full(exc: BaseException, storage_root: Path) -> bool:
    """Whether `exc` is a write that failed for want of space on the storage volume: ENOSPC / EDQUOT
    anywhere in its chain, the words of those errors in a library's message, or an I/O error while
    the volume has (almost) nothing left."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return True
        if any(text in str(e).lower() for text in NO_SPACE_TEXT):
            return True
    # A write error without a telling errno (numpy's short write has none) on a volume with nothing left;
    # a missing or forbidden file (ENOENT, EACCES, …) is never taken for a full disk.
    if any(isinstance(e, OSError) and e.errno in (None, errno.EIO, errno.EFBIG) for e in _chain(exc)):
        free = free_bytes(storage_root)
        return free is not None and free < LOW_SPACE_BYTES
    return False


def no_space_message(stage: str | None, storage_root: Path) -> str:
    free = free_bytes(storage_root)
    left = "" if free is None else f" ({free / 2**20:.1f} MiB free when it failed)"
    return (f"no space left on the storage volume while {stage or 'preparing'}{left}; the job's partial files "
            "were removed: free space (or give STORAGE_ROOT a larger volume) and submit the job again")


def remove_work(work_dir: Path) -> None:
    """Remove a failed attempt's work directory (partial exports, blocks, layouts)."""
    shutil.rmtree(work_dir, ignore_errors=True)
    if work_dir.exists():
        log.warning("could not remove all of %s", work_dir)


def database_unreachable(exc: BaseException) -> bool:
    """Whether `exc` is the database going away (connection refused or lost, pool exhausted) rather
    than a statement it refused."""
    from sqlalchemy.exc import DBAPIError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    for e in _chain(exc):
        if isinstance(e, OperationalError | PoolTimeout):
            return True
        if isinstance(e, DBAPIError) and e.connection_invalidated:
            return True
    return False
