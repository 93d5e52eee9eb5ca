"""Prometheus metrics. Two kinds:

- this API process's own: requests by route and status, latency, 5xx answers, unhandled exceptions,
  submissions, rejections, artifact bytes (observed by `app/api/request_context.py` and the routes);
- the jobs', read from the database at scrape time (`app/core/services/job_stats.py`), so that they hold for any
  number of workers and API processes: jobs per status, the oldest queued job's age, retries,
  requeues and stage durations.

Aggregates only: /metrics needs no key, so no label carries a job, tenant, model or client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from app.core.services.job_stats import STAGE_BUCKETS, JobStats

log = logging.getLogger(__name__)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class JobsCollector:
    """The job metrics, computed at scrape time; when the database cannot be read they are left out
    (and the failure is logged) rather than failing the whole scrape."""

    def __init__(self, stats: Callable[[], JobStats]) -> None:
        self.stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.stats()
        except Exception:
            log.warning("metrics: cannot read the jobs table", exc_info=True)
            return
        gauge = GaugeMetricFamily("dtp_layout_jobs", "Jobs by status", labels=["status"])
        for status, n in stats.by_status.items():
            gauge.add_metric([status], n)
        yield gauge
        yield GaugeMetricFamily("dtp_layout_oldest_queued_job_age_seconds",
                                "Seconds since the oldest queued job was submitted (0: none queued)",
                                value=stats.oldest_queued_age_s)
        yield CounterMetricFamily("dtp_layout_job_retries", "Job runs beyond each job's first (attempts - 1, "
                                                            "summed over jobs)", value=stats.retries)
        yield CounterMetricFamily("dtp_layout_job_requeues", "Jobs re-enqueued by a sweeper (requeued events "
                                                             "in the jobs' histories)", value=stats.requeues)
        hist = HistogramMetricFamily("dtp_layout_job_stage_seconds", "Duration of finished job stages (the jobs' "
                                                                     "recorded timings)", labels=["stage"])
        for stage, h in stats.stages.items():
            buckets = [(repr(bound), n) for bound, n in zip(STAGE_BUCKETS, h.buckets, strict=True)]
            hist.add_metric([stage], [*buckets, ("+Inf", h.count)], sum_value=h.total)
        yield hist


class Metrics:
    def __init__(self, stats: Callable[[], JobStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dtp_layout_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("dtp_layout_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry)
        self.server_errors = Counter("dtp_layout_http_server_errors", "HTTP answers with a 5xx status",
                                     ["route", "status"], registry=self.registry)
        self.unhandled = Counter("dtp_layout_http_unhandled_exceptions", "Requests that raised an exception no "
                                                                         "handler turned into an answer (a bug)",
                                 ["route"], registry=self.registry)
        self.submitted = Counter("dtp_layout_jobs_submitted", "Jobs accepted by POST /v1/jobs", registry=self.registry)
        self.rejected = Counter("dtp_layout_jobs_rejected", "Job specs rejected with 422", registry=self.registry)
        # Downloads refused: the stored file is not the recorded one (size, sha256, missing, unreadable).
        self.artifacts_damaged = Counter("dtp_layout_artifacts_damaged", "Artifact downloads refused: the stored "
                                         "file is missing or no longer matches its recorded size or sha256",
                                         ["reason"], registry=self.registry)
        self.bytes_served = Counter("dtp_layout_artifact_bytes_served", "Artifact bytes sent",
                                    registry=self.registry)
        self.registry.register(JobsCollector(stats))

    def observe(self, method: str, route: str, status: int, seconds: float, *, unhandled: bool = False) -> None:
        """One finished request (app/api/request_context.py)."""
        method = method if method in METHODS else "OTHER"  # a client picks the method: bound the labels
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)
        if status >= 500:
            self.server_errors.labels(route, str(status)).inc()
        if unhandled:
            self.unhandled.labels(route).inc()
