"""The routes' dependencies: settings, database session, storage, job queue and the calling tenant
(the full-stack-fastapi-template style: routes take these as annotated parameters).

They are `async def`: FastAPI runs a sync dependency in a worker thread, a round trip per dependency
per request that costs more than what these do. The session is opened lazily (no connection until the
route's first query, in the route's worker thread); closing it returns the connection to the pool.
Closing on the event loop matters: a sync generator dependency's exit needs a worker thread of its
own, and with every worker thread waiting for a pooled connection the connections would never be
returned (a deadlock broken only by the pool timeout, seen under load as 30 s answers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session

from app.auth import Caller, caller
from app.queue import JobQueue
from app.settings import Settings
from app.storage import Storage


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    session: Session = request.app.state.db.session()
    try:
        yield session
    finally:
        session.close()


async def get_storage(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


async def get_queue(request: Request) -> JobQueue:
    queue: JobQueue = request.app.state.queue
    return queue


async def request_id(request: Request) -> str | None:
    """The request's X-Request-ID (app/request_context.py)."""
    rid: str | None = getattr(request.state, "request_id", None)
    return rid


async def base_url(request: Request) -> str:
    """The prefix of the links in responses: DTP_LAYOUT_PUBLIC_URL, or relative links."""
    public = request.app.state.settings.public_url
    return public.rstrip("/") if public else ""


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
    known = _query_names(dependant)
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise RequestValidationError([{"type": "extra_forbidden", "loc": ("query", name or "(empty)"),
                                       "msg": f"unknown query parameter; this operation accepts: {accepted}",
                                       "input": request.query_params.get(name)} for name in unknown])


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StorageDep = Annotated[Storage, Depends(get_storage)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
CallerDep = Annotated[Caller, Depends(caller)]
BaseUrl = Annotated[str, Depends(base_url)]
RequestIdDep = Annotated[str | None, Depends(request_id)]
