"""A client of the layout service's /v1 API for scripts and CI (httpx; no torch).

    from app.client.http import LayoutClient
    with LayoutClient("http://layout.internal:8000", api_key="…") as client:
        job = client.submit(spec)
        done = client.wait(job["id"], timeout=3600)
        client.download(job["id"], Path("out"), ["shards"])

The URL and key default to `DTP_LAYOUT_URL` and `DTP_LAYOUT_API_KEY`. The key travels in the
`X-API-Key` header. Every refusal by the service becomes a `ClientError` with a one-line message;
`dtp-layout client` (app/cli/client/commands.py) prints it and exits with status 2. Asking for the results of a
job that has not succeeded raises `JobNotSucceeded` (exit status 1 when it failed or was cancelled, 3
while it is queued or running).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.core.jobstate import FINISHED
from app.core.storage.root import sha256_file

DEFAULT_URL = "http://127.0.0.1:8000"
RETRIES_WHEN_TOLD = 5  # 429 / 503 answers with a Retry-After


class ClientError(Exception):
    """The service is unreachable or refused the request (bad key, unknown job, invalid spec, …)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class JobNotSucceeded(Exception):
    """The job has no results: it failed or was cancelled (`finished`), or it is still queued or running."""

    def __init__(self, job: dict[str, Any], wanted: str) -> None:
        status = job.get("status", "unknown")
        if status == "failed":
            first = (job.get("error") or "").strip().splitlines()[:1]
            stage = job.get("error_stage") or job.get("stage") or "?"
            state = f"failed in {stage}: {first[0] if first else 'no message'}"
        elif status == "running":
            state = f"still running ({job.get('stage') or 'starting'} {100 * (job.get('progress') or 0):.0f}%)"
        elif status == "queued":
            state = "still queued"
        else:
            state = str(status)
        hint = "" if status in FINISHED else f"; `dtp-layout client wait {job.get('id')}` follows it to the end"
        super().__init__(f"job {job.get('id')} {state}: only a succeeded job has {wanted}{hint}")
        self.job = job
        self.finished = status in FINISHED


def removed_text(job: dict[str, Any]) -> str | None:
    """'deleted on …' / 'removed on … (past the retention period)' for a job whose artifacts are gone; else None."""
    if not job.get("expired_at"):
        return None
    why = "deleted" if job.get("expired_reason") == "deleted" else "removed after the retention period"
    return f"{why} on {job['expired_at']}"


class ArtifactsRemoved(ClientError):
    """The job's artifacts were removed from the store (DELETE, retention): nothing to download (410)."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(f"job {job.get('id')}: its artifacts were {removed_text(job)}; nothing to download (the "
                         "job, its layouts and scores stay: `dtp-layout client scores --job` reads them)", status=410)
        self.job = job


class WaitTimeout(Exception):
    """`wait` gave up before the job finished; `job` is the last state seen."""

    def __init__(self, message: str, job: dict[str, Any]) -> None:
        super().__init__(message)
        self.job = job


class DigestMismatch(Exception):
    """Downloaded files whose sha256 is not the one the service recorded (each deleted)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Downloaded:
    name: str
    path: Path
    size: int
    sha256: str
    fetched: int  # bytes transferred this time (0: the file was already complete)
    resumed_from: int  # bytes of a partial file kept and resumed with Range (0: from the start)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else response.reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return str(body["message"])
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail
        if isinstance(detail, list):
            return "; ".join(f"{d.get('field', '?')}: {d.get('msg', d)}" if isinstance(d, dict) else str(d)
                             for d in detail)
    return str(body)[:300]


def artifact_destination(out: Path, name: str) -> Path:
    """`out/name` for an artifact name the service sent, refused unless it is a plain relative path
    (the service is trusted with bytes, not with paths)."""
    parts = name.split("/")  # raw: PurePosixPath would fold "a//b" and "./a" away
    if not name or "\\" in name or "\x00" in name or any(p in ("", ".", "..") or ":" in p for p in parts):
        raise ClientError(f"refusing artifact name {name!r}: not a plain relative path")
    return Path(out).joinpath(*parts)


