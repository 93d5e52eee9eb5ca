"""The routes' dependencies: settings, database session, storage, job queue and the calling tenant
(the full-stack-fastapi-template style: routes take these as annotated parameters).

They are `async def`: FastAPI runs a sync dependency in a worker thread, a round trip per dependency
per request that costs more than what these do. The session is opened lazily (no connection until the
route's first query, in the route's worker thread).

A route that takes a session is decorated with `releases_session`: the connection goes back to the
pool in the route's own worker thread, the moment it returns. Anything later is too late: FastAPI
validates a sync route's answer in *another* worker thread (and a generator dependency's exit may need
one too), so a request would hold a connection while it waits for a thread, and with every thread
waiting for a connection neither comes free. Seen under load as a deadlock broken only by the pool
timeout: 30 s answers, then 503s. With connections released in-thread, only running threads hold
connections, and the pool has one per thread (DTP_LAYOUT_API_THREADS)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, ParamSpec, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.api.auth import caller
from app.core.caller import Caller
from app.core.db import Database
from app.core.queue import JobQueue
from app.core.settings import Settings
from app.core.storage.root import Storage

P = ParamSpec("P")
R = TypeVar("R")


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    session: Session = request.app.state.db.session()
    try:
        yield session
    finally:
        session.close()  # normally done already, by `releases_session`


class Db:
    """What an `async` route gets instead of a session: `await db.run(fn)` calls `fn(session)` in one
    worker thread with a fresh session, closed (its connection back to the pool) before the thread is
    released. One worker-thread round trip per request, and the answer is then validated and serialised
    on the event loop, without the second round trip FastAPI makes for a sync route's answer."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def _call(self, fn: Callable[[Session], R]) -> R:
        with self.database.session() as session:
            return fn(session)

    async def run(self, fn: Callable[[Session], R]) -> R:
        return await run_in_threadpool(self._call, fn)


async def get_db(request: Request) -> Db:
    db: Db = request.app.state.db_runner
    return db


def releases_session(route: Callable[P, R]) -> Callable[P, R]:
    """Close the route's `session` (its connection back to the pool) in the route's worker thread as
    soon as it returns (see the module's docstring). What the route returns must not need the session
    any more: plain values, or rows whose attributes were loaded."""

    @functools.wraps(route)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return route(*args, **kwargs)
        finally:
            session = kwargs.get("session")
            if isinstance(session, Session):
                session.close()

    # The route's signature with its annotations evaluated in the route's module: FastAPI reads the
    # parameters from it whatever version resolves string annotations against which globals.
    wrapper.__signature__ = inspect.signature(route, eval_str=True)  # type: ignore[attr-defined]
    return wrapper


async def get_storage(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


async def get_queue(request: Request) -> JobQueue:
    queue: JobQueue = request.app.state.queue
    return queue


async def request_id(request: Request) -> str | None:
    """The request's X-Request-ID (app/api/request_context.py)."""
    rid: str | None = getattr(request.state, "request_id", None)
    return rid


async def base_url(request: Request) -> str:
    """The prefix of the links in responses: DTP_LAYOUT_PUBLIC_URL, or relative links."""
    public = request.app.state.settings.public_url
    return public.rstrip("/") if public else ""


# The query parameters a route takes are found once per route and kept on it (walking its dependency
# tree on every request was work repeated on the hot path; routes are unhashable, so not a dict).
_KNOWN_QUERIES = "_dtp_layout_known_queries"


def _query_names(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def known_query_only(request: Request) -> None:
    """422 for a query parameter the operation does not take: a misspelt filter (`?devies=3`) must not
    silently answer everything."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known: frozenset[str] | None = getattr(route, _KNOWN_QUERIES, None)
    if known is None:
        known = frozenset(_query_names(dependant))
        setattr(route, _KNOWN_QUERIES, known)
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise RequestValidationError([{"type": "extra_forbidden", "loc": ("query", name or "(empty)"),
                                       "msg": f"unknown query parameter; this operation accepts: {accepted}",
                                       "input": request.query_params.get(name)} for name in unknown])


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
DbDep = Annotated[Db, Depends(get_db)]
StorageDep = Annotated[Storage, Depends(get_storage)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
CallerDep = Annotated[Caller, Depends(caller)]
BaseUrl = Annotated[str, Depends(base_url)]
RequestIdDep = Annotated[str | None, Depends(request_id)]
