"""Artifact bytes in and out through the store: the S3 store (a real S3 API server: moto's
ThreadedMotoServer, in this process, over loopback HTTP) against the local directory.

- upload: the worker's publish of one finished file (`Storage.publish`'s S3 path, `S3Store.put_file`:
  sha256, then boto3's managed upload, multipart in 64 MiB parts) against `LocalStore.put_file` (a
  hashed copy into the root; the worker itself hard-links, which costs nothing);
- download through the API (`dtp-layout serve --no-worker`, one process per store, the client streaming
  the artifact with httpx and discarding it): local directory vs S3 streamed through the API vs S3
  with DTP_LAYOUT_STORAGE_REDIRECT (the client follows the 307 to the store). The first download of an
  object from an API process also hashes it (VerifiedFiles / VerifiedObjects): reported apart, the
  warm ones are the medians.

Variants are timed in turn, interleaved, `--repeats` times; the ratios are S3 / local (> 1: S3 slower).

    .venv/bin/python bench/store_throughput.py --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cli.supervisor import share_priority  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed(var: Path, objects: Any, blob: Path, digest: str) -> str:
    """A succeeded job whose one artifact (`blob`) is in `objects`; the API's database under `var`."""
    from app.core.db import Artifact, Job, database, utcnow
    from app.core.migrate import upgrade
    from app.core.storage.root import Storage

    var.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{var / 'dtp-layout.db'}"
    upgrade(url)
    job = Job(spec={"model": {"id": "bench"}}, fingerprint="b" * 64, model_id="bench", revision=None, devices=2,
              schedule="dtp:1", score="fo", status="succeeded", progress=1.0, stages_done=[], timings={}, owner=None,
              cancel_requested=False, affinity_cached=False, attempts=1, finished_at=utcnow(), summary={})
    with database(url).transaction() as session:
        session.add(job)
        session.flush()
        key = Storage.artifact_key(job.id, "shards/blob.bin")
        objects.put_file(blob, key, sha256=digest)
        session.add(Artifact(job_id=job.id, name="shards/blob.bin", kind="shards", size=blob.stat().st_size,
                             sha256=digest, storage_key=key))
        return job.id


def serve(var: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
    full.update(PYTHONPATH=str(REPO), DTP_LAYOUT_RATE_LIMIT_PER_MIN="0", **env)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--no-worker", "--port", str(port),
                             "--var-dir", str(var)], env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    share_priority(proc.pid)  # a session of its own: keep this process's nice value (supervisor.py)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API under {var} did not come up")


def download(url: str, job_id: str, size: int, sha256: str, *, check: bool) -> float:
    """Seconds to stream the artifact (following a redirect to the store, as the client does)."""
    t0 = time.perf_counter()
    h = hashlib.sha256() if check else None
    n = 0
    with httpx.Client(timeout=300, follow_redirects=True) as client, \
            client.stream("GET", f"{url}/v1/jobs/{job_id}/artifacts/shards/blob.bin") as response:
        response.raise_for_status()
        for block in response.iter_bytes(1 << 20):
            n += len(block)
            if h is not None:
                h.update(block)
    seconds = time.perf_counter() - t0
    assert n == size and (h is None or h.hexdigest() == sha256)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="artifact size in MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from app.core.storage.local import LocalStore
    from app.core.storage.s3 import S3Store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    os.environ.update(creds)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="dtp-store-bench-") as tmp:
        root = Path(tmp)
        blob = root / "blob.bin"
        with open(blob, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        size = blob.stat().st_size
        digest = hashlib.sha256(blob.read_bytes()).hexdigest() if args.mib <= 1024 else ""
        local, s3 = LocalStore(root / "local-store"), S3Store("bench", "dtp", client=client)

        up: dict[str, list[float]] = {"local": [], "s3": []}
        for i in range(args.repeats):
            for name, store in (("local", local), ("s3", s3)):
                t0 = time.perf_counter()
                store.put_file(blob, f"bench/up-{i}.bin")
                up[name].append(time.perf_counter() - t0)

        local_job = seed(root / "api-local", LocalStore(root / "api-local" / "storage"), blob, digest)
        s3_job = seed(root / "api-s3", s3, blob, digest)
        s3_env = {**creds, "AWS_ENDPOINT_URL": endpoint, "DTP_LAYOUT_STORAGE_URL": "s3://bench/dtp"}
        # the same database as the streaming S3 API's, another var dir (its broker, its empty storage root)
        redirect_env = {**s3_env, "DTP_LAYOUT_STORAGE_REDIRECT": "true",
                        "DTP_LAYOUT_DATABASE_URL": f"sqlite:///{root / 'api-s3' / 'dtp-layout.db'}"}
        try:
            apis = {}
            for name, var, env, job in (("local", root / "api-local", {}, local_job),
                                        ("s3", root / "api-s3", s3_env, s3_job),
                                        ("s3-redirect", root / "api-s3r", redirect_env, s3_job)):
                proc, url = serve(var, env)
                procs.append(proc)
                apis[name] = (url, job)
            first = {name: download(url, job, size, digest, check=True) for name, (url, job) in apis.items()}
            down: dict[str, list[float]] = {name: [] for name in apis}
            for _ in range(args.repeats):
                for name, (url, job) in apis.items():
                    down[name].append(download(url, job, size, digest, check=False))
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=30)
            server.stop()

    load = os.getloadavg()
    mib = size / (1 << 20)
    print(f"artifact {mib:.0f} MiB, {args.repeats} repeats (medians), load average {load[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"{'path':28} {'s':>8} {'MiB/s':>8}")
    rates: dict[str, float] = {}
    for label, times in (("upload local (copy+sha256)", up["local"]), ("upload s3 (sha256+put)", up["s3"]),
                         *((f"download {n}", t) for n, t in down.items())):
        s = statistics.median(times)
        rates[label] = mib / s
        print(f"{label:28} {s:8.2f} {mib / s:8.1f}")
    for name, s in first.items():
        print(f"first download {name} (verifies): {s:.2f} s")
    print(f"upload   s3 / local time ratio: {statistics.median(up['s3']) / statistics.median(up['local']):.2f}")
    for name in ("s3", "s3-redirect"):
        print(f"download {name} / local time ratio: "
              f"{statistics.median(down[name]) / statistics.median(down['local']):.2f}")


if __name__ == "__main__":
    main()
