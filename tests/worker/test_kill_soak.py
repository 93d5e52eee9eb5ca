"""The kill soak (bench/kill_soak.py), short: the worker SIGKILLed once in each of three jobs, one holding
the job's message before its claim, one in the affinity stage and one while distilling; each job ends
succeeded once, with one verified artifact set and the uninterrupted run's curves."""

from __future__ import annotations

import pytest

from bench.kill_soak import PRE_CLAIM, run_soak
from tests.service_kit import worker_settings

# serial: the kill soak
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker, pytest.mark.serial]


def test_kill_soak_short(tmp_path, postgres_server, redis_broker):
    settings = worker_settings(tmp_path, postgres_server, redis_broker, "soak", lease_s=2.0)
    lines: list[str] = []
    report = run_soak(settings, trials=3, seed=1, log_path=tmp_path / "workers.log", stage_delay_s=0.1,
                      targets=(PRE_CLAIM, "affinity", "distilling"), say=lines.append)
    assert report["trials"] == 3 and report["ok"] == 3, (report, lines)
    assert report["problems"] == {} and report["worst_curve_difference"] <= 1e-6
    assert report["kills_per_stage"].get(PRE_CLAIM) == 1, report
    assert sum(report["kills_per_stage"].values()) == 3 and not any(k.startswith("after") for k in
                                                                    report["kills_per_stage"]), report
    assert report["reclaimed_after_kill_s"]["max"] < 30, report
