"""The app factory every party service uses: error mapping, caller identity, common endpoints.

Routes stay thin: they check who calls, read the body within limits and call
plain Python. Domain errors become HTTP responses here and nowhere else.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from parties.errors import CutlayerError, Forbidden
from parties.observability import count_exchange
from parties.protocol.common import HEALTH, IDENTITY, READY, Identity
from parties.settings import ServiceSettings
from parties.transport.access import Refusal, ensure_role, identify, read_limited, refusal
from parties.transport.hot_routes import HotPath, HotRoute
from parties.transport.tls import PeerIdentity
from parties.transport.trust import trust_for

__all__ = ["PartyApp", "caller", "create_party_app", "ensure_role", "read_body", "require_role", "require_self"]

logger = logging.getLogger(__name__)


# Dependencies are ``async def`` on purpose: FastAPI runs plain ``def`` dependencies in a
# worker thread, a hop that costs more than the check itself on every training step.


async def caller(request: Request) -> PeerIdentity:
    """Who is calling: from the verified client certificate (or, with --insecure only, a header)."""
    return identify(request.app.state.settings, request.scope)


def require_role(role: str) -> Callable[..., PeerIdentity]:
    """A dependency that admits callers whose certificate names ``role``."""

    async def check(identity: PeerIdentity = Depends(caller)) -> PeerIdentity:
        return ensure_role(identity, role)

    return check


async def require_self(request: Request, identity: PeerIdentity = Depends(caller)) -> PeerIdentity:
    """Admit only this party's own operator (a client holding this party's certificate)."""
    settings: ServiceSettings = request.app.state.settings
    if (identity.name, identity.role) != (settings.name, settings.role):
        raise Forbidden(f"this endpoint is for {settings.name}'s own operator")
    return identity


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes."""
    return await read_limited(request.stream(), request.headers.get("content-length"), limit)


class PartyApp(FastAPI):
    """A FastAPI app that answers its hot routes (``parties.transport.hot_routes``) before its middleware stack."""

    hot: HotPath | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.hot is not None and (found := self.hot.match(scope)) is not None:
            route = found[0].path
            await count_exchange(lambda *a: self.hot.handle(*found, *a), lambda _: route,  # type: ignore[union-attr]
                                 scope, receive, send)
            return
        await count_exchange(super().__call__, _route_template, scope, receive, send)


#: The free disk a service needs to be ready: a checkpoint or a model file must fit.
MIN_FREE_BYTES = 64 << 20


def readiness_problems(settings: ServiceSettings) -> list[str]:
    """Why this service cannot do its work now, in words that name none of its paths; none: it can."""
    problems = []
    folder = settings.state_path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ready-"):
            pass
        if (free := shutil.disk_usage(folder).free) < MIN_FREE_BYTES:
            problems.append(f"the state folder's disk has {free >> 20} MB free, under {MIN_FREE_BYTES >> 20} MB")
    except OSError as exc:
        problems.append(f"the state folder cannot be written ({exc.strerror or type(exc).__name__})")
    files = settings.tls_files()
    if files is not None:
        own = trust_for(files).policy.own
        if own.not_valid_after_utc <= dt.datetime.now(dt.timezone.utc):
            problems.append("this party's certificate has expired")
    return problems


def _route_template(scope: Any) -> str:
    """The route a request matched, as its template (never a path: a path can carry a session's name)."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def _answer(refused: Refusal) -> Response:
    headers = {k.decode(): v.decode() for k, v in refused.headers if k != b"content-length"}
    return Response(refused.body, status_code=refused.status, headers=headers)


def _error(status: int, kind: str, detail: str) -> Response:
    return _answer(Refusal(status, kind, detail))


def create_party_app(
    settings: ServiceSettings,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[Any]],
    routers: Sequence[APIRouter],
    hot_routes: Sequence[HotRoute] = (),
) -> FastAPI:
    app = PartyApp(title=f"Cutlayer {settings.role} service ({settings.name})", lifespan=lifespan)
    app.state.settings = settings
    if hot_routes:
        app.hot = HotPath(hot_routes, settings, app.state)

    @app.exception_handler(CutlayerError)
    async def _domain_error(request: Request, exc: CutlayerError) -> Response:
        return _answer(refusal(settings, exc, request.scope))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return _error(422, "InvalidRequest", problems)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error(500, "InternalError", "the service failed; see its log")

    common = APIRouter()

    @common.get(HEALTH)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @common.get(READY)
    async def ready() -> Response:
        problems = readiness_problems(settings)
        body = {"status": "not ready", "problems": problems} if problems else {"status": "ready"}
        return Response(json.dumps(body), status_code=503 if problems else 200, media_type="application/json")

    @common.get(IDENTITY, response_model=Identity)
    async def identity(_: PeerIdentity = Depends(caller)) -> Identity:
        return Identity(name=settings.name, role=settings.role)

    app.include_router(common)
    for router in routers:
        app.include_router(router)
    return app
