"""Load on the layout service's API: p50/p95/p99 per endpoint, errors and requests/s.

It starts the API itself (unless `--url` names a running one) in one of two shapes, seeds it with
finished jobs (rows and artifact files written straight to the database and the storage root: no
model work), makes one API key per client (tenants of `--keys-per-tenant` keys), and drives it with
a mix of job polls, listings, scores, layouts, artifact listings and downloads (whole, and 64 KiB
`Range` reads of a 1 MiB file), submissions and cancels, from one asyncio process with httpx:

- `--backend postgres`: the production shape: `uvicorn app.api.main:create_app --factory --workers W`
  (W = `--workers`, default the CPU count) on a fresh database of the Postgres server, Redis as the
  broker under a private key prefix (both removed at the end);
- `--backend sqlite`: the embedded default, `dtp-layout serve --no-worker` (SQLite, the SQLite
  broker, one process). No worker runs in either: submitted jobs stay queued, and each client
  cancels its job before it submits another.

Two modes (`--mode open,closed` runs both on the same server):

- open loop: C clients (`--clients`, default 200) each send requests at random (Poisson) times,
  `--rate` per second each (default 1): arrivals never wait for answers (200 CI jobs polling at
  1 Hz). A request's latency runs from the moment it was *scheduled*, so a server (or generator)
  that falls behind shows in the percentiles instead of slowing the arrivals (no coordinated
  omission). The generator reports its own lag (start − scheduled) and its event loop's lag: when
  those are small it is not the bottleneck.
- closed loop: C clients each send the next request as soon as the previous one is answered: the
  saturation throughput (requests/s) and the latencies at it.

    .venv/bin/python bench/load.py --backend postgres --mode open --clients 200 --duration 60
    .venv/bin/python bench/load.py --backend sqlite --mode open,closed --clients 200 --duration 60
    .venv/bin/python bench/load.py --url http://127.0.0.1:8000 --api-key KEY ...   (a running server)

Every figure is printed with the machine's load average (a shared machine: read them together).
`--json FILE` writes everything; `--profile DIR` records the server processes with py-spy (when
installed) during the first mode's measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.cli.supervisor import share_priority  # noqa: E402
from bench.load_http import CLIENT_ERRORS, HttpxHTTP, RawHTTP  # noqa: E402
from bench.server_backing import create_backing, drop_backing  # noqa: E402

MODEL = "tiny"
CALIB = "calib/ids.npy"
BLOB_BYTES = 1 << 20
RANGE_BYTES = 64 << 10
# What the clients do, by weight; "submit" is a cancel when the client's last job is still queued.
MIX = {"job poll": 50, "list": 10, "scores": 10, "layouts": 6, "artifacts": 6, "download": 5, "download range": 9,
       "submit": 4}
EXPECTED = {"job poll": 200, "list": 200, "scores": 200, "layouts": 200, "artifacts": 200, "download": 200,
            "download range": 206, "submit": 202, "cancel": 202}
# A llama config the submit-time checks read (no weights: no worker runs here).
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 48,
               "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
               "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def spec() -> dict[str, Any]:
    return {"model": {"id": MODEL}, "devices": 2, "delta": 1,
            "calibration": {"source": CALIB, "sequences": 8, "seq_len": 32}, "random_layouts": 1,
            "export": {"checkpoint": True, "shards": True}}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the server under test ---------------------------------------------------------------------------

@dataclass
class Seeded:
    keys: list[tuple[str, str]]  # (key, tenant), one per client
    jobs: dict[str, list[str]]  # tenant → finished job ids


class Server:
    """The API in a subprocess over a fresh database and storage root, seeded; removed on close."""

    def __init__(self, backend: str, *, workers: int, clients: int, keys_per_tenant: int, jobs_per_tenant: int,
                 log_format: str, api_threads: int | None = None, server_env: dict[str, str] | None = None) -> None:
        self.backend, self.workers = backend, workers
        self.root = Path(tempfile.mkdtemp(prefix="dtp-load-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.database: str | None = None
        self.redis_prefix: str | None = None
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
        env.update(DTP_LAYOUT_VAR_DIR=str(self.root / "var"), DTP_LAYOUT_LOG_FORMAT=log_format,
                   # one queued job per client at a time (it cancels before it submits again)
                   DTP_LAYOUT_MAX_ACTIVE_JOBS=str(keys_per_tenant + 1),
                   # the limiter runs but never refuses: the closed loop measures saturation, not the limit
                   # (the open loop's 1 request/s per key is far below the default 600/min anyway)
                   DTP_LAYOUT_RATE_LIMIT_PER_MIN="1000000", DTP_LAYOUT_RATE_LIMIT_BURST="100000")
        if api_threads is not None:
            env["DTP_LAYOUT_API_THREADS"] = str(api_threads)
        env.update(server_env or {})
        if backend == "postgres":
            env.update(self._postgres())
        self.env = env
        self.settings = self._settings()
        self.seeded = self._seed(clients, keys_per_tenant, jobs_per_tenant)

    def _postgres(self) -> dict[str, str]:
        self.database, self.redis_prefix, env = create_backing("load")
        return env

    def _settings(self) -> Any:
        from app.core.migrate import upgrade
        from app.core.settings import Settings

        old = {k: os.environ.get(k) for k in self.env if k.startswith("DTP_LAYOUT_")}
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("DTP_LAYOUT_")})
        try:
            settings = Settings()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for d in (settings.var_dir, settings.storage, settings.models_dir / MODEL, settings.data_dir / "calib"):
            d.mkdir(parents=True, exist_ok=True)
        upgrade(settings.database_url)
        (settings.models_dir / MODEL / "config.json").write_text(json.dumps(TINY_CONFIG))
        import numpy as np

        np.save(settings.data_dir / CALIB, np.random.default_rng(0).integers(0, 97, size=4096))
        return settings

    def _seed(self, clients: int, keys_per_tenant: int, jobs_per_tenant: int) -> Seeded:
        """Per tenant: `jobs_per_tenant` succeeded jobs with two layouts and two artifacts (report.json and a
        1 MiB shards/blob.bin); one key per client."""
        from app.core.db import Artifact, Job, LayoutRow, database, utcnow
        from app.core.events import SUBMITTED, record
        from app.core.keys import create_key
        from app.core.storage.root import Storage

        db = database(self.settings.database_url)
        storage = Storage(self.settings.storage)
        tenants = [f"tenant-{t:03d}" for t in range((clients + keys_per_tenant - 1) // keys_per_tenant)]
        keys = [(create_key(db, name=f"client-{i:04d}", tenant=tenants[i // keys_per_tenant]),
                 tenants[i // keys_per_tenant]) for i in range(clients)]
        blob = random.Random(0).randbytes(BLOB_BYTES)
        report = json.dumps({"format": "dtp-layout-report/1", "layouts": {"optimised": 3.5}}).encode()
        jobs: dict[str, list[str]] = {}
        with db.transaction() as session:
            for tenant in tenants:
                for _ in range(jobs_per_tenant):
                    job = Job(spec=spec(), fingerprint="f" * 64, model_id=MODEL, revision=None, devices=2,
                              schedule="dtp:1", score="fo", status="succeeded", owner=tenant, progress=1.0,
                              stages_done=["loading", "calibration", "affinity", "optimising", "exporting"],
                              timings={"loading": 0.4, "calibration": 1.2, "affinity": 8.5, "optimising": 2.0,
                                       "exporting": 1.1}, cancel_requested=False,
                              affinity_cached=False, attempts=1, finished_at=utcnow(),
                              summary={"tokens": 256, "random_expectation": 2.5, "upper_bound": 4.0})
                    session.add(job)
                    session.flush()
                    record(session, job.id, SUBMITTED)  # what a listed job's view reads (device, timeline)
                    jobs.setdefault(tenant, []).append(job.id)
                    for name, data in (("report.json", report), ("shards/blob.bin", blob)):
                        key = Storage.artifact_key(job.id, name)
                        path = storage.path(key)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(data)
                        session.add(Artifact(job_id=job.id, name=name, kind="shards", size=len(data),
                                             sha256=hashlib.sha256(data).hexdigest(), storage_key=key))
                    for name, value in (("optimised", 3.5), ("contiguous", 2.4)):
                        session.add(LayoutRow(job_id=job.id, name=name, J=value, random_expectation=2.5,
                                              upper_bound=4.0, upper_bound_exact=True, up_fraction=[0.5] * 3,
                                              down_fraction=[0.5] * 3, kv_group_device=[[0, 0, 1, 1]] * 3,
                                              neuron_device=[[0] * 48 + [1] * 48] * 3,
                                              shape={"model_type": "llama", "num_layers": 3, "num_kv_groups": 4,
                                                     "num_query_heads": 8, "intermediate_size": 96,
                                                     "hidden_size": 48, "head_dim": 6}, score={"J": value}))
        db.dispose()
        return Seeded(keys=keys, jobs=jobs)

    def command(self) -> list[str]:
        if self.backend == "postgres":
            return [sys.executable, "-m", "uvicorn", "app.api.main:create_app", "--factory", "--host", "127.0.0.1",
                    "--port", str(self.port), "--workers", str(self.workers), "--no-access-log",
                    "--timeout-keep-alive", "30",
                    "--log-level", "warning"]
        return [sys.executable, "-m", "app.cli.main", "serve", "--no-worker", "--port", str(self.port), "--var-dir",
                str(self.settings.var_dir), "--log-level", "warning"]

    def start(self, timeout: float = 90.0) -> None:
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 (the subprocess owns it)
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        share_priority(self.proc.pid)  # a session of its own: keep this process's nice (tests/xdist_kit.py)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    # every uvicorn worker answers: a few more probes warm them all
                    for _ in range(4 * self.workers):
                        httpx.get(f"{self.url}/healthz", timeout=5)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not answer /healthz in {timeout} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def pids(self) -> list[int]:
        """The server process and its children (uvicorn's workers)."""
        if self.proc is None:
            return []
        out = [self.proc.pid]
        with contextlib.suppress(OSError, ValueError):
            for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
                out.append(int(child))
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's processes so far."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        drop_backing(self.database, self.redis_prefix)
        shutil.rmtree(self.root, ignore_errors=True)


# ---- HTTP clients: bench/load_http.py ---------------------------------------------------------------

# ---- the clients -------------------------------------------------------------------------------------

@dataclass
class Results:
    latency: dict[str, list[float]] = field(default_factory=dict)  # endpoint → seconds (scheduled → answered)
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # endpoint → status (or exception) → n
    errors: dict[str, int] = field(default_factory=dict)
    lag: list[float] = field(default_factory=list)  # open loop: seconds between scheduled and sent
    error_samples: list[str] = field(default_factory=list)
    timeline: list[tuple[float, str, float]] = field(default_factory=list)  # (scheduled, endpoint, seconds)

    def record(self, endpoint: str, seconds: float, outcome: str, ok: bool, scheduled: float = 0.0) -> None:
        self.latency.setdefault(endpoint, []).append(seconds)
        self.timeline.append((scheduled, endpoint, seconds))
        by = self.statuses.setdefault(endpoint, {})
        by[outcome] = by.get(outcome, 0) + 1
        if not ok:
            self.errors[endpoint] = self.errors.get(endpoint, 0) + 1


class Client:
    """One simulated CI client: its key and tenant, its tenant's finished jobs, its own queued job."""

    def __init__(self, key: str, tenant: str, jobs: list[str], rng: random.Random) -> None:
        self.headers = {"X-API-Key": key}
        self.tenant, self.jobs, self.rng = tenant, jobs, rng
        self.own: str | None = None
        self.busy = False  # a submit or cancel in flight (open loop: the next one waits for it)
        self.http: RawHTTP | HttpxHTTP | None = None

    def pick(self) -> tuple[str, str, str, dict[str, str]]:
        """(endpoint, method, path, extra headers) of the next request."""
        endpoint = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        job = self.rng.choice(self.jobs)
        if endpoint == "submit":
            if self.busy:
                endpoint = "job poll"
            elif self.own is not None:
                return "cancel", "POST", f"/v1/jobs/{self.own}/cancel", {}
            else:
                return "submit", "POST", "/v1/jobs", {}
        if endpoint == "job poll":
            target = self.own if self.own is not None and self.rng.random() < 0.5 else job
            return endpoint, "GET", f"/v1/jobs/{target}", {}
        if endpoint == "list":
            return endpoint, "GET", "/v1/jobs?limit=20", {}
        if endpoint == "scores":
            return endpoint, "GET", f"/v1/scores?model={MODEL}&devices=2&delta=1", {}
        if endpoint == "layouts":
            return endpoint, "GET", f"/v1/jobs/{job}/layouts", {}
        if endpoint == "artifacts":
            return endpoint, "GET", f"/v1/jobs/{job}/artifacts", {}
        if endpoint == "download":
            return endpoint, "GET", f"/v1/jobs/{job}/artifacts/report.json", {}
        start = self.rng.randrange(0, BLOB_BYTES - RANGE_BYTES)
        return endpoint, "GET", f"/v1/jobs/{job}/artifacts/shards/blob.bin", {
            "Range": f"bytes={start}-{start + RANGE_BYTES - 1}"}

    async def request(self, results: Results | None, scheduled: float) -> None:
        http = self.http
        assert http is not None
        endpoint, method, path, extra = self.pick()
        if endpoint in ("submit", "cancel"):
            self.busy = True
        try:
            body = json.dumps(spec()).encode() if endpoint == "submit" else b""
            response = await http.request(method, path, {**self.headers, **extra}, body)
            outcome, ok = str(response.status), response.status == EXPECTED[endpoint]
            if endpoint == "download range" and ok and len(response.body) != RANGE_BYTES:
                outcome, ok = "short body", False
            if endpoint == "submit" and ok:
                self.own = response.json()["id"]
            elif endpoint == "cancel" and response.status in (202, 409):
                self.own = None
            if not ok and results is not None and len(results.error_samples) < 20:
                results.error_samples.append(f"{endpoint} {response.status}: {response.body[:200]!r}")
        except CLIENT_ERRORS as exc:
            outcome, ok = type(exc).__name__, False
            if results is not None and len(results.error_samples) < 20:
                results.error_samples.append(f"{endpoint} {type(exc).__name__}: {exc}")
        finally:
            if endpoint in ("submit", "cancel"):
                self.busy = False
        if results is not None:
            results.record(endpoint, time.perf_counter() - scheduled, outcome, ok, scheduled)


async def loop_lag(stop: asyncio.Event, samples: list[float], tick: float = 0.01) -> None:
    """How late the event loop wakes a 10 ms sleeper: the generator's own saturation."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(tick)
        samples.append(time.perf_counter() - t0 - tick)


async def run_mode(mode: str, url: str, clients: list[Client], *, duration: float, warmup: float,
                   rate: float, client: str = "raw", timeline: Path | None = None) -> dict[str, Any]:
    results = Results()
    lag_samples: list[float] = []
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        for c in clients:
            c.http = RawHTTP(url) if client == "raw" else HttpxHTTP(url)
            stack.push_async_callback(c.http.close)
        t_start = time.perf_counter()
        t_measure = t_start + warmup
        t_end = t_measure + duration
        pending: set[asyncio.Task[None]] = set()

        async def open_client(c: Client) -> None:
            at = time.perf_counter() + c.rng.expovariate(rate)
            while at < t_end:
                delay = at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                measuring = at >= t_measure
                if measuring:
                    results.lag.append(time.perf_counter() - at)
                task = asyncio.create_task(c.request(results if measuring else None, at))
                pending.add(task)
                task.add_done_callback(pending.discard)
                at += c.rng.expovariate(rate)

        async def closed_client(c: Client) -> None:
            while (now := time.perf_counter()) < t_end:
                await c.request(results if now >= t_measure else None, now)

        async def progress() -> None:
            while not stop.is_set():
                await asyncio.sleep(10)
                done = sum(len(v) for v in results.latency.values())
                print(f"  … {time.perf_counter() - t_start:.0f} s: {done} answered, {len(pending)} in flight, "
                      f"{sum(results.errors.values())} errors", file=sys.stderr, flush=True)

        lagger = asyncio.create_task(loop_lag(stop, lag_samples))
        reporter = asyncio.create_task(progress())
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        runner = open_client if mode == "open" else closed_client
        await asyncio.gather(*(runner(c) for c in clients))
        if pending:
            _, late = await asyncio.wait(pending, timeout=35)
            for task in late:  # still unanswered 35 s after the end: counted as what they are, unanswered
                task.cancel()
            results.errors["unanswered"] = len(late)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
        reporter.cancel()
        await lagger
        wall = time.perf_counter() - t_start
    if timeline is not None:  # one line per request: when it was scheduled (s from the start), what, how long
        head = f"# start {t_start:.4f} (time.perf_counter, CLOCK_MONOTONIC)\n"
        timeline.write_text(head + "".join(f"{at - t_start:.4f},{endpoint},{seconds * 1000:.1f}\n"
                                           for at, endpoint, seconds in sorted(results.timeline)))
    return summarise(mode, results, duration=duration, lag_samples=lag_samples,
                     generator_cpu=(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[min(998, max(0, round(q * 1000) - 1))]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.50) * 1000, 1), "p95": round(percentile(values, 0.95) * 1000, 1),
            "p99": round(percentile(values, 0.99) * 1000, 1), "max": round(max(values, default=0) * 1000, 1)}


def summarise(mode: str, results: Results, *, duration: float, lag_samples: list[float],
              generator_cpu: float) -> dict[str, Any]:
    endpoints = {}
    everything: list[float] = []
    for name in [*EXPECTED]:
        values = results.latency.get(name, [])
        if not values:
            continue
        everything += values
        endpoints[name] = {"n": len(values), "errors": results.errors.get(name, 0), **_ms(values),
                           "statuses": results.statuses.get(name, {})}
    total = len(everything)
    return {"mode": mode, "requests": total, "errors": sum(results.errors.values()),
            "requests_per_s": round(total / duration, 1), "all": _ms(everything), "endpoints": endpoints,
            "generator": {"send_lag_ms": _ms(results.lag) if results.lag else None,
                          "loop_lag_ms": _ms(lag_samples), "cpu_fraction": round(generator_cpu, 3)},
            "error_samples": results.error_samples}


def print_report(report: dict[str, Any]) -> None:
    head = (f"{report['mode']} loop, {report['clients']} clients"
            + (f" at {report['rate']}/s each" if report["mode"] == "open" else "")
            + f", {report['duration_s']} s: {report['requests']} requests, {report['requests_per_s']} req/s, "
              f"{report['errors']} errors; load average {report['loadavg_before']} → {report['loadavg_after']}")
    print(head)
    print(f"  {'endpoint':<16}{'n':>7}{'errors':>8}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    rows = [*report["endpoints"].items(), ("all", {"n": report["requests"], "errors": report["errors"],
                                                   **report["all"]})]
    for name, e in rows:
        print(f"  {name:<16}{e['n']:>7}{e['errors']:>8}{e['p50']:>9}{e['p95']:>9}{e['p99']:>9}{e['max']:>9}")
    gen = report["generator"]
    lag = gen["send_lag_ms"]
    print(f"  generator: cpu {gen['cpu_fraction']:.0%} of a core, event-loop lag p99 {gen['loop_lag_ms']['p99']} ms"
          + (f", send lag p99 {lag['p99']} ms (max {lag['max']})" if lag else "")
          + (f"; server cpu {report['server_cpu_s_per_s']:.2f} cores" if report.get("server_cpu_s_per_s") else ""))
    for sample in report["error_samples"][:5]:
        print(f"  error: {sample}")


# ---- main --------------------------------------------------------------------------------------------

def start_profile(server: Server, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy not installed: no profile (pip install py-spy)", file=sys.stderr)
        return None
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([spy, "record", "--pid", str(server.proc.pid if server.proc else 0), "--subprocesses",
                             "--duration", str(int(seconds)), "--rate", "200", "--format", "raw", "--gil",
                             "--output", str(out / "profile.txt"), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_summary(path: Path, top: int = 30) -> str:
    """The share of py-spy's samples (raw format: `frame;frame;… count` per line) in which each function
    is on the stack (inclusive) and at the top (self)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(":")[0] + ")" if " (" in f else f for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] = inclusive.get(name, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    lines = [f"py-spy: {total} samples of GIL-holding threads; inclusive:"]
    scaffolding = ("process ", "spawn_main", "<module>", "multiprocessing/", "asyncio/", "uvicorn/server.py",
                   "uvicorn/_subprocess.py", "uvicorn/supervisors/", "Thread._bootstrap", "Thread.run")
    ranked = [(name, n) for name, n in sorted(inclusive.items(), key=lambda kv: -kv[1])
              if not any(mark in name for mark in scaffolding)]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in ranked[:top]]
    lines += ["self:"] + [f"  {100 * n / total:5.1f}%  {name}"
                          for name, n in sorted(own.items(), key=lambda kv: -kv[1])[:15]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    p.add_argument("--mode", default="open", help="open, closed, or open,closed (one after the other)")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rate", type=float, default=1.0, help="open loop: requests per second per client")
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured per mode")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--start-timeout-s", type=float, default=90.0,
                   help="how long the server may take to answer /healthz (a wait on readiness: it ends as soon as "
                        "the server answers, or exits; longer on a busy machine)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="uvicorn workers (postgres backend)")
    p.add_argument("--keys-per-tenant", type=int, default=10)
    p.add_argument("--jobs-per-tenant", type=int, default=5)
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--api-threads", type=int, help="DTP_LAYOUT_API_THREADS of the server (default: its default)")
    p.add_argument("--url", help="drive this running server instead (its own jobs: --job IDs; --api-key)")
    p.add_argument("--api-key", default="", help="with --url: the key every client uses")
    p.add_argument("--job", action="append", default=[], help="with --url: finished job ids to read")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--profile", type=Path, help="py-spy the server during the first mode (raw stacks here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting of the server (e.g. DTP_LAYOUT_ACCESS_LOG=false); repeatable")
    p.add_argument("--timeline", type=Path, help="write `scheduled s,endpoint,ms` per request of the first mode")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="the generator's HTTP client: raw (asyncio streams, lean) or httpx")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if not modes or any(m not in ("open", "closed") for m in modes):
        p.error("--mode: open, closed or open,closed")

    def terminate(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # `timeout` and kill: still drop the database and stop the server

    signal.signal(signal.SIGTERM, terminate)
    server = None
    try:
        if args.url:
            url = args.url.rstrip("/")
            if not args.job:
                p.error("--url needs --job (finished job ids with report.json and shards/blob.bin)")
            seeded = Seeded(keys=[(args.api_key, "given")] * args.clients, jobs={"given": args.job})
        else:
            server = Server(args.backend, workers=args.workers, clients=args.clients,
                            keys_per_tenant=args.keys_per_tenant, jobs_per_tenant=args.jobs_per_tenant,
                            log_format=args.log_format, api_threads=args.api_threads,
                            server_env=dict(kv.split("=", 1) for kv in args.server_env))
            server.start(args.start_timeout_s)
            url, seeded = server.url, server.seeded
        rng = random.Random(args.seed)
        clients = [Client(key, tenant, seeded.jobs[tenant], random.Random(rng.random()))
                   for key, tenant in seeded.keys]
        reports = []
        for i, mode in enumerate(modes):
            spy = start_profile(server, args.profile, args.warmup + args.duration) if (
                args.profile and server and i == 0) else None
            before, cpu0 = loadavg(), server.cpu_seconds() if server else 0.0
            report = asyncio.run(run_mode(mode, url, clients, duration=args.duration, warmup=args.warmup,
                                          rate=args.rate, client=args.client,
                                          timeline=args.timeline if i == 0 else None))
            report.update(clients=len(clients), rate=args.rate, client=args.client, duration_s=args.duration,
                          loadavg_before=before,
                          loadavg_after=loadavg(), backend=args.backend if server else url,
                          workers=args.workers if server and args.backend == "postgres" else 1,
                          cpu_count=os.cpu_count(),
                          server_cpu_s_per_s=round((server.cpu_seconds() - cpu0) / (args.duration + args.warmup), 2)
                          if server else None)
            if spy is not None:
                spy.wait(timeout=args.warmup + args.duration + 60)
            print_report(report)
            if spy is not None and (args.profile / "profile.txt").is_file():
                summary = profile_summary(args.profile / "profile.txt")
                (args.profile / "summary.txt").write_text(summary + "\n")
                print(summary)
            reports.append(report)
        if args.json:
            args.json.write_text(json.dumps({"command": " ".join(sys.argv), "reports": reports}, indent=2))
        if server is not None and server.log().strip():
            print("the server's log (tail):\n" + server.log()[-3000:], file=sys.stderr)
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
