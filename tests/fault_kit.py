"""Private servers for the fault tests: a redis-server and a PostgreSQL cluster of their own, on free
ports, that a test stops (or freezes) and starts again. Never the shared servers on 6379 / 5432.

Missing binaries (or a PostgreSQL that cannot be run as an unprivileged user) skip the test with the
reason, or fail it when CI=true (tests/conftest.py's `server_unavailable`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from app.cli.supervisor import share_priority
from tests.service_kit import free_port


def _pg_bin() -> Path:
    """DTP_LAYOUT_TEST_PG_BIN, else Debian's newest /usr/lib/postgresql/N/bin, else the initdb on PATH."""
    if os.environ.get("DTP_LAYOUT_TEST_PG_BIN"):
        return Path(os.environ["DTP_LAYOUT_TEST_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
                   if p.parts[-3].isdigit() else 0)
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else Path("/usr/lib/postgresql/15/bin")


PG_BIN = _pg_bin()


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{what} not up after {timeout}s ({last!r})")


class PrivateRedis:
    """redis-server on a free port with an append-only file (a clean stop keeps queued messages, as a
    production Redis would); `stop()` shuts it down, `freeze()` SIGSTOPs it (accepts connections, never
    answers), `start()` brings it back on the same port and data."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        self.dir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        import redis

        assert self.binary is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 (owned by the subprocess)
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                      str(self.dir), "--save", "", "--appendonly", "yes", "--protected-mode", "no"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        share_priority(self.proc.pid)  # a session of its own: keep this test process's priority (xdist_kit)
        log.close()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=1)
        try:
            _wait(client.ping, 15, f"private redis-server on {self.port}")
        finally:
            client.close()
        return self

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class PrivatePostgres:
    """A PostgreSQL cluster made with initdb in a temporary directory, on a free port, trust
    authentication, fsync off (a test cluster). Run as the `postgres` user when this process is root
    (PostgreSQL refuses root). `stop()` is a fast shutdown (clients disconnected), `start()` restarts
    it on the same port and data."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="dtp-pg-"))
        self.data = self.dir / "data"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            self.as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.dir, "postgres")
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @staticmethod
    def unavailable() -> str | None:
        """Why a private cluster cannot be made here (None: it can)."""
        if not (PG_BIN / "initdb").is_file():
            return f"no initdb under {PG_BIN} (set DTP_LAYOUT_TEST_PG_BIN)"
        if os.geteuid() == 0 and (shutil.which("runuser") is None or not _user_exists("postgres")):
            return "running as root without runuser or a postgres user (PostgreSQL refuses to run as root)"
        return None

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run([*self.as_user, *args], check=True, timeout=timeout, capture_output=True)

    def init(self) -> PrivatePostgres:
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8")
        return self.start()

    def start(self) -> PrivatePostgres:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "server.log"), "-o", options,
                  "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True,
                             connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def forget_database(url: str) -> None:
    """Dispose of the process's engine for `url` (its pool holds connections to a server that is gone)."""
    from app.core import db as app_db
    database = app_db._databases.pop(url, None)
    if database is not None:
        database.dispose()
