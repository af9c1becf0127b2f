"""OTLP/HTTP transport (``/v1/traces``, ``/v1/logs``, ``/v1/metrics``) and the reward side channel
(``/v1/rewards``), over ``Ingest``.

A Starlette app run by the shared server shell (``httpshell``: uvicorn, TLS, bearer token checked
before any body is read, body and connection limits, read timeouts). Bodies may come with a
Content-Length or chunked (the OpenTelemetry JS SDK's exporters send chunked bodies). Per the
OTLP spec, the response uses the request's content type, errors carry a ``google.rpc.Status``
body, and a 503 carries Retry-After.

``Ingest`` blocks (the WAL append returns after its group fsync), so it runs in Starlette's
thread pool: concurrent requests wait in different threads and share one fsync, while the event
loop keeps reading other requests.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from collector_exporter.auth import AUTH_HINT
from collector_exporter.receive import MAX_BODY_BYTES, Ingest, failure_for
from httpshell import RequestError, RunningServer, ServerOptions, exception_handlers, header, inflate, start

_ROUTES = {"/v1/traces": "traces", "/v1/logs": "logs", "/v1/metrics": "metrics", "/v1/rewards": "rewards"}
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
# The google.rpc.Status code of an answer the shell or this module gives by HTTP status alone.
_CODE_FOR_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    503: "UNAVAILABLE",
}


def _content_type(scope: dict[str, Any]) -> str:
    return (header(scope, "content-type") or "").split(";", 1)[0].strip().lower()


def _status_response(scope: dict[str, Any], code: str, message: str) -> tuple[str, bytes]:
    """A ``google.rpc.Status`` body in the request's encoding (protobuf, else JSON)."""
    st = Status(code=grpc.StatusCode[code].value[0], message=message)
    if _content_type(scope) == _PROTOBUF:
        return _PROTOBUF, st.SerializeToString()
    return _JSON, json_format.MessageToJson(st, indent=None).encode()


def render_error(scope: dict[str, Any], status: int, message: str) -> tuple[str, bytes]:
    """The shell's ``ErrorRenderer`` for this server: OTLP's ``google.rpc.Status``."""
    return _status_response(scope, _CODE_FOR_STATUS.get(status, "UNKNOWN"), message)


def _error(
    request: Request, status: int, code: str, message: str, retry_after: int | None = None
) -> Response:
    content_type, body = _status_response(request.scope, code, message)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return Response(body, status, headers, media_type=content_type)


def build_app(ingest: Ingest) -> Starlette:
    async def healthz(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def export(request: Request) -> Response:
        path = request.url.path
        route = _ROUTES[path]
        ctype = _content_type(request.scope)
        allowed = (_JSON,) if route == "rewards" else (_PROTOBUF, _JSON)
        if ctype not in allowed:
            raise RequestError(
                415,
                f"Content-Type {ctype or '(none)'!r} is not supported on {path}; use {' or '.join(allowed)}",
            )
        body = inflate(await request.body(), request.headers.get("content-encoding"), MAX_BODY_BYTES)
        try:
            if route == "rewards":
                return Response(
                    json.dumps(await run_in_threadpool(ingest.rewards, body)).encode(), media_type=_JSON
                )
            resp = await run_in_threadpool(getattr(ingest, route), body, is_json=ctype == _JSON)
        except Exception as exc:
            f = failure_for(exc)
            return _error(request, f.http_status, f.grpc_code, f.message, f.retry_after_s)
        if ctype == _PROTOBUF:
            return Response(resp.SerializeToString(), media_type=_PROTOBUF)
        return Response(json_format.MessageToJson(resp, indent=None).encode(), media_type=_JSON)

    async def not_found(request: Request, exc: Exception) -> Response:
        method, path = request.method, request.url.path
        if method == "GET":
            msg = f"no route GET {path}; OTLP/HTTP takes POST /v1/traces, /v1/logs, /v1/metrics"
        elif path in _ROUTES:
            return _error(request, 405, "UNIMPLEMENTED", f"{method} {path} is not supported; use POST")
        else:
            msg = f"no route {method} {path}; use one of {sorted(_ROUTES)}"
        return _error(request, 404, "NOT_FOUND", msg)

    routes = [Route("/healthz", healthz, methods=["GET"])]
    routes += [Route(path, export, methods=["POST"]) for path in _ROUTES]
    return Starlette(
        routes=routes, exception_handlers={**exception_handlers(render_error), 404: not_found, 405: not_found}
    )


def start_http(
    ingest: Ingest,
    host: str,
    port: int,
    *,
    token: str | None = None,
    tls: tuple[str, str] | None = None,
    **limits: Any,
) -> RunningServer:
    """Serve OTLP/HTTP for ``ingest`` on ``host:port`` (``tls`` = (cert, key) paths) in the background.

    ``limits`` override other ``httpshell.ServerOptions`` fields (connection cap, timeouts).
    """
    cert, key = tls or (None, None)
    options = ServerOptions(
        host=host,
        port=port,
        tls_cert=cert,
        tls_key=key,
        token=token,
        public_paths=frozenset({"/healthz"}),
        auth_hint=AUTH_HINT,
        max_body_bytes=MAX_BODY_BYTES,
        name="tracerl-collector",
        **limits,
    )
    try:
        return start(build_app(ingest), options, render_error)
    except OSError as e:
        raise OSError(f"cannot bind OTLP/HTTP to {host}:{port}: {e}; pass --http HOST:PORT") from None


__all__ = ["build_app", "render_error", "start_http"]
