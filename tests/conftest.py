"""Shared fixtures. Real-model fixtures load the packaged SmolLM2-135M once per session."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from tests import xdist_kit

# Intra-op threads: the cores, at most 2, shared among the xdist workers (`make test` runs 2 on 2 cores: one
# thread each); a `serial` test, which has the CPU to itself, gets them all (pytest_runtest_protocol below).
TORCH_THREADS = max(1, min(2, os.cpu_count() or 1))
WORKER_THREADS = max(1, TORCH_THREADS // max(1, xdist_kit.WORKER_COUNT))
torch.set_num_threads(WORKER_THREADS)

# The model commands keep converted GGUF copies (models.io.converted) and the concatenated corpus under
# $DTP_LAYOUT_CACHE_DIR: this session's, and the processes it starts, go to a directory of its own, never
# into the user's cache (set here, at import, so that every subprocess inherits it).
TEST_CACHE_DIR = tempfile.mkdtemp(prefix="dtp-layout-test-cache-")
os.environ["DTP_LAYOUT_CACHE_DIR"] = TEST_CACHE_DIR


# A suite started in the background of a non-interactive shell (`make test &`) starts with SIGINT ignored: the
# shell ignores it for background jobs, Python then installs no KeyboardInterrupt handler, and every process
# the suite starts inherits the ignored signal through exec, so a test of ctrl-C would see its command ignore
# the ctrl-C. The suite's processes get SIGINT's usual handling however it was started (at import: in the
# controller and in each xdist worker, before any test starts a process).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(TEST_CACHE_DIR, ignore_errors=True)
    if _xdist is not None:
        _xdist.finish()


# Tests marked `long` are the bench-scale variants of proofs whose short version runs by default (`make test`
# stays under its time budget on 2 cores); `make test-long` (DTP_LAYOUT_TEST_LONG=1) runs them too.
LONG_TESTS = os.environ.get("DTP_LAYOUT_TEST_LONG") == "1"


def pytest_collection_modifyitems(config, items):
    if _xdist is not None:
        _xdist.collected(items)
    if LONG_TESTS:
        return
    skip = pytest.mark.skip(reason="a bench-scale variant: set DTP_LAYOUT_TEST_LONG=1 (make test-long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


# ---- pytest-xdist (tests/xdist_kit.py) ------------------------------------------------------------------

_xdist: xdist_kit.Run | None = None


def pytest_configure(config):
    global _xdist
    _xdist = xdist_kit.Run(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The controller: each worker is told the run's shared directory (the serial lock, the serial tests)."""
    assert _xdist is not None
    node.workerinput[xdist_kit.SHARED_KEY] = str(_xdist.shared_dir())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a `serial` test has the CPU to itself (tests/xdist_kit.py): on the worker that runs the
    serial group first, at the priority it started with, while every other test runs at the least
    priority; on a worker already at the least priority, alone: the other workers' tests wait until it (and
    the `serial` tests right after it on this worker) have finished, teardown included. It has every core."""
    lock = _xdist.lock if _xdist is not None else None
    if lock is None:
        return (yield)
    serial = xdist_kit.is_serial(item)
    if serial:
        if not xdist_kit.in_foreground():
            lock.exclusive()
        torch.set_num_threads(TORCH_THREADS)
    else:
        xdist_kit.background()
        lock.shared()
    try:
        return (yield)
    finally:
        if not (serial and xdist_kit.is_serial(nextitem)):
            torch.set_num_threads(WORKER_THREADS)
            lock.release()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: a file's tests together on one worker, the longest files first, the `serial`
    tests one group, first (tests/xdist_kit.py). Other --dist modes are xdist's own."""
    if config.getvalue("dist") == "loadgroup" and _xdist is not None:
        return _xdist.scheduler(log)
    return None


