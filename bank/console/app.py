"""The operator's console: the bank service's jobs, sessions, runs and scoring, as web pages on this machine.

Every page is rendered here from what the bank service answers the bank's own operator (``BankOperator``, with
the bank's certificate); the console holds no state of its own and reads no folder. It serves plain HTTP on
loopback only, and only to a browser that opened the link it printed: that link carries a secret token, kept
in a strict same-site cookie, so neither another user of the machine nor a web page open in the browser can
act as the bank's operator through it.
"""

from __future__ import annotations

import csv
import io
import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from bank.config import TrainingConfig, json_text_settings
from bank.service.operator import BankOperator
from parties.errors import CutlayerError
from parties.protocol.control import AlignmentRequest

__all__ = ["COOKIE", "check_host", "create_console", "serve_console"]

HERE = Path(__file__).parent
COOKIE = "cutlayer_console"
#: The most rows of a table from a run's analysis a page shows.
TABLE_ROWS = 50
#: The settings box's first content: what ``python -m bank train`` runs without a settings file.
DEFAULT_SETTINGS = '{"epochs": 20}'


def _csv_table(body: bytes) -> dict[str, Any]:
    rows = list(csv.reader(io.StringIO(body.decode("utf-8", "replace"))))
    header, rows = (rows[0], rows[1:]) if rows else ([], [])
    return {"header": header, "rows": rows[:TABLE_ROWS], "more": max(len(rows) - TABLE_ROWS, 0)}


def _number(text: str, what: str, kind: type = float) -> Any:
    """A form field as a number, blank as ``None``; a clear refusal naming the field otherwise."""
    text = text.strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None


