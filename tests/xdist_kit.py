"""The suite under pytest-xdist (`make test` runs `pytest -n N --dist loadgroup`, N one more than the cores;
docs/service.md#tests).

- Which xdist worker this process is (`gw0`, `gw1`, …; None when the run is not distributed), for the
  per-worker Postgres database names, Redis database number and key prefix (tests/conftest.py) and the
  per-worker TCP port ranges (`free_port`).
- `serial` tests have the CPU to themselves: they are one group, the first unit the schedule hands out, so
  one worker runs them before any other test, at the priority it started with, while every other worker
  lowers its own to the least (`nice 19`, `background()`) before its first test. The kernel then gives the
  other workers' processes (~1.5 % of a core against one at nice 0) only the CPU the serial tests leave idle
  (about two thirds of it: they mostly wait on deadlines), instead of leaving it unused while they run alone.
  Where the serial group reaches a worker that has already lowered its priority (the group handed out
  later, or a `--dist` of xdist's own), its tests run alone instead: they hold a lock the other workers'
  tests wait for (`SerialLock`, in a directory the controller makes and hands each worker: `Run`).
- The schedule: with `--dist loadgroup`, the tests of one file go to one worker together (its module
  fixtures, a running service or worker, are set up once), except in a file marked `split_by_param`, whose
  tests go out one parameter set at a time (each set starts its own module fixtures anyway: the vLLM
  engines), the `serial` tests are one group, first, and the
  files go out longest first (each test's time in the last run, kept in pytest's cache; else the file's
  average in tests/xdist_durations.json) so that no long file starts last (`make_scheduler`). xdist's own
  loadgroup reads `xdist_group` marks through a node-id suffix that pytest 9 no longer honours; the
  workers list their `serial` tests in the shared directory instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import socket
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", … in an xdist worker; None otherwise
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
SERIAL = "serial"
SPLIT_BY_PARAM = "split_by_param"
DURATIONS_KEY = "dtp-layout/xdist-test-seconds"
SHARED_KEY = "dtp_layout_shared_dir"  # in each worker's workerinput: the run's shared directory


def worker_index() -> int | None:
    """0, 1, … for the xdist workers gw0, gw1, …; None when the run is not distributed."""
    return int(WORKER[2:]) if WORKER and WORKER[2:].isdigit() else None


def worker_tag() -> str:
    """`gw0`, … in an xdist worker, else `main`: a part of each per-worker name (databases, key prefixes)."""
    return WORKER or "main"


# ---- TCP ports -----------------------------------------------------------------------------------------
# Each xdist worker takes its ports from a range of its own below Linux's ephemeral range (32768-60999), so
# two workers never pick the same port, and no outgoing connection (which takes an ephemeral port) can take
# a port between `free_port()` and the server's bind. Outside xdist: the kernel's choice, as before.
PORT_BASE, PORT_SPAN = 20000, 1000
_next_port: int | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now; under xdist, from this worker's own range."""
    global _next_port
    index = worker_index()
    if index is None or index >= (32768 - PORT_BASE) // PORT_SPAN:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    low = PORT_BASE + index * PORT_SPAN
    if _next_port is None:
        _next_port = random.randrange(PORT_SPAN)  # another run's worker of the same index starts elsewhere
    for _ in range(PORT_SPAN):
        port = low + _next_port % PORT_SPAN
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + PORT_SPAN - 1} for xdist worker {WORKER}")


# ---- serial tests ----------------------------------------------------------------------------------------

BACKGROUND_NICE = 19  # the least priority: CFS weight 15 against 1024 at nice 0


def background() -> bool:
    """Lower this process (and every process it starts from now on) to the least CPU priority, once; True
    when it is there. A process may always lower its priority, never raise it back without privileges."""
    try:
        current = os.nice(0)
        if current < BACKGROUND_NICE:
            os.nice(BACKGROUND_NICE - current)
        return True
    except OSError:
        return False


def in_foreground() -> bool:
    """Whether this process still has the priority it started with (it has not run `background()`)."""
    return os.nice(0) < BACKGROUND_NICE


