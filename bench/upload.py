"""Upload throughput through the API against the store's own write, and the cost of resuming.

Starts `dtp-layout serve --no-worker` (embedded default: SQLite, the local store under its var dir; or,
with `--store s3`, moto's ThreadedMotoServer in this process as the S3 store), writes a file of
`--mb` MiB of random bytes, and measures:

- the store's own write of the file (`ObjectStore.put_file`: what a worker publishing an artifact
  pays), on a store of the same kind;
- `dtp-layout client upload` of the file through the API (hash, declare, every part streamed, complete
  with the sha256 verified), MiB/s and the ratio to the store's write;
- the same upload interrupted half-way (the client stopped inside a part), then resumed: the bytes
  the resume sent and its time.

    .venv/bin/python bench/upload.py --mb 100
    .venv/bin/python bench/upload.py --mb 100 --store s3

One run, one machine: the figures are for the machine's load at the time (printed with them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.cli.supervisor import share_priority  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(var: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--no-worker", "--port", str(port),
                             "--var-dir", str(var)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    share_priority(proc.pid)  # a session of its own: keep this process's nice value (supervisor.py)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("then: curl"):
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, f"http://127.0.0.1:{port}"
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("dtp-layout serve did not come up")


class Stop(Exception):
    pass


def measure(url: str, path: Path, size: int) -> dict[str, Any]:
    from app.client.http import LayoutClient
    from app.client.uploads import upload_path

    with LayoutClient(url, timeout=600) as client:
        t0 = time.perf_counter()
        done = upload_path(client, path, name="whole")
        whole_s = time.perf_counter() - t0
        client.delete_upload(done["id"])

        sent = 0

        def stop_half_way(n: int) -> None:
            nonlocal sent
            sent += n
            if sent > size // 2:
                raise Stop

        t0 = time.perf_counter()
        with contextlib.suppress(Stop):
            upload_path(client, path, name="resumed", on_bytes=stop_half_way)
        first_s = time.perf_counter() - t0
        resumed_bytes = 0

        def count(n: int) -> None:
            nonlocal resumed_bytes
            resumed_bytes += n

        t0 = time.perf_counter()
        done = upload_path(client, path, name="resumed", on_bytes=count)
        resume_s = time.perf_counter() - t0
        client.delete_upload(done["id"])
    return {"upload_s": whole_s, "upload_mib_s": size / whole_s / 2**20, "interrupted_after_s": first_s,
            "resume_s": resume_s, "resume_sent_bytes": resumed_bytes, "part_size": done["part_size"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--store", choices=("local", "s3"), default="local")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dtp-upload-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DTP_LAYOUT_UPLOAD_MAX_BYTES=str(64 << 30))
    moto = None
    proc = None
    try:
        size = args.mb << 20
        path = work / "payload.bin.txt"
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        if args.store == "s3":
            import boto3
            from moto.server import ThreadedMotoServer

            port = _free_port()
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            moto.start()
            creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
            os.environ.update(creds)
            boto3.client("s3").create_bucket(Bucket="bench")
            env.update(creds, DTP_LAYOUT_STORAGE_URL="s3://bench/dtp")
            from app.core.storage.s3 import S3Store

            store: Any = S3Store("bench", "baseline")
        else:
            from app.core.storage.local import LocalStore

            store = LocalStore(work / "baseline")
        t0 = time.perf_counter()
        store.put_file(path, "baseline/payload.bin")
        store_s = time.perf_counter() - t0
        proc, url = _serve(work / "var", env)
        result = measure(url, path, size)
        result.update(store=args.store, mib=args.mb, store_put_s=store_s, store_mib_s=size / store_s / 2**20,
                      ratio_api_to_store=store_s / result["upload_s"], loadavg=os.getloadavg())
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
