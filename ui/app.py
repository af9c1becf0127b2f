"""The viewer's web app: Starlette routes over ``ui.pages``, Jinja2 templates, served by ``httpshell``.

Read-only by construction: every route is GET, every query goes through ``StoreReader`` (DuckDB with
file access off) and the only files opened directly are the trainer's JSON manifests and the
quarantine list, for reading. Every string reaches the page through Jinja2 with autoescape on, and
the Content-Security-Policy allows only this app's own script and stylesheet (no inline script, no
inline style), so even a string that slipped past escaping could not run.

The optional token works in a browser: open ``/?token=KEY`` once (``tracerl ui`` prints that URL);
the app answers with an HttpOnly, SameSite=Strict cookie and a redirect to the same page without the
token in its address. Scripts may send ``Authorization: Bearer KEY`` instead.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from httpshell import RunningServer, ServerOptions, bearer_error, run_blocking, start
from store.location import StoreLocation
from ui import pages
from ui.colors import ADVANTAGE_SCALE, LOGPROB_SCALE, NO_VALUE, scale_css
from ui.filters import PAGE_SIZES, SORTS, TOKEN_SOURCES, FilterError, parse_query
from ui.store import StoreReader

HERE = Path(__file__).parent
COOKIE = "tracerl_ui"
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


@dataclass(frozen=True)
class UiConfig:
    """What one viewer serves and how (``tracerl ui`` builds it from its flags)."""

    store: StoreLocation
    """The store, parsed from ``--store`` once by the command: a directory or ``s3://bucket/prefix``."""
    token: str | None = None
    """Required on every request when set: ``?token=`` once (sets a cookie), the cookie, or a Bearer header."""
    tokenizer: str | None = None
    """Model directory whose ``tokenizer.json`` decodes token ids; default: the rounds' base model."""
    poll_s: float = 3.0
    """How often open Rounds and Rollouts pages ask whether the store changed."""
    wait_s: float = 2.0
    """How long a page waits for the store's newest files to be opened before it answers from the
    previous version (a live page then updates itself when they are)."""


