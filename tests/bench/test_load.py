"""bench/load.py in a few seconds: the embedded default (SQLite, `dtp-layout serve --no-worker`) seeded
and driven by a handful of clients in both modes; every endpoint of the mix is reached and answers
what it should (no errors), and the report carries the percentiles, the generator's lag and the load
average. The real runs (200 clients, Postgres) are in docs/reliability.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.patience_kit import patient

REPO = Path(__file__).resolve().parents[2]


def test_a_short_load_run_reaches_every_endpoint_without_errors(tmp_path):
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "load.py"), "--backend", "sqlite", "--mode",
                           "open,closed", "--clients", "4", "--rate", "8", "--duration", "3", "--warmup", "0.5",
                           "--keys-per-tenant", "2", "--jobs-per-tenant", "2", "--json", str(out),
                           "--start-timeout-s", str(patient(90))],  # the server's start-up: longer when busy
                          cwd=REPO, capture_output=True, text=True, timeout=patient(180))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = json.loads(out.read_text())["reports"]
    assert [r["mode"] for r in reports] == ["open", "closed"]
    for report in reports:
        assert report["errors"] == 0, report["error_samples"]
        assert report["requests"] > 0 and report["requests_per_s"] > 0
        assert len(report["loadavg_before"]) == 3 and report["generator"]["loop_lag_ms"]["p99"] >= 0
        for e in report["endpoints"].values():
            assert e["p50"] <= e["p95"] <= e["p99"] <= e["max"]
    seen = set().union(*(r["endpoints"] for r in reports))
    assert {"job poll", "list", "scores", "layouts", "artifacts", "download", "download range", "submit"} <= seen
    # 206 for every Range read, 202 for every submission: the statuses were checked, not just counted
    for report in reports:
        for name, e in report["endpoints"].items():
            assert set(e["statuses"]) == {{"download range": "206", "submit": "202", "cancel": "202"}.get(name, "200")}
    assert "p99 ms" in done.stdout and "load average" in done.stdout