def select_artifacts(items: list[dict[str, Any]], names: Iterable[str]) -> list[dict[str, Any]]:
    """The artifacts named: exact names, or a directory (`shards`, `checkpoint/`) or a kind (`report`).
    No names: all of them. An unknown name is an error listing what there is."""
    wanted = [n for n in names if n]
    if not wanted:
        return list(items)
    chosen: dict[str, dict[str, Any]] = {}
    for name in wanted:
        prefix = name.rstrip("/") + "/"
        hits = [a for a in items if a["name"] == name or a["name"].startswith(prefix) or a["kind"] == name]
        if not hits:
            known = sorted({a["name"].split("/")[0] + ("/" if "/" in a["name"] else "") for a in items})
            raise ClientError(f"the job has no artifact {name!r}; it has: {', '.join(known) or 'none'}", 404)
        chosen.update((a["name"], a) for a in hits)
    return [a for a in items if a["name"] in chosen]


class LayoutClient:
    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = (url or os.environ.get("DTP_LAYOUT_URL") or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ClientError(f"the service URL must start with http:// or https://, got {self.url!r}")
        key = api_key if api_key is not None else os.environ.get("DTP_LAYOUT_API_KEY", "")
        self.has_key = bool(key)
        headers = {"User-Agent": "dtp-layout-client/1", "Accept": "application/json"}
        if key:
            headers["X-API-Key"] = key
        self.timeout = timeout
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport,
                                 follow_redirects=False)
        # A download the service redirects to its object store (DTP_LAYOUT_STORAGE_REDIRECT: a presigned
        # URL) is fetched with this one: no key, no service headers (they would reach the store's host).
        self.store_http = httpx.Client(headers={"User-Agent": "dtp-layout-client/1"}, timeout=timeout,
                                       transport=transport, follow_redirects=False)

    def __enter__(self) -> LayoutClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()
        self.store_http.close()

    @contextmanager
    def _artifact_stream(self, path: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
        """GET an artifact: the service's answer, or, when it redirects (307 to a presigned URL of its
        store), the store's, asked for the same range (without If-Range: the service has just matched it
        against the object the URL names)."""
        with self.http.stream("GET", path, headers={**headers, "Accept": "*/*"}) as response:
            location = response.headers.get("location") if response.status_code in (302, 303, 307) else None
            if location is None:
                yield response
                return
        if not location.startswith(("http://", "https://")):
            raise ClientError(f"{path}: the service redirected to {location[:200]!r}, not an http(s) URL")
        store_headers = {"Range": headers["Range"]} if "Range" in headers else {}
        with self.store_http.stream("GET", location, headers=store_headers) as response:
            yield response

    # ---- requests --------------------------------------------------------------------------------

    def _raise_for(self, response: httpx.Response) -> None:
        if response.is_success or response.status_code in (206, 304):
            return
        status, detail = response.status_code, _detail(response)
        if status == 401:
            hint = "the key was refused" if self.has_key else "no key given (--api-key or DTP_LAYOUT_API_KEY)"
            raise ClientError(f"the service at {self.url} needs a valid API key (401: {detail}; {hint})", status)
        if status == 422:
            raise ClientError(detail if detail.startswith("invalid request") else f"invalid request: {detail}", status)
        if status >= 500:
            raise ClientError(f"the service at {self.url} answered {status}: {detail}", status)
        raise ClientError(f"{detail} ({status})", status)

    def _unreachable(self, exc: httpx.HTTPError) -> ClientError:
        if isinstance(exc, httpx.TimeoutException):
            return ClientError(f"the service at {self.url} did not answer within {self.timeout:g}s "
                               f"({type(exc).__name__})")
        reason = str(exc).strip() or type(exc).__name__
        return ClientError(f"cannot reach the service at {self.url}: {reason}")

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call; a 429 or 503 that says when to retry (Retry-After, up to a minute) is retried."""
        for attempt in range(RETRIES_WHEN_TOLD + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
            wait = _retry_after(response)
            if wait is None or attempt == RETRIES_WHEN_TOLD:
                break
            time.sleep(wait)
        self._raise_for(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise ClientError(f"the service at {self.url} answered {path} with something that is not JSON") from exc

    # ---- the API ---------------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        job: dict[str, Any] = self._json("POST", "/v1/jobs", json=spec)
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self._json("GET", f"/v1/jobs/{_segment(job_id)}")
        return job

    def metrics(self, job_id: str) -> dict[str, Any]:
        """The job's distillation curves and, once the distilling stage published it, summary.headline."""
        metrics: dict[str, Any] = self._json("GET", f"/v1/jobs/{_segment(job_id)}/metrics")
        return metrics

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Remove a finished job's artifacts (the job stays, marked expired)."""
        job: dict[str, Any] = self._json("DELETE", f"/v1/jobs/{_segment(job_id)}")
        return job

    def uploads(self, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Newest first, following `next` until `limit` uploads."""
        out: list[dict[str, Any]] = []
        while len(out) < limit:
            page = self._json("GET", "/v1/uploads", params={"limit": min(200, limit - len(out)), "offset": len(out)})
            out += page["items"]
            if not page.get("next") or not page["items"]:
                break
        return out[:limit]

    def create_upload(self, body: dict[str, Any]) -> dict[str, Any]:
        upload: dict[str, Any] = self._json("POST", "/v1/uploads", json=body)
        return upload

    def complete_upload(self, upload_id: str) -> dict[str, Any]:
        upload: dict[str, Any] = self._json("POST", f"/v1/uploads/{_segment(upload_id)}/complete")
        return upload

    def delete_upload(self, upload_id: str) -> None:
        self.request("DELETE", f"/v1/uploads/{_segment(upload_id)}")

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = self._json("GET", "/v1/usage")
        return usage

    def jobs(self, *, status: str | None = None, model: str | None = None, devices: int | None = None,
             delta: int | None = None, schedule: str | None = None, owner: str | None = None,
             limit: int = 50) -> list[dict[str, Any]]:
        """Newest first, following `next` until `limit` jobs; `schedule` in any form the grammar takes (the
        service compares it canonical; `delta` is short for dtp:δ)."""
        params = {k: v for k, v in {"status": status, "model": model, "devices": devices, "delta": delta,
                                    "schedule": schedule, "owner": owner}.items() if v is not None}
        out: list[dict[str, Any]] = []
        offset = 0
        while len(out) < limit:
            page = self._json("GET", "/v1/jobs", params={**params, "limit": min(200, limit - len(out)),
                                                         "offset": offset})
            out += page["items"]
            if not page.get("next") or not page["items"]:
                break
            offset += len(page["items"])
        return out[:limit]

    def cancel(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self._json("POST", f"/v1/jobs/{_segment(job_id)}/cancel")
        return job

    def layouts(self, job_id: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._json("GET", f"/v1/jobs/{_segment(job_id)}/layouts")["items"]
        return items

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._json("GET", f"/v1/jobs/{_segment(job_id)}/artifacts")["items"]
        return items

    def scores(self, *, model: str | None = None, devices: int | None = None, delta: int | None = None,
               schedule: str | None = None, score: str | None = None,
               revision: str | None = None) -> dict[str, Any]:
        """The latest succeeded job's scores matching the filters (`schedule`: that schedule's latest job)."""
        params = {k: v for k, v in {"model": model, "devices": devices, "delta": delta, "schedule": schedule,
                                    "score": score, "revision": revision}.items() if v is not None}
        scores: dict[str, Any] = self._json("GET", "/v1/scores", params=params)
        return scores

    def wait(self, job_id: str, *, timeout: float | None = None, interval: float = 2.0,
             on_update: Callable[[dict[str, Any]], None] | None = None, outage_s: float = 120.0,
             on_unreachable: Callable[[ClientError, float, float], None] | None = None) -> dict[str, Any]:
        """Poll until the job finishes; returns its final state. A service that stops answering for up
        to `outage_s` seconds in a row (a restart) is waited out, and each failed try is reported to
        `on_unreachable(error, seconds unreachable so far, seconds it will still be retried)`; `timeout`
        bounds the whole wait. Ends with the last ClientError when the service never came back, with
        WaitTimeout when the job did not finish in time."""
        start = time.monotonic()
        unreachable_since: float | None = None
        job: dict[str, Any] = {}
        while True:
            attempt_at = time.monotonic()
            try:
                job = self.job(job_id)
                unreachable_since = None
            except ClientError as exc:
                if exc.status is not None:
                    raise
                unreachable_since = unreachable_since or attempt_at
                now = time.monotonic()
                left = outage_s - (now - unreachable_since)
                if timeout is not None:
                    left = min(left, timeout - (now - start))
                if left <= 0:
                    raise ClientError(f"{exc} (unreachable for {now - unreachable_since:.0f}s; gave up)") from exc
                if on_unreachable is not None:
                    on_unreachable(exc, now - unreachable_since, left)
            else:
                if on_update is not None:
                    on_update(job)
                if job["status"] in FINISHED:
                    return job
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout and unreachable_since is None:
                raise WaitTimeout(f"job {job_id} is still {job.get('status', 'unknown')}"
                                  + (f" ({job['stage']})" if job.get("stage") else "") + f" after {timeout:g}s", job)
            # past the timeout while unreachable: one more try, which either answers or gives up above
            time.sleep(interval if timeout is None else max(0.0, min(interval, timeout - elapsed)))

    # ---- downloads -------------------------------------------------------------------------------

    def download(self, job_id: str, out: Path, names: Iterable[str] = (), *,
                 on_total: Callable[[int, int], None] | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 on_discard: Callable[[str, Path, int, str], None] | None = None, retries: int = 3) -> list[Downloaded]:
        """Fetch the artifacts (or those named) of a succeeded job into `out`, under their names
        (`checkpoint/…`, `shards/…`); any other job raises JobNotSucceeded before a byte is written. A
        `.part` file left by an interrupted run is resumed with Range; every file's sha256 is checked
        against the service's record, and a file that does not match is deleted (after one fresh try
        when it had been resumed). Bytes of a `.part` file thrown away are reported to
        `on_discard(name, part file, bytes, why)`. Raises DigestMismatch after fetching the rest, and
        ArtifactsRemoved (nothing written) when the job's artifacts were deleted or expired."""
        job = self.job(job_id)
        if job.get("status") != "succeeded":
            raise JobNotSucceeded(job, "artifacts to download")
        if job.get("expired_at"):  # before anything is made under `out`
            raise ArtifactsRemoved(job)
        items = select_artifacts(self.artifacts(job_id), names)
        plan = [(a, dest, _complete(dest, a)) for a in items for dest in [artifact_destination(out, a["name"])]]
        have = sum(a["size"] if complete else min(_size(_part(dest)), a["size"]) for a, dest, complete in plan)
        if on_total is not None:
            on_total(sum(a["size"] for a in items), have)
        results, problems = [], []
        for art, dest, complete in plan:
            if complete:
                results.append(Downloaded(art["name"], dest, art["size"], art["sha256"], 0, 0))
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = _part(dest)
            resumed_from = min(_size(part), art["size"])
            fetched = self._fetch(job_id, art, part, on_bytes=on_bytes, on_discard=on_discard, retries=retries)
            digest = sha256_file(part)
            if digest != art["sha256"] and resumed_from:
                discarded = _size(part)
                part.unlink()  # the kept prefix was bad: one fresh try
                if on_discard is not None:
                    on_discard(art["name"], part, discarded,
                               f"the {resumed_from} bytes kept from an earlier run and the {discarded - resumed_from} "
                               f"fetched after them do not match the service's sha256 {art['sha256'][:12]}…; "
                               "fetching the whole file again")
                if on_bytes is not None:
                    on_bytes(-(resumed_from + fetched))
                fetched += self._fetch(job_id, art, part, on_bytes=on_bytes, on_discard=on_discard, retries=retries)
                resumed_from = 0
                digest = sha256_file(part)
            if digest != art["sha256"]:
                part.unlink()
                problems.append(f"{art['name']}: sha256 {digest} does not match the service's {art['sha256']} "
                                "(deleted)")
                continue
            os.replace(part, dest)
            results.append(Downloaded(art["name"], dest, art["size"], art["sha256"], fetched, resumed_from))
        if problems:
            raise DigestMismatch(problems)
        return results

    def _fetch(self, job_id: str, art: dict[str, Any], part: Path, *, on_bytes: Callable[[int], None] | None,
               on_discard: Callable[[str, Path, int, str], None] | None = None, retries: int) -> int:
        """Bring `part` up to the artifact's size, resuming with Range after a dropped connection.
        Returns the bytes transferred."""
        path = f"/v1/jobs/{_segment(job_id)}/artifacts/" + "/".join(_segment(p) for p in art["name"].split("/"))
        size, etag = art["size"], f'"{art["sha256"]}"'
        transferred, attempt = 0, 0
        while True:
            have = _size(part)
            if have > size:
                part.unlink()
                if on_discard is not None:
                    on_discard(art["name"], part, have, f"longer than the artifact ({size} bytes); fetching it again")
                have = 0
            if have == size:
                return transferred
            headers = {"Range": f"bytes={have}-", "If-Range": etag} if have else {}
            try:
                with self._artifact_stream(path, headers) as response:
                    wait = _retry_after(response)
                    if wait is not None and attempt < retries:
                        attempt += 1
                        time.sleep(wait)
                        continue
                    if not (response.is_success or response.status_code == 304):
                        response.read()  # a streamed error: its JSON body says why (e.g. artifact_damaged)
                    self._raise_for(response)
                    if response.status_code == 206:
                        if not response.headers.get("content-range", "").startswith(f"bytes {have}-"):
                            raise ClientError(f"{art['name']}: the service answered the range bytes={have}- with "
                                              f"{response.headers.get('content-range')!r}")
                        mode = "ab"
                    else:  # 200: the whole file (no partial file, or the service ignored the range)
                        if have and on_discard is not None:
                            on_discard(art["name"], part, have, "the service sent the whole file instead of the rest "
                                       "(it no longer matches the partial file's ETag)")
                        if have and on_bytes is not None:
                            on_bytes(-have)
                        mode = "wb"
                    with open(part, mode) as f:
                        for block in response.iter_bytes():  # as it arrives: a dropped connection loses nothing
                            f.write(block)
                            transferred += len(block)
                            if on_bytes is not None:
                                on_bytes(len(block))
            except httpx.HTTPError as exc:
                attempt += 1
                if attempt > retries:
                    raise self._unreachable(exc) from exc
                time.sleep(min(5.0, 0.5 * 2 ** attempt))
                continue
            if _size(part) >= size:
                return transferred
            attempt += 1  # the body ended early: resume from what arrived
            if attempt > retries:
                raise ClientError(f"{art['name']}: the transfer stopped at {_size(part)} of {size} bytes "
                                  f"{retries + 1} times")


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait before retrying a 429 / 503 that says so (Retry-After in seconds, ≤ 60); else None."""
    if response.status_code not in (429, 503):
        return None
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 60 else None


def _segment(text: str) -> str:
    """One URL path segment (a job id or a part of an artifact name), percent-encoded. An empty one is
    refused here: `/v1/jobs/` is another route (the list, reached through a 307), never the job asked for."""
    from urllib.parse import quote

    if not text.strip():
        raise ClientError(f"an empty id ({text!r}): give a job's id, as `dtp-layout client submit` printed it "
                          "(`dtp-layout client list` shows them)")
    return quote(text, safe="")


def _part(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _complete(dest: Path, art: dict[str, Any]) -> bool:
    return dest.is_file() and dest.stat().st_size == art["size"] and sha256_file(dest) == art["sha256"]
