"""The operator's console: the bank service's jobs, sessions, runs and scoring, as web pages on this machine.

Every page is rendered here from what the bank service answers the bank's own operator (``BankOperator``, with
the bank's certificate); the console holds no state of its own and reads no folder. It serves plain HTTP on
loopback only, under a secret path: the link it prints, ``http://127.0.0.1:PORT/TOKEN/``. Anything else gets
a 404, so neither another user of the machine nor a web page open in the browser (another port on
127.0.0.1 included: cookies would be shared with it, a path is not) can act as the bank's operator through it.
Pages run no inline script (a content security policy says so): what a partner wrote stays text.
"""

from __future__ import annotations

import csv
import io
import json
import secrets
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

__all__ = ["Guard", "check_host", "create_console", "serve_console"]

HERE = Path(__file__).parent
#: The most rows of a table from a run's analysis a page shows.
TABLE_ROWS = 50
#: The settings box's first content: none, which trains as ``python -m bank train`` does without a settings file.
DEFAULT_SETTINGS = ""
#: The training form's fields beside the box, as the command line's flags over a settings file: field -> label.
FIELDS = {"epochs": "the epochs field", "max_steps": "the most-steps field"}


#: The most characters of a table's cell a page shows.
CELL_CHARS = 200


def _cell(text: str) -> str:
    """A table's cell as a page shows it: a fraction to 4 significant digits (1,000 and more to one decimal),
    anything else as written, cut to ``CELL_CHARS``."""
    if "." in text:
        try:
            value = float(text)
        except ValueError:
            pass
        else:
            return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS] + "…"


def _csv_table(body: bytes) -> dict[str, Any]:
    """A table of a run's analysis, for a page: its first ``TABLE_ROWS`` rows, each cell cut to ``CELL_CHARS``."""
    rows: list[list[str]] = []
    try:
        for row in csv.reader(io.StringIO(body.decode("utf-8", "replace").replace("\0", ""))):
            rows.append([_cell(cell) for cell in row])
    except csv.Error as exc:
        rows.append([f"(the rest does not read as CSV: {exc})"])
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
        raise ValueError(f"{what}: {text!r} is not a {'whole ' if kind is int else ''}number") from None


#: What every answer of the console carries: its pages run only its own script, load only its own files, sit
#: in no frame, and leave their address (its secret) in no other site's Referer.
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                 b"object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"),
    (b"referrer-policy", b"same-origin"),  # not no-referrer: a form's Origin would be "null", and refused
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
]
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class Guard:
    """Admit a request only under the console's secret path and by one of its own host names, the secret then
    being the app's root path; refuse a form posted from another origin; add ``SECURITY_HEADERS``."""

    def __init__(self, app: Any, token: str, hosts: tuple[str, ...]) -> None:
        self.app, self.prefix, self.hosts = app, f"/{token}".encode(), hosts

    def _host_ok(self, host: str) -> bool:
        return host in self.hosts if self.hosts else host.rsplit(":", 1)[0] in LOOPBACK_NAMES

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        path = scope["path"].encode("utf-8", "surrogateescape")
        head, slash, _ = path.partition(b"/")[2].partition(b"/")
        if not self._host_ok(host):
            response: Response = PlainTextResponse("the console answers on its own address only", status_code=421)
        elif not secrets.compare_digest(b"/" + head, self.prefix):
            response = PlainTextResponse("not found: open the console with the link it printed", status_code=404)
        elif not slash:  # the secret without its slash: relative links need it
            response = RedirectResponse(self.prefix.decode() + "/", status_code=307)
        elif scope["method"] == "POST" and headers.get("origin") not in (None, f"http://{host}"):
            response = PlainTextResponse("a form from another origin", status_code=403)
        else:
            # As a proxy mounts an app: the routes see the path after the secret (Starlette strips root_path).
            inner = dict(scope, root_path=scope.get("root_path", "") + self.prefix.decode())
            await self.app(inner, receive, _with_headers(send))
            return
        await response(scope, receive, _with_headers(send))


def _with_headers(send: Any) -> Any:
    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *SECURITY_HEADERS])
        await send(message)

    return sending


