"""Hostile uploads (issue 26): what each costs the API, what the others see meanwhile, and what a data
file's size costs the worker.

1. Each hostile case of tests/app/api/test_hostile_uploads.py sent to the API (uvicorn in a subprocess,
   SQLite, the local store): the answer, its time, and the API process's peak RSS before and after.
2. A second tenant's `GET /v1/jobs` latency (p50 / p99 / max over its requests) alone, then while N
   hostile tenants keep completing slow uploads (a GGUF whose 2,000,000-string array is walked in the
   check's child process) for `--seconds`; the hostile answers by status.
3. The worker's reader (models.data.calibration.load_blocks, 2 × 64 tokens) in a fresh process per file:
   the peak RSS it adds for .npy files of 4 KiB to 3 GiB and text files of 1 to 256 MiB.

    .venv/bin/python bench/hostile_uploads.py                 # N = 4 hostile tenants, 15 s
    .venv/bin/python bench/hostile_uploads.py --hostile 8 --seconds 30

One run, one machine: the figures are for the machine's load at the time (printed with them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.hostile_kit import (  # noqa: E402 (after the path)
    Service,
    gguf,
    gguf_array,
    gguf_entry,
    gguf_string,
    model,
    nested,
    panicking_tokenizer,
    safetensors,
)

SLOW_STRINGS = 2_000_000


def cases() -> dict[str, tuple[str, dict[str, bytes]]]:
    """name → (kind, files) of every parsing case of the issue."""
    big_header = b",".join(b'"t%07d":{}' % i for i in range(3 << 19))[: 17 << 20]
    return {
        "49-byte GGUF, array of 2^62 UINT8": ("model", {"m.gguf": gguf([gguf_array("a", 0, 1 << 62)])}),
        "10 MB GGUF, array of 10^7 UINT8": ("model", {"m.gguf": gguf([
            gguf_entry("general.architecture", 8, gguf_string(b"llama")),
            gguf_array("tokenizer.ggml.token_type", 0, 10**7, b"\1" * 10**7)])}),
        "safetensors declaring a 100 MiB header": ("model", {**model(
            model__safetensors=struct.pack("<Q", 100 << 20) + b"{}")}),
        "safetensors with a 17 MiB header of empty entries": ("model", model(model__safetensors=safetensors(
            b"{" + big_header[: big_header.rfind(b",")] + b"}"))),
        "config.json nested 100,000 deep": ("model", model(config=nested(100_000))),
        "safetensors header nested 100,000 deep": ("model", model(
            model__safetensors=safetensors(b'{"a": ' + nested(100_000) + b"}"))),
        "NaN in config.json": ("model", model(config=b'{"model_type": "llama", "rope_theta": NaN}')),
        "config.json without intermediate_size, MAX_MODEL_PARAMS=10^6": ("model", model(config=json.dumps(
            {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 256}).encode())),
        "tokenizer.json splitting on (a|aa)+$": ("model", model(tokenizer__json=panicking_tokenizer("(a|aa)+$"))),
    }


def each_case(service: Service) -> list[dict[str, Any]]:
    rows = []
    for name, (kind, files) in cases().items():
        upload_id = service.send("hostile", kind, files)
        before = service.peak_rss_mib()
        response, took = service.complete("hostile", upload_id)
        rows.append({"case": name, "status": response.status_code, "ms": round(took * 1e3),
                     "api_peak_rss_mib": [round(before), round(service.peak_rss_mib())],
                     "message": response.json().get("message", "")[:200]})
        print(f"  {name}: {response.status_code} in {took * 1e3:.0f} ms, API peak RSS {before:.0f} → "
              f"{service.peak_rss_mib():.0f} MiB: {rows[-1]['message'][:120]}")
    return rows


def latencies(service: Service, stop: threading.Event) -> list[float]:
    times = []
    with service.client("other") as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/v1/jobs").status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {"requests": len(ms), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1), "max_ms": round(ms[-1], 1)}


def bystander_under_load(service: Service, hostile: int, seconds: float) -> dict[str, Any]:
    slow = {"slow.gguf": gguf([gguf_array("tokenizer.ggml.tokens", 8, SLOW_STRINGS, gguf_string(b"") * SLOW_STRINGS)])}
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        alone = pool.submit(latencies, service, stop)
        time.sleep(min(seconds, 5))
        stop.set()
        baseline = summary(alone.result())
    tenants = [f"h{i}" for i in range(hostile)]
    pending = {t: [service.send(t, "model", slow) for _ in range(3)] for t in tenants}
    answers: dict[int, int] = {}
    stop = threading.Event()

    def attack(tenant: str) -> None:
        while not stop.is_set() and pending[tenant]:
            response, _took = service.complete(tenant, pending[tenant][0])
            answers[response.status_code] = answers.get(response.status_code, 0) + 1
            if response.status_code == 422:
                pending[tenant].pop(0)
            else:
                time.sleep(float(response.headers.get("Retry-After", "1")))

    with concurrent.futures.ThreadPoolExecutor(hostile + 1) as pool:
        watched = pool.submit(latencies, service, stop)
        attackers = [pool.submit(attack, t) for t in tenants]
        time.sleep(seconds)
        stop.set()
        for a in attackers:
            a.result()
        loaded = summary(watched.result())
    return {"alone": baseline, "with_hostile": loaded, "hostile_answers": answers}


_READ = """
import json, sys
from models.data.calibration import CalibrationSpec, load_blocks
from tests.tiny import byte_tokenizer
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
tokenizer = byte_tokenizer()
before = peak()
load_blocks(CalibrationSpec(sys.argv[1], sequences=2, seq_len=64), tokenizer)
print(json.dumps({"before_kib": before, "after_kib": peak()}))
"""


def worker_memory(root: Path) -> list[dict[str, Any]]:
    files = []
    for mib in (0, 30, 300, 3000):
        path = root / f"ids-{mib}MiB.npy"
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(max(4096, mib << 20),))
        arr[:4096] = 7
        del arr
        files.append(path)
    line = "a line of text " * 70 + "\n"
    for mib in (1, 64, 256):
        path = root / f"text-{mib}MiB.txt"
        with path.open("w") as f:
            for _ in range(mib):
                f.write(line * ((1 << 20) // len(line) + 1))
        files.append(path)
    rows = []
    for path in files:
        out = subprocess.run([sys.executable, "-c", _READ, str(path)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"file": path.name, "size_mib": round(path.stat().st_size / (1 << 20), 1),
                     "peak_rss_mib": round(got["after_kib"] / 1024), "added_mib": round(
                         (got["after_kib"] - got["before_kib"]) / 1024, 1)})
        print(f"  {rows[-1]}")
        path.unlink()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostile", type=int, default=4, help="hostile tenants completing slow uploads at once")
    ap.add_argument("--seconds", type=float, default=15.0, help="how long they keep at it")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        root = Path(tmp)
        service = Service(root / "api", {"key_cache_s": 0, "rate_limit_per_min": 0, "upload_part_bytes": 5 << 20,
                                         "max_model_params": 10**6},
                          tenants=["hostile", "other", *(f"h{i}" for i in range(args.hostile))])
        try:
            print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
            print("each case:")
            rows = each_case(service)
            print(f"a second tenant's GET /v1/jobs, alone and with {args.hostile} hostile tenants:")
            under_load = bystander_under_load(service, args.hostile, args.seconds)
            print(f"  {under_load}")
        finally:
            service.stop()
        print("the worker's reader, 2 × 64 tokens from files of each size:")
        memory = worker_memory(root)
    figures = {"cases": rows, "bystander": under_load, "worker_memory": memory,
               "load_average": os.getloadavg()[0]}
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
