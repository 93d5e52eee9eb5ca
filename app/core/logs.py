"""Log records that say which request, job, tenant and stage they belong to; readable text by default,
one JSON object per line with DTP_LAYOUT_LOG_FORMAT=json. The API and the workers both use it.

The context is one mutable `LogContext` per request (or per job run) held in a context variable.
Mutable on purpose: FastAPI runs sync dependencies and routes in worker threads, each under a *copy*
of the request's context, so a plain context variable set by the `caller` dependency (the tenant)
would be gone by the time the route or the access log runs; the object is shared by every copy.

    request  ──RequestContext──▶ LogContext(request_id, tenant?, job_id?)   (app/api/request_context.py)
    worker   ──run_job──────────▶ LogContext(job_id, tenant, stage)         (worker/entry.py, jobs.py)
    record   ──ContextFilter────▶ record.request_id / job_id / tenant / stage
             ──JsonFormatter────▶ {"ts", "level", "logger", "message", "request_id", …, extras}

One record is one line, whatever a client sent (a decoded path, a header, a spec field): both
formats write every line break and every other non-printable character of a value as an escape
(app/core/safe_text.py: `\n`, `\x85`, `\u2028`; in JSON `\u0085`). A text record with a traceback is
followed by the traceback's lines, each starting with `  | `: a line that does not is a record.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from app.core.safe_text import for_log, json_escapes

FIELDS = ("request_id", "job_id", "tenant", "stage")
FORMATS = ("text", "json")
_MARK = "_dtp_layout_handler"  # on the handler configure() installs, so that a second call replaces it
# LogRecord's own attributes: whatever else a record carries came from `extra=` and goes into the JSON.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                           *FIELDS}


class LogContext:
    __slots__ = FIELDS
    request_id: str | None
    job_id: str | None
    tenant: str | None
    stage: str | None

    def __init__(self, **fields: str | None) -> None:
        for name in FIELDS:
            setattr(self, name, fields.get(name))

    def items(self) -> Iterator[tuple[str, str]]:
        for name in FIELDS:
            value = getattr(self, name)
            if value is not None:
                yield name, value


_current: ContextVar[LogContext | None] = ContextVar("dtp_layout_log_context", default=None)


def current() -> LogContext | None:
    return _current.get()


@contextmanager
def bound(**fields: str | None) -> Iterator[LogContext]:
    """A new context for the block (fields not given are inherited from the enclosing one)."""
    outer = _current.get()
    inherited = dict(outer.items()) if outer is not None else {}
    ctx = LogContext(**{**inherited, **{k: v for k, v in fields.items() if v is not None}})
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def update(**fields: str | None) -> None:
    """Set fields of the current context (seen by every copy of it); nothing when there is none."""
    ctx = _current.get()
    if ctx is not None:
        for name, value in fields.items():
            if name in FIELDS:
                setattr(ctx, name, value)


class ContextFilter(logging.Filter):
    """Puts the context's fields on the record (`extra=` values win). On a handler, so that records
    propagated from any logger get them."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        for name in FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, getattr(ctx, name) if ctx is not None else None)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, the context fields that
    are set, the record's `extra=` fields, and `exc` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json_escapes(json.dumps(out, default=str, ensure_ascii=False))


def _escaped(value: Any) -> Any:
    return for_log(value) if isinstance(value, str) else value


# Continuation lines of a text record (its traceback) start with this: no record line does.
CONTINUATION = "  | "