class SerialLock:
    """A readers-writer lock over two files shared by the workers of one run (flock(2)): every test holds
    the main lock shared, a `serial` test holds it exclusively. A worker about to run a `serial` test takes
    the turnstile first and keeps it, so the other workers' next tests queue behind it (a stream of
    ordinary tests never starves it); it waits for the tests already running to end, then runs alone."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.turnstile = os.open(directory / "dtp-layout-serial.turnstile", os.O_RDWR | os.O_CREAT, 0o644)
        self.main = os.open(directory / "dtp-layout-serial.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.held: str | None = None  # None, "shared" or "exclusive"

    def shared(self) -> None:
        if self.held == "shared":
            return
        self.release()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.main, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.held = "shared"

    def exclusive(self) -> None:
        if self.held == "exclusive":
            return
        self.release()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.main, fcntl.LOCK_EX)
        self.held = "exclusive"

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            if self.held == "exclusive":
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            self.held = None


def param_unit(item: pytest.Item) -> str | None:
    """The work unit of a test of a `split_by_param` file: the file and its parameter set's id, or, where the
    mark names parameters (`split_by_param("engine")`), those parameters' values alone: a test parametrized
    further (`mode`) stays in its engine's unit, which starts the engine once. `unit=f` on the mark: the unit
    is f(those values) instead, so several parameter sets that share one load are one unit."""
    callspec = getattr(item, "callspec", None)
    mark = item.get_closest_marker(SPLIT_BY_PARAM)
    if callspec is None or mark is None:
        return None
    if mark.args:
        values = [callspec.params.get(n) for n in mark.args]
        unit = getattr(mark, "kwargs", {}).get("unit")
        return f"{item.nodeid.split('::', 1)[0]}[{unit(*values) if unit else ', '.join(map(repr, values))}]"
    return f"{item.nodeid.split('::', 1)[0]}[{callspec.id}]"


def is_serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker(SERIAL) is not None


# ---- the schedule ---------------------------------------------------------------------------------------

# Seconds per test by file, measured (tests/xdist_durations.json: a run's `--junitxml` averaged per file by
# `python -m tests.xdist_kit JUNIT.xml`): the order of the files on a fresh clone. Each run keeps its own
# tests' times in pytest's cache (.pytest_cache), which the next run's order uses first.
SEED = Path(__file__).with_name("xdist_durations.json")
DEFAULT_SECONDS = 1.0


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its xdist_group (`…@name`, as xdist writes it under loadgroup), else its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[-1]
    return nodeid.split("::", 1)[0]


def plain_nodeid(nodeid: str) -> str:
    """The node id without the `@group` suffix xdist adds under loadgroup."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


class Durations:
    """Seconds per test: this machine's last run (the cache), else the file's measured average (SEED)."""

    def __init__(self, config: pytest.Config) -> None:
        import json

        self.cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
        self.cached: dict[str, float] = dict(self.cache.get(DURATIONS_KEY, {})) if self.cache is not None else {}
        self.per_file: dict[str, float] = json.loads(SEED.read_text()) if SEED.is_file() else {}
        self.seen: dict[str, float] = {}

    def of(self, nodeid: str) -> float:
        nodeid = plain_nodeid(nodeid)
        if nodeid in self.cached:
            return self.cached[nodeid]
        return self.per_file.get(nodeid.split("::", 1)[0], DEFAULT_SECONDS)

    def add(self, report: pytest.TestReport) -> None:
        nodeid = plain_nodeid(report.nodeid)
        self.seen[nodeid] = self.seen.get(nodeid, 0.0) + report.duration

    def save(self) -> None:
        if self.cache is not None and self.seen:
            self.cache.set(DURATIONS_KEY, {**self.cached, **{k: round(v, 3) for k, v in self.seen.items()}})


def schedule_order(seconds: dict[str, float]) -> list[str]:
    """The work units in the order they go out: the `serial` group first, then the longest first."""
    return sorted(seconds, key=lambda unit: (unit != SERIAL, -seconds[unit]))