def create_console(operator: BankOperator, *, token: str | None = None, hosts: tuple[str, ...] = ()) -> FastAPI:
    """The console app over ``operator``. ``token``: the secret in the link (default: a fresh one, in
    ``app.state.token``); ``hosts``: the ``host:port`` names a browser may reach it by (default: any loopback)."""
    app = FastAPI(title="Cutlayer console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.token = token or secrets.token_urlsafe(32)
    app.state.hosts = hosts
    templates = Jinja2Templates(directory=HERE / "templates")
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def only_the_operator(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        host = request.headers.get("host", "")
        allowed = app.state.hosts or ()
        if (allowed and host not in allowed) or (not allowed and host.rsplit(":", 1)[0] not in
                                                  ("127.0.0.1", "localhost", "[::1]")):
            return PlainTextResponse("the console answers on its own address only", status_code=421)
        given = request.query_params.get("token")
        if given is not None and secrets.compare_digest(given, app.state.token):
            response = RedirectResponse(request.url.path, status_code=303)  # the token leaves the address bar
            response.set_cookie(COOKIE, app.state.token, httponly=True, samesite="strict")
            return response
        if not secrets.compare_digest(request.cookies.get(COOKIE, ""), app.state.token):
            return PlainTextResponse("open the console with the link `python -m bank console` printed "
                                     "(it carries the console's token)", status_code=401)
        return await call_next(request)

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, name, context, status_code=status)

    def home(request: Request, error: str | None = None, settings: str = DEFAULT_SETTINGS) -> HTMLResponse:
        sections: dict[str, Any] = {}
        problems: list[str] = []
        for key, fetch in (("partners", lambda: operator.partners().partners),
                           ("alignment", operator.alignment), ("jobs", lambda: operator.jobs().jobs),
                           ("sessions", lambda: operator.sessions().sessions), ("runs", lambda: operator.runs().runs)):
            try:
                sections[key] = fetch()
            except CutlayerError as exc:
                sections[key] = None
                if str(exc) not in problems:
                    problems.append(str(exc))
        return page(request, "home.html", status=422 if error else 200, error=error, problems=problems,
                    settings=settings, defaults=TrainingConfig().model_dump_json(indent=2), **sections)

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        return home(request)

    @app.post("/alignments")
    def align(request: Request, partners: str = Form(""), expect_overlap: str = Form(""),
              max_overlap: str = Form(""), min_intersection: str = Form(""),
              sequential: bool = Form(False)) -> Response:
        try:
            body = AlignmentRequest(
                partners=[p.strip() for p in partners.split(",") if p.strip()] or None,
                expect_overlap=_number(expect_overlap, "expected overlap"),
                max_overlap=_number(max_overlap, "largest overlap"),
                min_intersection=_number(min_intersection, "smallest intersection", int),
                mode="sequential" if sequential else "concurrent")
            job = operator.start_alignment(body)
        except (ValueError, ValidationError, CutlayerError) as exc:
            return home(request, error=f"alignment not started: {_reason(exc)}")
        return RedirectResponse(f"/jobs/{job.job_id}", status_code=303)

    @app.post("/trainings")
    def train(request: Request, settings: str = Form(""), epochs: str = Form(""),
              max_steps: str = Form("")) -> Response:
        from bank.commands import SETTINGS_EXAMPLE, training_config

        try:
            flags = {k: v for k, v in (("epochs", _number(epochs, "epochs", int)),
                                       ("max_steps", _number(max_steps, "most steps", int))) if v is not None}
            values = json_text_settings(settings, "the settings box", SETTINGS_EXAMPLE)
            job = operator.start_training(training_config(values, " in the settings box", flags))
        except (ValueError, CutlayerError) as exc:
            return home(request, error=f"training not started: {_reason(exc)}", settings=settings)
        return RedirectResponse(f"/jobs/{job.job_id}", status_code=303)

    @app.post("/sessions/{session_id}/resume")
    def resume(request: Request, session_id: str) -> Response:
        try:
            job = operator.resume_training(session_id)
        except CutlayerError as exc:
            return home(request, error=f"session {session_id} not resumed: {exc}")
        return RedirectResponse(f"/jobs/{job.job_id}", status_code=303)

    @app.post("/sessions/{session_id}/end")
    def end(request: Request, session_id: str) -> Response:
        try:
            operator.end_session(session_id)
        except CutlayerError as exc:
            return home(request, error=f"session {session_id} not ended: {exc}")
        return RedirectResponse("/", status_code=303)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(request: Request, job_id: str) -> HTMLResponse:
        try:
            job = operator.job(job_id)
        except CutlayerError as exc:
            return page(request, "missing.html", status=404, what=f"job {job_id}", reason=str(exc))
        return page(request, "job.html", job=job)

    @app.get("/api/jobs/{job_id}")
    def job_json(job_id: str) -> Response:
        try:
            return Response(operator.job(job_id).model_dump_json(), media_type="application/json")
        except CutlayerError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.post("/jobs/{job_id}/stop")
    def stop(request: Request, job_id: str) -> Response:
        try:
            operator.stop_job(job_id)
        except CutlayerError as exc:
            return page(request, "missing.html", status=409, what=f"job {job_id}", reason=str(exc))
        return RedirectResponse(f"/jobs/{job_id}", status_code=303)

    @app.get("/jobs/{job_id}/scores.csv")
    def scores(job_id: str) -> Response:
        try:
            body = operator.scores(job_id)
        except CutlayerError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        return Response(body, media_type="text/csv",
                        headers={"content-disposition": f'attachment; filename="scores-{job_id[:8]}.csv"'})

    @app.get("/runs/{session_id}", response_class=HTMLResponse)
    def run_page(request: Request, session_id: str) -> HTMLResponse:
        try:
            run = operator.run(session_id)
        except CutlayerError as exc:
            return page(request, "missing.html", status=404, what=f"run {session_id}", reason=str(exc))
        figures = [f for f in run.files if f.startswith("analysis/") and f.endswith(".png")]
        tables = {}
        for name in run.files:
            if name.startswith("analysis/") and name.endswith(".csv"):
                try:
                    tables[Path(name).stem] = _csv_table(operator.run_file(session_id, name).content)
                except CutlayerError:
                    continue
        audit = {k: tables.pop(k) for k in ("label_leakage", "inversion") if k in tables}
        return page(request, "run.html", run=run, figures=figures, tables=tables, audit=audit,
                    config_json=json.dumps(run.config, indent=2))

    @app.get("/runs/{session_id}/files/{name:path}")
    def run_file(session_id: str, name: str) -> Response:
        try:
            response = operator.run_file(session_id, name)
        except CutlayerError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        headers = {}
        if not name.endswith(".png"):
            headers["content-disposition"] = f'attachment; filename="{session_id[:8]}-{Path(name).name}"'
        return Response(response.content, media_type=response.headers.get("content-type"), headers=headers)

    @app.get("/score", response_class=HTMLResponse)
    def score_page(request: Request, model: str = "", error: str | None = None) -> HTMLResponse:
        try:
            models = [r for r in operator.runs().runs if r.state == "finished"]
        except CutlayerError as exc:
            models, error = [], error or str(exc)
        return page(request, "score.html", status=422 if error else 200, models=models, chosen=model, error=error)

    @app.post("/scorings")
    def score(request: Request, model: str = Form(...), customers: UploadFile = File(...),
              allow_missing: bool = Form(False), accept_drift: bool = Form(False),
              max_overlap: str = Form("")) -> Response:
        try:
            body = customers.file.read()
            if not body:
                raise ValueError(f"{customers.filename or 'the file'} is empty: choose a CSV of customers to score")
            job = operator.start_scoring(model, body, allow_missing, accept_drift,
                                         _number(max_overlap, "largest overlap"))
        except (ValueError, CutlayerError) as exc:
            return score_page(request, model=model, error=f"scoring not started: {_reason(exc)}")
        return RedirectResponse(f"/jobs/{job.job_id}", status_code=303)

    return app


def check_host(host: str) -> None:
    """Refuse an address beyond this machine: the console acts as the bank's operator over plain HTTP."""
    from parties.errors import ConfigError
    from parties.transport.tls import is_loopback

    if not is_loopback(host):
        raise ConfigError(f"--host {host}: the console serves this machine only (it acts as the bank's operator "
                          "over plain HTTP); bind it to 127.0.0.1 and reach it from elsewhere with ssh -L")


def serve_console(operator: BankOperator, host: str, port: int, about: str = "") -> None:
    """Serve the console on ``host:port`` (a loopback address; port 0: any free one) until Ctrl-C, after
    printing the link to open it with. ``about``: what the first line says it is for."""
    import socket

    import uvicorn

    from parties.errors import ConfigError

    check_host(host)
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        raise ConfigError(f"--port {port}: cannot listen on {host} ({exc.strerror}); choose another port") from exc
    bound = listening.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    names = (f"{shown}:{bound}", f"localhost:{bound}") if host == "127.0.0.1" else (f"{shown}:{bound}",)
    app = create_console(operator, hosts=names)
    print(f"Cutlayer console{about}; open it at\n  http://{names[0]}/?token={app.state.token}\n(Ctrl-C stops it)",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


def _reason(exc: Exception) -> str:
    """What went wrong, for a page: a validation error's problems, else the message."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc)
