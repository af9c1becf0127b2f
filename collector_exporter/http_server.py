"""OTLP/HTTP transport (``/v1/traces``, ``/v1/logs``, ``/v1/metrics``) and the reward side channel
(``/v1/rewards``), over ``Ingest``.

Built on the standard library's ``ThreadingHTTPServer`` (HTTP/1.1 keep-alive, one thread per
connection): the OTLP/HTTP surface is four POST routes, and a dependency-free server is enough
to keep the ack path near the cost of the WAL fsync. Per the OTLP spec, the response uses the
request's content type, and errors carry a ``google.rpc.Status`` body.
"""

from __future__ import annotations

import json
import ssl
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from google.rpc.status_pb2 import Status

from collector_exporter.auth import check_bearer
from collector_exporter.receive import MAX_BODY_BYTES, BadRequest, Ingest, TooLarge, failure_for

_ROUTES = {"/v1/traces": "traces", "/v1/logs": "logs", "/v1/metrics": "metrics", "/v1/rewards": "rewards"}
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_GRPC_CODE_NUMBERS = {"INVALID_ARGUMENT": 3, "RESOURCE_EXHAUSTED": 8, "UNAUTHENTICATED": 16, "UNAVAILABLE": 14,
                      "NOT_FOUND": 5, "UNIMPLEMENTED": 12}


def gunzip_bounded(body: bytes, limit: int = MAX_BODY_BYTES) -> bytes:
    """Inflate a gzip body without letting a small bomb expand past ``limit``."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"Content-Encoding is gzip but the body is not valid gzip: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise TooLarge(f"gzip body inflates past the {limit}-byte limit")
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tracerl-collector"
    ingest: Ingest
    token: str | None

    def log_message(self, format: str, *args) -> None:  # quiet: one line per request is noise here
        return

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, content_type: str, retry_after: int | None = None) -> None:
        st = Status(code=_GRPC_CODE_NUMBERS.get(code, 2), message=message)
        if content_type == _PROTOBUF:
            body = st.SerializeToString()
        else:
            content_type = _JSON
            body = json_format.MessageToJson(st, indent=None).encode()
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        self._send(status, body, content_type, headers)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b'{"status":"ok"}', _JSON)
        else:
            self._error(404, "NOT_FOUND", f"no route GET {self.path}; OTLP/HTTP takes POST /v1/traces, /v1/logs, /v1/metrics", _JSON)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        reply_type = _PROTOBUF if ctype == _PROTOBUF else _JSON
        route = _ROUTES.get(path)
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            self._error(411, "INVALID_ARGUMENT", "Content-Length is required", reply_type)
            return
        try:
            length = int(length_header)
        except ValueError:
            self.close_connection = True
            self._error(400, "INVALID_ARGUMENT", f"bad Content-Length {length_header!r}", reply_type)
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread: the connection cannot be reused
            self._error(413, "RESOURCE_EXHAUSTED", f"body of {length} bytes exceeds the {MAX_BODY_BYTES}-byte limit", reply_type)
            return
        body = self.rfile.read(length)
        if route is None:
            self._error(404, "NOT_FOUND", f"no route POST {path}; use one of {sorted(_ROUTES)}", reply_type)
            return
        allowed = (_JSON,) if route == "rewards" else (_PROTOBUF, _JSON)
        if ctype not in allowed:
            self._error(415, "INVALID_ARGUMENT",
                        f"Content-Type {ctype or '(none)'!r} is not supported on {path}; use {' or '.join(allowed)}", reply_type)
            return
        try:
            check_bearer(self.headers.get("Authorization"), self.token)
            if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                body = gunzip_bounded(body)
            elif self.headers.get("Content-Encoding") not in (None, "", "identity"):
                raise BadRequest(f"Content-Encoding {self.headers.get('Content-Encoding')!r} is not supported; use gzip or none")
            if route == "rewards":
                self._send(200, json.dumps(self.ingest.rewards(body)).encode(), _JSON)
                return
            resp = getattr(self.ingest, route)(body, is_json=ctype == _JSON)
        except Exception as exc:
            f = failure_for(exc)
            self._error(f.http_status, f.grpc_code, f.message, reply_type, f.retry_after_s)
            return
        if ctype == _PROTOBUF:
            self._send(200, resp.SerializeToString(), _PROTOBUF)
        else:
            self._send(200, json_format.MessageToJson(resp, indent=None).encode(), _JSON)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def start_http(
    ingest: Ingest, host: str, port: int, *, token: str | None = None, tls: tuple[str, str] | None = None
) -> tuple[ThreadingHTTPServer, int]:
    handler = type("Handler", (_Handler,), {"ingest": ingest, "token": token})
    try:
        server = _Server((host, port), handler)
    except OSError as e:
        raise OSError(f"cannot bind OTLP/HTTP to {host}:{port}: {e}; pass --http HOST:PORT") from None
    if tls:
        cert, key = tls
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="otlp-http", daemon=True).start()
    return server, server.server_address[1]


__all__ = ["gunzip_bounded", "start_http"]
