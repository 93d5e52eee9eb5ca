"""What a flood of `/readyz` (no key needed) costs another tenant (issue 41: 40 clients at 117 req/s moved a
tenant's p50 from 25 to 216 ms, every call a database and a broker round trip on a request thread).

The API under uvicorn in a subprocess (tests/hostile_kit.Service: SQLite, the embedded broker, default
settings but the keys and the rate limit off: what each /readyz costs, not the 429s the limit would answer), a
tenant's `GET /v1/jobs` asked in a loop for `--seconds` alone, then again while `--clients` threads ask
`/readyz` (`--rate` per second in all, or as fast as they are answered); the tenant's p50 / p99 and the
flood's answers per second by status. Run from a checkout to measure that checkout's API (uvicorn imports `app` from
the working directory):

    .venv/bin/python bench/readyz_flood.py --clients 40 --rate 117 --seconds 10 [--database-url postgresql+psycopg://… \
        --broker-url redis://127.0.0.1:6379/0]
    (cd OLD_CHECKOUT && /work/main/.venv/bin/python /work/main/bench/readyz_flood.py --clients 40 --seconds 10)

One run, one machine: a 2-core machine shared with the load generator; the ratios, not the milliseconds,
are what carries over.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.getcwd())  # the checkout being measured (its tests.hostile_kit, its app)
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tests.hostile_kit import Service  # after the path


def tenant_latencies(service: Service, seconds: float) -> list[float]:
    times = []
    with service.client("other") as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert client.get("/v1/jobs").status_code == 200
            times.append(time.perf_counter() - t0)
    return times


def flood(url: str, stop: threading.Event, codes: collections.Counter, interval: float) -> None:
    """Ask /readyz every `interval` seconds (0: as fast as it is answered)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        due = time.monotonic()
        while not stop.is_set():
            codes[client.get("/readyz").status_code] += 1
            due += interval
            stop.wait(max(0.0, due - time.monotonic()))


def summary(times: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(times, n=100)
    return {"requests": len(times), "p50_ms": round(1e3 * cuts[49], 1), "p99_ms": round(1e3 * cuts[98], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.0, help="/readyz per second of all clients (0: unpaced)")
    parser.add_argument("--database-url", default="", help="a migrated-on-start database (default: SQLite)")
    parser.add_argument("--broker-url", default="", help="e.g. redis://127.0.0.1:6379/0 (default: the embedded one)")
    args = parser.parse_args()
    backing = {"database_url": args.database_url} if args.database_url else {}
    if args.broker_url:
        backing |= {"broker_url": args.broker_url, "broker_key_prefix": f"readyz-bench-{os.getpid()}:"}
    with tempfile.TemporaryDirectory() as tmp:
        # the rate limit off: the route's own cost, not the 429s the limit would answer
        service = Service(Path(tmp), {"rate_limit_per_min": 0, **backing})
        try:
            tenant_latencies(service, 2.0)  # warm
            alone = summary(tenant_latencies(service, args.seconds))
            stop, codes = threading.Event(), collections.Counter()
            interval = args.clients / args.rate if args.rate else 0.0
            threads = [threading.Thread(target=flood, args=(service.url, stop, codes, interval))
                       for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            t0 = time.monotonic()
            flooded = summary(tenant_latencies(service, args.seconds))
            stop.set()
            for thread in threads:
                thread.join()
            took = time.monotonic() - t0
        finally:
            service.stop()
    print(json.dumps({"checkout": os.getcwd(), "backing": sorted(backing) or "sqlite", "clients": args.clients,
                      "rate": args.rate, "seconds": args.seconds,
                      "load_avg_1m": round(os.getloadavg()[0], 1), "tenant_alone": alone, "tenant_flooded": flooded,
                      "readyz_per_s": {str(code): round(n / took, 1) for code, n in sorted(codes.items())}}, indent=1))


if __name__ == "__main__":
    main()