def pytest_runtest_logreport(report):
    if _xdist is not None:  # the controller (or a run without xdist): each test's time, for the next order
        _xdist.add(report)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, gguf path) of the real pretrained SmolLM2-135M-Instruct (dequantised, fp32)."""
    from models.io.assets import AssetNotFoundError, smollm2_gguf
    from models.io.loading import ModelSource, load_model, load_tokenizer

    try:
        path = smollm2_gguf()
    except AssetNotFoundError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(exc))
    source = ModelSource(str(path))
    return load_model(source, device="cpu"), load_tokenizer(source), Path(path)


# ---- servers for the service tests: a fresh Postgres database and an isolated Redis key space -----
#
# Tests marked `postgres` / `redis` need the real servers on 127.0.0.1 (override with
# DTP_LAYOUT_TEST_POSTGRES_URL / DTP_LAYOUT_TEST_REDIS_URL). Unreachable: skipped, or failed when CI=true.
# The terminal summary lists the server-backed tests that were skipped and why.
#
# Under pytest-xdist each worker is a session of its own: its databases are named with its id
# (`dtp_api_gw1_…`), and its broker keys live in a Redis database of its own (gw0: 1, gw1: 2, …; the URL's
# own database without xdist) under a prefix of its own, so two workers never see each other's rows, queues
# or keys.

SERVER_MARKERS = ("postgres", "redis", "worker", "browser")
POSTGRES_ADMIN_URL = os.environ.get("DTP_LAYOUT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("DTP_LAYOUT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_DATABASES = 16  # Redis's default `databases`


def worker_redis_url(url: str) -> str:
    """`url` with this xdist worker's own database number (the URL's number + 1 + the worker's index, modulo
    16); the URL as it is without xdist."""
    from urllib.parse import urlsplit, urlunsplit

    index = xdist_kit.worker_index()
    if index is None:
        return url
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(base + 1 + index) % REDIS_DATABASES}"))


def server_unavailable(what: str, reason: str) -> None:
    message = f"{what} unreachable ({reason}); start it (see .ci/run) to run the service tests"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def _psycopg_dsn(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class PostgresServer:
    """Creates uniquely named databases through the maintenance connection and drops them at the end."""

    def __init__(self, admin_url: str) -> None:
        import psycopg

        self.admin_url = admin_url
        self.conn = psycopg.connect(_psycopg_dsn(admin_url), autocommit=True, connect_timeout=3)
        self.created: list[str] = []

    def create_database(self, prefix: str = "dtp_test") -> str:
        import uuid

        from sqlalchemy.engine import make_url

        name = f"{prefix}_{xdist_kit.worker_tag()}_{uuid.uuid4().hex[:12]}"
        self.conn.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        from app.core import db as app_db
        for url, database in list(app_db._databases.items()):
            if any(name in url for name in self.created):
                database.dispose()
                del app_db._databases[url]
        for name in self.created:
            self.conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.conn.close()


@pytest.fixture(scope="session")
def postgres_server():
    try:
        server = PostgresServer(POSTGRES_ADMIN_URL)
    except Exception as exc:
        server_unavailable("PostgreSQL", f"{POSTGRES_ADMIN_URL}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    yield server
    server.drop_all()


@pytest.fixture(scope="session")
def postgres_url(postgres_server):
    """A fresh database for this test session, migrated to head."""
    from app.core.migrate import upgrade

    url = postgres_server.create_database()
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def redis_broker():
    """(broker URL, key prefix): every broker key of this session carries the prefix; deleted at the end.
    Under xdist the URL names this worker's own Redis database and the prefix names the worker."""
    import uuid

    import redis

    url = worker_redis_url(REDIS_URL)
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except Exception as exc:
        server_unavailable("Redis", f"{url}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    prefix = f"dtp-test-{xdist_kit.worker_tag()}-{uuid.uuid4().hex[:12]}:"
    yield url, prefix
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


# Sections of the terminal summary: skipped tests carrying one of these markers, with the reason.
SKIP_SECTIONS = {"server-backed tests skipped": SERVER_MARKERS, "GPU tests skipped": ("gpu",),
                 "install tests skipped": ("install",), "long variants skipped": ("long",)}


@pytest.fixture
def inject_faults():
    """`inject_faults(stage_delay_s=…, hang_stage=…)`: the worker code run in this process has slow or
    hung stages (tests/faults.py) until the test ends."""
    from tests.faults import Faults, install

    undo = []
    yield lambda **faults: undo.append(install(Faults(**faults)))
    for restore in reversed(undo):
        restore()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for title, markers in SKIP_SECTIONS.items():
        skipped = []
        for report in terminalreporter.stats.get("skipped", []):
            if not any(marker in getattr(report, "keywords", {}) for marker in markers):
                continue
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))
        if skipped:
            terminalreporter.section(title)
            for nodeid, reason in skipped:
                terminalreporter.write_line(f"{nodeid}: {reason}")


# ---- a real S3 API server (moto's ThreadedMotoServer): tests/s3_kit.py --------------------------------
from tests.s3_kit import s3_bucket, s3_server  # noqa: E402, F401
