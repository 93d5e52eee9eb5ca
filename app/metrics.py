"""Prometheus metrics of the API process: requests, latency, submissions, and jobs per status
(read from the database at scrape time, so that they count the workers' progress too)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)


class JobsCollector:
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("dtp_layout_jobs", "Jobs by status", labels=["status"])
        try:
            for status, n in self.counts().items():
                gauge.add_metric([status], n)
        except Exception:
            log.warning("metrics: cannot count jobs", exc_info=True)
            return
        yield gauge


class Metrics:
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dtp_layout_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("dtp_layout_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry)
        self.submitted = Counter("dtp_layout_jobs_submitted", "Jobs accepted by POST /v1/jobs", registry=self.registry)
        self.rejected = Counter("dtp_layout_jobs_rejected", "Job specs rejected with 422", registry=self.registry)
        # Downloads refused: the stored file is not the recorded one (size, sha256, missing, unreadable).
        self.artifacts_damaged = Counter("dtp_layout_artifacts_damaged", "Artifact downloads refused: the stored "
                                         "file is missing or no longer matches its recorded size or sha256",
                                         ["reason"], registry=self.registry)
        self.bytes_served = Counter("dtp_layout_artifact_bytes_served", "Artifact bytes sent",
                                    registry=self.registry)
        self.registry.register(JobsCollector(counts))

    async def middleware(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        self.requests.labels(request.method, path, str(response.status_code)).inc()
        self.latency.labels(request.method, path).observe(time.perf_counter() - t0)
        return response