class TextFormatter(logging.Formatter):
    """A readable line (the wrapped formatter's, or `time level logger: message`) with the context
    fields that are set appended as `[request_id=… job_id=…]`, and the traceback, if any, on the lines
    after it, each prefixed with `CONTINUATION`.

    The wrapped formatter (uvicorn's, Celery's) formats a copy of the record whose message and string
    arguments have their non-printable characters escaped, without the traceback; what it returns then
    has any line break left (a multi-line exception passed as an argument) escaped too. Only ESC is
    kept there: the wrapped formatter's colours use it, and the arguments' ESC are escaped already."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = for_log(self.inner.format(_one_line(record)), keep="\x1b")
        fields = " ".join(f"{name}={for_log(str(value))}" for name in FIELDS
                          if (value := getattr(record, name, None)) is not None)
        if fields:
            line = f"{line} [{fields}]"
        tail = []
        if record.exc_info:
            tail.append(self.formatException(record.exc_info))
        elif record.exc_text:
            tail.append(record.exc_text)
        if record.stack_info:
            tail.append(self.formatStack(record.stack_info))
        if not tail:
            return line
        lines = "\n".join(tail).splitlines()  # every kind of line break ends a continuation line
        return "\n".join([line, *(CONTINUATION + for_log(part) for part in lines)])


def _printable(value: Any) -> bool:
    return not isinstance(value, str) or value.isprintable()


def _one_line(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of `record` without its traceback, its message and string arguments escaped; the record
    itself when there is nothing to change (the common case: no copy on the access log's path)."""
    args = record.args.values() if isinstance(record.args, dict) else record.args or ()
    if not (record.exc_info or record.exc_text or record.stack_info) and _printable(record.msg) \
            and all(_printable(arg) for arg in args):
        return record
    copy = logging.makeLogRecord(vars(record))
    copy.exc_info = copy.exc_text = copy.stack_info = None
    if isinstance(copy.msg, str):
        copy.msg = for_log(copy.msg)
    if isinstance(copy.args, tuple):
        copy.args = tuple(_escaped(arg) for arg in copy.args)
    elif isinstance(copy.args, dict):
        copy.args = {key: _escaped(arg) for key, arg in copy.args.items()}
    return copy


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (test runners swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def formatter(fmt: str, inner: logging.Formatter | None = None) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    return JsonFormatter() if fmt == "json" else TextFormatter(inner)


def configure(fmt: str = "text", level: str = "INFO") -> logging.Handler:
    """The API process's logging: one stderr handler on the root logger with the context filter and
    the format, this project's loggers (`app.*`, `dtp_layout.*`) at `level`. With json, uvicorn's
    loggers go through it too (one format per process); with text, the handlers uvicorn set up before
    the app was built (`uvicorn app.api.main:create_app`) get the one-line wrapper (`adopt`). Calling it
    again replaces the handler."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    handler = _Stderr()
    setattr(handler, _MARK, True)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    for name in ("app", "dtp_layout"):
        logging.getLogger(name).setLevel(level)
    if fmt == "json":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            uv = logging.getLogger(name)
            uv.handlers.clear()
            uv.propagate = True
            if uv.level == logging.NOTSET:
                uv.setLevel(level)
    else:
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            adopt(logging.getLogger(name), fmt)
    return handler


def wrapped_formatter(inner: Any = "logging.Formatter", **options: Any) -> TextFormatter:
    """A `logging.config.dictConfig` formatter factory: the TextFormatter (one line per record, the
    context appended) around the formatter class `inner` (or its dotted name), built with `options`."""
    if isinstance(inner, str):
        module, _, name = inner.rpartition(".")
        inner = getattr(importlib.import_module(module), name)
    return TextFormatter(inner(**options))


def one_line_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a dictConfig (uvicorn's LOGGING_CONFIG, for `serve`'s text format) whose every
    formatter is wrapped by `wrapped_formatter`: uvicorn's lines keep their look and colours, and
    nothing a client sent can break one."""
    out = copy.deepcopy(config)
    for name, spec in out.get("formatters", {}).items():
        options = {k: v for k, v in spec.items() if k not in ("()", "class", "format")}
        if "format" in spec:
            options["fmt"] = spec["format"]
        inner = spec.get("()") or spec.get("class") or "logging.Formatter"
        out["formatters"][name] = {"()": wrapped_formatter, "inner": inner, **options}
    return out


def adopt(logger: logging.Logger, fmt: str) -> None:
    """Give the handlers another library set up (Celery's, on the worker) the context filter and the
    format: json replaces their formatter, text appends the context to their lines."""
    for handler in logger.handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
        current_fmt = handler.formatter
        if isinstance(current_fmt, JsonFormatter | TextFormatter):
            continue
        handler.setFormatter(formatter(fmt, current_fmt))


def on_celery_logger(logger: logging.Logger, **_: Any) -> None:
    """Celery's `after_setup_logger` / `after_setup_task_logger` signal handler (worker/celery_app.py):
    the worker's lines get the job context and DTP_LAYOUT_LOG_FORMAT, keeping Celery's handlers."""
    from app.core.settings import get_settings

    settings = get_settings()
    adopt(logger, settings.log_format)
    for name in ("app", "dtp_layout"):
        logging.getLogger(name).setLevel(settings.log_level)