def make_scheduler(config: pytest.Config, log: Any, durations: Durations,
                   serial_ids: Callable[[], set[str]], param_units: Callable[[], dict[str, str]]) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        """loadgroup where a test without an xdist_group is grouped with its file and the `serial` tests are
        one group; the `serial` group goes out first (to the first worker, which runs it before any other
        test, while the others run theirs at the least priority), then the units longest first; a worker
        gets its next unit when it is down to its last test."""

        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.serial: set[str] = set()
            self.units: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            plain = plain_nodeid(nodeid)
            return SERIAL if plain in self.serial else self.units.get(plain) or unit_of(nodeid)

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed and self._check_nodes_have_same_collection():
                self.serial, self.units = serial_ids(), param_units()
                collection = next(iter(self.registered_collections.values()))
                units: dict[str, list[str]] = {}
                for nodeid in collection:
                    units.setdefault(self._split_scope(nodeid), []).append(nodeid)
                seconds = {u: sum(durations.of(n) for n in ids) for u, ids in units.items()}
                ordered = schedule_order(seconds)
                self.collection = list(collection)
                self.workqueue = OrderedDict((u, dict.fromkeys(units[u], False)) for u in ordered)
                for node in self.nodes:
                    if self.workqueue:
                        self._assign_work_unit(node)
                    else:
                        node.shutdown()  # more workers than units
                for node in self.nodes:
                    self._reschedule(node)
                return
            super().schedule()

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()  # no more work: it runs what it has, then stops
                return
            # down to its last test (a worker runs its last test once it knows the next, or is told to stop)
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return FileGroupScheduling(config, log)


class Run:
    """This process's part in the run: the controller (or a run without xdist) keeps the tests' times and
    makes the run's shared directory; a worker takes the serial lock there and lists its `serial` tests and
    the units of its `split_by_param` tests there for the controller's schedule (xdist tells the controller
    only the test ids)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.durations = Durations(config)
        self._shared: Path | None = None
        self.lock: SerialLock | None = None
        workerinput = getattr(config, "workerinput", None)
        if WORKER is not None and workerinput and SHARED_KEY in workerinput:
            self._shared = Path(workerinput[SHARED_KEY])
            self.lock = SerialLock(self._shared)

    def shared_dir(self) -> Path:
        if self._shared is None:
            self._shared = Path(tempfile.mkdtemp(prefix="dtp-layout-xdist-"))
        return self._shared

    def collected(self, items: list[pytest.Item]) -> None:
        if WORKER is None or self._shared is None:
            return
        units = {item.nodeid: unit for item in items if (unit := param_unit(item)) is not None}
        for name, listed in (("units", units), ("serial", [item.nodeid for item in items if is_serial(item)])):
            path = self._shared / f"{name}-{WORKER}.json"
            path.with_suffix(".tmp").write_text(json.dumps(listed))
            path.with_suffix(".tmp").replace(path)

    def serial_ids(self) -> set[str]:
        if self._shared is None:
            return set()
        return {nodeid for path in self._shared.glob("serial-*.json") for nodeid in json.loads(path.read_text())}

    def param_units(self) -> dict[str, str]:
        if self._shared is None:
            return {}
        return {nodeid: unit for path in self._shared.glob("units-*.json")
                for nodeid, unit in json.loads(path.read_text()).items()}

    def scheduler(self, log: Any) -> Any:
        return make_scheduler(self.config, log, self.durations, self.serial_ids, self.param_units)

    def add(self, report: pytest.TestReport) -> None:
        if WORKER is None:
            self.durations.add(report)

    def finish(self) -> None:
        if WORKER is None:
            self.durations.save()
            if self._shared is not None:
                shutil.rmtree(self._shared, ignore_errors=True)


def seed_from_junit(paths: list[str]) -> dict[str, float]:
    """Average seconds per test by file from JUnit XML files (`pytest --junitxml`)."""
    import xml.etree.ElementTree as ET

    totals: dict[str, list[float]] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").split(".")
            # classname: tests.app.api.test_abuse[.Class]; the file is the first part ending in test_*
            parts = []
            for part in module:
                parts.append(part)
                if part.startswith("test_"):
                    break
            file = "/".join(parts) + ".py"
            entry = totals.setdefault(file, [0.0, 0.0])
            entry[0] += float(case.get("time", 0) or 0)
            entry[1] += 1
    return {file: round(total / count, 3) for file, (total, count) in sorted(totals.items())}


if __name__ == "__main__":
    import json
    import sys

    SEED.write_text(json.dumps(seed_from_junit(sys.argv[1:]), indent=0, sort_keys=True) + "\n")
    print(f"wrote {SEED}")
