"""A thread-per-connection stdlib HTTP server, kept only for scripted upstreams in tests and benches.

The gateway and ``tracerl serve`` run on ``httpshell`` (``serving/asgi.py``). Test doubles that must
misbehave on demand (sleep, break a stream, answer garbage) are simplest as blocking handlers, and
nothing here faces a client we did not write: JSON helpers, a body-size limit (413), an optional
bearer token (401), TCP_NODELAY and one write per small response.
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from serving.asgi import HTTPError
from serving.protocol import error_body


class Server(ThreadingHTTPServer):
    """Threaded server that knows its URL and can run in a background thread (tests, benches)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_background(self) -> Server:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{type(self).__name__}-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread:
            self._thread.join(timeout=5)


class Handler(BaseHTTPRequestHandler):
    """Base request handler: JSON in/out, SSE out, size limit and bearer auth."""

    protocol_version = "HTTP/1.1"
    server_version = "tracerl"
    sys_version = ""
    max_body_bytes = 8 * 1024 * 1024
    quiet = True

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    # -- input -----------------------------------------------------------------------------

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise HTTPError(411, "chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise HTTPError(400, "bad Content-Length header") from None
        if length > self.max_body_bytes:
            self.close_connection = True  # the unread body would corrupt the next request
            raise HTTPError(413, f"request body of {length} bytes exceeds the limit of "
                                 f"{self.max_body_bytes} bytes", "RequestTooLarge")
        return self.rfile.read(length) if length else b""

    def read_json(self) -> dict[str, Any]:
        raw = self.read_body()
        try:
            obj = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}", "BadRequestError") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, "request body must be a JSON object", "BadRequestError")
        return obj

    def check_bearer(self, token: str | None) -> None:
        """Constant-time check of ``Authorization: Bearer <token>`` when a token is configured."""
        if not token:
            return
        got = self.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise HTTPError(401, "missing or wrong bearer token", "AuthenticationError")

    # -- output ----------------------------------------------------------------------------

    def send_bytes(self, status: int, body: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers_with(body)

    def end_headers_with(self, body: bytes) -> None:
        """Write headers and a small body in one ``send`` (stdlib would do two)."""
        self._headers_buffer.append(b"\r\n")  # type: ignore[attr-defined]
        self._headers_buffer.append(body)  # type: ignore[attr-defined]
        self.flush_headers()

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        self.send_bytes(status, body, "application/json", headers)

    def send_error_json(self, err: HTTPError) -> None:
        self.send_json(err.status, error_body(err.message, err.err_type, err.status, err.param))

    def start_stream(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
