"""The errors the job domain raises, each carrying the HTTP answer it becomes (status, field, code),
and the redaction of server paths from what users see. Framework-free: the API turns them into
JSON (app/api/errors.py); the worker and the CLI use them as they are."""

from __future__ import annotations

import re

# ---- the exceptions the services raise --------------------------------------------------------------

class ApiError(Exception):
    """An answer other than 2xx: `status`, a message, the field at fault and extra headers."""

    status = 400
    default_field: str | None = None
    code = "bad_request"

    def __init__(self, detail: str, *, field: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field if field is not None else self.default_field
        self.headers = headers or {}
        self.code = code or self.code


class Unauthorized(ApiError):
    status, default_field, code = 401, "X-API-Key", "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "X-API-Key"})


class NotFound(ApiError, LookupError):
    status, default_field, code = 404, "job_id", "not_found"


class Conflict(ApiError):
    status, default_field, code = 409, "job_id", "conflict"


class Gone(ApiError):
    """410: the thing was there and was removed on purpose (a job's artifacts after DELETE or retention)."""

    status, default_field, code = 410, "name", "gone"


class PayloadTooLarge(ApiError):
    status, default_field, code = 413, "body", "payload_too_large"


class RangeNotSatisfiable(ApiError):
    status, default_field, code = 416, "Range", "range_not_satisfiable"


class TooManyRequests(ApiError):
    """429 with Retry-After (whole seconds, at least 1)."""

    status = 429

    def __init__(self, detail: str, *, field: str, retry_after_s: float, code: str = "rate_limited") -> None:
        super().__init__(detail, field=field, headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))},
                         code=code)


class ServiceUnavailable(ApiError):
    status, code = 503, "service_unavailable"


class BrokerUnavailable(ServiceUnavailable):
    code = "broker_unavailable"


class StoreUnreachable(ServiceUnavailable):
    """The object store did not answer or refused the service (network, credentials, its 5xx): 503 with
    Retry-After; the artifact itself is not known to be damaged."""

    default_field, code = "name", "store_unavailable"


class ArtifactDamaged(ServiceUnavailable):
    """A stored artifact no longer matches its recorded size or sha256: never served as valid. A 503
    (a server-side loss the operator must repair), without Retry-After: waiting does not mend it."""

    default_field, code = "name", "artifact_damaged"


class SpecError(ValueError):
    """Submit-time problems with a valid-looking spec: (field, message) pairs; answered 422."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems = problems


# ---- what users see of a job's error -----------------------------------------------------------------

_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\":,;()\[\]{}]+/)*[^\s/'\":,;()\[\]{}]+")


def redact_paths(message: str | None, roots: dict[str, str]) -> str | None:
    """`message` with the server's roots written as their setting names (MODEL_ROOT/…) and any other
    absolute path cut to its last part (…/name): users learn which of their inputs failed, never where
    the server keeps things."""
    if message is None:
        return None
    for name, root in sorted(roots.items(), key=lambda kv: -len(kv[1])):
        if root and root != "/":
            message = message.replace(root.rstrip("/") + "/", f"{name}/").replace(root.rstrip("/"), name)

    def cut(match: re.Match[str]) -> str:
        tail = match.group(0).rstrip("/").rsplit("/", 1)[-1]
        return f"…/{tail}" if tail else "…"

    return _ABSOLUTE_PATH.sub(cut, message)