def create_console(operator: BankOperator, *, token: str | None = None, hosts: tuple[str, ...] = ()) -> FastAPI:
    """The console app over ``operator``. ``token``: the secret of its path (default: a fresh one, in
    ``app.state.token``; the link is ``/TOKEN/``); ``hosts``: the ``host:port`` names a browser may reach it by
    (default: any loopback name)."""
    app = FastAPI(title="Cutlayer console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.token = token or secrets.token_urlsafe(32)
    app.add_middleware(Guard, token=app.state.token, hosts=hosts)
    templates = Jinja2Templates(directory=HERE / "templates")
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    base = f"/{app.state.token}/"

    def go(path: str) -> RedirectResponse:
        """After a form: to ``path`` under the secret (a relative path, as the pages' links are)."""
        return RedirectResponse(base + path, status_code=303)

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        return templates.TemplateResponse(request, name, {"base": base, **context}, status_code=status)

    def home(request: Request, error: str | None = None, settings: str = DEFAULT_SETTINGS,
             fields: dict[str, str] | None = None) -> HTMLResponse:
        sections: dict[str, Any] = {}
        problems: list[str] = []
        unknown: list[str] = []  # what the bank service did not tell
        for key, fetch in (("partners", lambda: operator.partners().partners),
                           ("alignment", operator.alignment), ("jobs", lambda: operator.jobs().jobs),
                           ("sessions", lambda: operator.sessions().sessions), ("runs", lambda: operator.runs().runs)):
            try:
                sections[key] = fetch()
            except CutlayerError as exc:
                sections[key] = None
                unknown.append(key)
                if str(exc) not in problems:
                    problems.append(str(exc))
        return page(request, "home.html", status=422 if error else 200, error=error, problems=problems,
                    settings=settings, fields=fields or {}, defaults=TrainingConfig().model_dump_json(indent=2),
                    default_epochs=TrainingConfig().epochs, unknown=unknown,
                    **sections)

    @app.get("/alignments")
    @app.get("/trainings")
    def forms_home() -> RedirectResponse:
        """A form's address reloaded or bookmarked: the page the form is on."""
        return go("")

    @app.get("/scorings")
    def scoring_home() -> RedirectResponse:
        return go("score")

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
        return go(f"jobs/{job.job_id}")

    @app.post("/trainings")
    def train(request: Request, settings: str = Form(""), epochs: str = Form(""),
              max_steps: str = Form("")) -> Response:
        from bank.commands import SETTINGS_EXAMPLE, training_config

        given = {"epochs": epochs, "max_steps": max_steps}
        try:
            flags = {k: v for k, v in ((k, _number(text, FIELDS[k], int)) for k, text in given.items())
                     if v is not None}
            values = json_text_settings(settings, "the settings box", SETTINGS_EXAMPLE)
            config = training_config(values, " (the settings box and fields)", flags,
                                     flag_name=lambda loc: FIELDS.get(str(loc[0]), str(loc[0])))
            job = operator.start_training(config)
        except (ValueError, CutlayerError) as exc:
            return home(request, error=f"training not started: {_reason(exc)}", settings=settings, fields=given)
        return go(f"jobs/{job.job_id}")

    @app.post("/sessions/{session_id}/resume")
    def resume(request: Request, session_id: str) -> Response:
        try:
            job = operator.resume_training(session_id)
        except CutlayerError as exc:
            return home(request, error=f"session {session_id} not resumed: {exc}")
        return go(f"jobs/{job.job_id}")

    @app.post("/sessions/{session_id}/end")
    def end(request: Request, session_id: str) -> Response:
        try:
            operator.end_session(session_id)
        except CutlayerError as exc:
            return home(request, error=f"session {session_id} not ended: {exc}")
        return go("")

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
            # Most often the job ended (or began finishing) between the page's last poll and the click: its own
            # page, with its result and why nothing was stopped.
            try:
                job = operator.job(job_id)
            except CutlayerError:
                return page(request, "missing.html", status=404, what=f"job {job_id}", reason=str(exc))
            return page(request, "job.html", status=409, job=job, refused=str(exc))
        return go(f"jobs/{job_id}")

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
            models: list[Any] | None = [r for r in operator.runs().runs if r.state == "finished"]
        except CutlayerError as exc:
            models, error = None, error or str(exc)
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
        return go(f"jobs/{job.job_id}")

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
    listening.listen(128)  # before the link is printed: a browser that opens it at once waits, is not refused
    bound = listening.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    names = (f"{shown}:{bound}",)  # not localhost: a browser may try [::1] first, where another could listen
    app = create_console(operator, hosts=names)
    print(f"Cutlayer console{about}; open it at\n  http://{names[0]}/{app.state.token}/\n(Ctrl-C stops it)",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


def _reason(exc: Exception) -> str:
    """What went wrong, for a page: a validation error's problems, else the message."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
    return str(exc)
