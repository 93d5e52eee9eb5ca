"""The routes' dependencies: settings, database session, storage, job queue and the calling tenant
(the full-stack-fastapi-template style: routes take these as annotated parameters)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session

from app.auth import Caller, caller
from app.queue import JobQueue
from app.settings import Settings
from app.storage import Storage


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.db.session() as session:
        yield session


def get_storage(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


def get_queue(request: Request) -> JobQueue:
    queue: JobQueue = request.app.state.queue
    return queue


async def request_id(request: Request) -> str | None:
    """The request's X-Request-ID (app/request_context.py)."""
    rid: str | None = getattr(request.state, "request_id", None)
    return rid


def base_url(request: Request) -> str:
    """The prefix of the links in responses: DTP_LAYOUT_PUBLIC_URL, or relative links."""
    public = request.app.state.settings.public_url
    return public.rstrip("/") if public else ""


def _query_names(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def known_query_only(request: Request) -> None:
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