def _number(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 10**-digits or v == 0 else f"{v:.2e}"
    return str(v)


def _time(v: Any) -> str:
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, int):
        return datetime.fromtimestamp(v / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return "–" if v is None else str(v)


def templates() -> jinja2.Environment:
    """Templates with autoescape on for every file: span strings are arbitrary, HTML included."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        num=_number,
        time=_time,
        q=lambda s: urllib.parse.quote(str(s), safe=""),
        qs=lambda d: urllib.parse.urlencode(d),
    )
    env.globals.update(
        LOGPROB_SCALE=LOGPROB_SCALE,
        ADVANTAGE_SCALE=ADVANTAGE_SCALE,
        NO_VALUE=NO_VALUE,
        SORTS=SORTS,
        TOKEN_SOURCES=TOKEN_SOURCES,
        PAGE_SIZES=PAGE_SIZES,
    )
    return env


def _session(token: str) -> str:
    """The cookie value: a hash of the token, so the cookie jar never holds the key itself."""
    return hashlib.sha256(b"tracerl-ui\0" + token.encode()).hexdigest()


class TokenGate:
    """ASGI wrapper: with a token, a request passes with the cookie, a Bearer header, or ``?token=``
    (which sets the cookie and redirects to the address without it); anything else gets a 401 page."""

    def __init__(self, app: Any, token: str | None, render: Any):
        self.app, self.token, self.render = app, token, render

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.token or scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None:
            if hmac.compare_digest(given.encode(), self.token.encode()):
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                url = scope["path"] + ("?" + urllib.parse.urlencode(rest) if rest else "")
                response: Response = RedirectResponse(url, 303)
                response.set_cookie(COOKIE, _session(self.token), httponly=True, samesite="strict")
            else:
                response = self.render(
                    401, "That token does not match the one `tracerl ui` was started with."
                )
            await response(scope, receive, send)
            return
        cookies = SimpleCookie(request.headers.get("cookie", ""))
        cookie = cookies[COOKIE].value if COOKIE in cookies else ""
        ok = (
            hmac.compare_digest(cookie.encode(), _session(self.token).encode())
            or bearer_error(request.headers.get("authorization"), self.token) is None
        )
        if not ok:
            await self.render(
                401,
                "This viewer needs its token: open the address `tracerl ui` printed "
                "(it ends in ?token=…) once, or send Authorization: Bearer KEY.",
            )(scope, receive, send)
            return
        await self.app(scope, receive, send)


ASSET_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
}


def static_assets() -> dict[str, bytes]:
    """The files under static/, read once, and the colour scales' stylesheet, generated from ``ui.colors``."""
    static = {p.name: p.read_bytes() for p in (HERE / "static").iterdir() if p.is_file()}
    static["scale.css"] = scale_css().encode()
    return static


class Views:
    """The viewer's endpoints over one reader: each reads the store's current files through ``ui.pages`` and
    renders its template; a bad request or a missing id renders the error page."""

    def __init__(self, cfg: UiConfig, reader: StoreReader) -> None:
        self.cfg, self.reader, self.env, self.static = cfg, reader, templates(), static_assets()

    def page(self, name: str, code: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(
            store=self.reader.store, poll_ms=int(self.cfg.poll_s * 1000), **context
        )
        return HTMLResponse(html, code, headers=SECURITY_HEADERS)

    def error(self, status: int, message: str) -> HTMLResponse:
        return self.page("error.html", status, status=status, message=message, live=False, nav="")

    async def fresh(self, fn: Any, *args: Any) -> Any:
        """A page's data from the store's current files: its ``generation`` is then the one a live page
        polls against, so the page swaps itself only when data arrives after it was drawn."""

        def read() -> Any:
            self.reader.refresh(self.cfg.wait_s)
            return fn(self.reader, *args)

        return await run_blocking(read)

    def live_page(self, name: str, nav: str, data: dict) -> HTMLResponse:
        return self.page(name, live=True, nav=nav, generation=self.reader.generation, **data)

    async def rounds(self, request: Request) -> Response:
        return self.live_page("rounds.html", "rounds", await self.fresh(pages.rounds_data))

    async def rollouts(self, request: Request) -> Response:
        try:
            q = parse_query(dict(request.query_params))
        except FilterError as e:
            return self.error(400, f"Bad filter: {e}")
        return self.live_page("rollouts.html", "rollouts", await self.fresh(pages.rollouts_data, q))

    async def rollout(self, request: Request) -> Response:
        rid = request.path_params["rollout_id"]
        data = await self.fresh(pages.rollout_data, rid, self.cfg.tokenizer)
        if data is None:
            return self.error(404, f"No rollout {rid!r} in this store (it may not be converted yet).")
        return self.page("rollout.html", live=False, nav="rollouts", **data)

    async def task(self, request: Request) -> Response:
        data = await self.fresh(pages.group_data, request.path_params["task_id"])
        if not data["versions"]:
            return self.error(404, f"No rollouts of task {request.path_params['task_id']!r} in this store.")
        return self.live_page("group.html", "rollouts", data)

    async def doctor(self, request: Request) -> Response:
        return self.page("doctor.html", live=False, nav="doctor", **await self.fresh(pages.doctor_data))

    async def live(self, request: Request) -> Response:
        generation = await run_blocking(self.reader.refresh, 0.0)
        return JSONResponse({"generation": generation}, headers={"cache-control": "no-store"})

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.static:
            return self.error(404, "No such file.")
        media_type = ASSET_TYPES.get(Path(name).suffix, "application/octet-stream")
        headers = {"x-content-type-options": "nosniff", "cache-control": "max-age=300"}
        return Response(self.static[name], media_type=media_type, headers=headers)

    async def not_found(self, request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        return self.error(code, "No such page." if code == 404 else "This viewer only reads: use GET.")

    def routes(self) -> list[Route]:
        return [
            Route("/", home),
            Route("/rounds", self.rounds),
            Route("/rollouts", self.rollouts),
            Route("/rollouts/{rollout_id:path}", self.rollout),
            Route("/tasks/{task_id:path}", self.task),
            Route("/doctor", self.doctor),
            Route("/api/live", self.live),
            Route("/static/{name}", self.asset),
            Route("/healthz", health),
        ]


async def home(request: Request) -> Response:
    return RedirectResponse("/rounds", 302)


async def health(request: Request) -> Response:
    return Response("ok\n", media_type="text/plain")


def make_app(cfg: UiConfig, reader: StoreReader | None = None) -> Any:
    """The ASGI app (token gate included) over ``cfg.store``."""
    views = Views(cfg, reader or StoreReader(cfg.store))
    app = Starlette(routes=views.routes(), exception_handlers={404: views.not_found, 405: views.not_found})
    app.state.reader = views.reader
    return TokenGate(app, cfg.token, views.error)


def serve(cfg: UiConfig, host: str = "127.0.0.1", port: int = 8700) -> RunningServer:
    """Start the viewer on ``host:port`` in a background thread (``httpshell``: limits, deadlines)."""
    options = ServerOptions(host=host, port=port, max_body_bytes=64 << 10, name="tracerl-ui")
    return start(make_app(cfg), options)
