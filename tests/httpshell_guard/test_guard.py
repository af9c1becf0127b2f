"""The ASGI guard's per-request decisions: pure (what is refused on the head alone) and through a real server on
127.0.0.1 (a chunked body cut at the limit, a handler's ``RequestError`` answered in the server's shape, an
answer over an unread body closing the connection)."""

from __future__ import annotations

import socket

import pytest

from httpshell import RequestError, ServerOptions, start
from httpshell.guard import _refusal, _request_head

TOKEN = "t0k"
OPTS = ServerOptions(
    token=TOKEN, public_paths=frozenset({"/health"}), auth_hint=" (set X)", max_body_bytes=100
)


def scope(path: str = "/v1/x", headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {"type": "http", "path": path, "headers": headers or []}


def test_the_head_fields_are_read_once_whatever_the_case_of_the_encoding():
    head = [(b"content-length", b"12"), (b"transfer-encoding", b"CHUNKED"), (b"authorization", b"Bearer t")]
    assert _request_head(scope(headers=head)) == (b"12", True, "Bearer t")
    assert _request_head(scope()) == (None, False, None)


@pytest.mark.parametrize(
    "path,length,auth,expected",
    [
        ("/v1/x", None, None, 401),  # no token
        ("/v1/x", None, "Bearer nope", 401),
        ("/health", None, None, None),  # public path: no token needed
        ("/v1/x", b"100", "bearer t0k", None),  # at the limit, scheme case-insensitive
        ("/v1/x", b"101", "Bearer t0k", 413),
        ("/v1/x", b"-1", "Bearer t0k", 400),
        ("/v1/x", b"12abc", "Bearer t0k", 400),
        ("/v1/x", b"101", None, 401),  # the token is checked before the length
    ],
)
def test_a_request_is_refused_on_its_head_for_the_first_cause(path, length, auth, expected):
    got = _refusal(scope(path), OPTS, length, auth)
    assert (got[0] if got else None) == expected
    if expected == 401:
        assert got[1].endswith(" (set X)") and got[2] == {"www-authenticate": "Bearer"}
    if expected == 413:
        assert "101 bytes exceeds the 100-byte limit" in got[1]


async def _app(scope: dict, receive, send) -> None:
    """Reads the whole body unless the path says not to; ``/refuse`` raises the shell's RequestError."""
    if scope["path"] == "/refuse":
        raise RequestError(409, "refused by the handler", {"x-why": "test"})
    body = b""
    if scope["path"] != "/unread":
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"got %d" % len(body)})


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.settimeout(10)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out and (b"got " in out or b"limit" in out or b"refused" in out):
                break
        return out


def test_through_a_server_bodies_are_bounded_and_errors_keep_the_servers_shape():
    server = start(_app, ServerOptions(max_body_bytes=100))
    try:
        chunk = b"40\r\n" + b"a" * 64 + b"\r\n"
        big = b"POST /v1 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2 + b"0\r\n\r\n"
        out = _exchange(server.port, big)
        assert out.startswith(b"HTTP/1.1 413") and b"body exceeds the 100-byte limit" in out
        small = b"POST /v1 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk + b"0\r\n\r\n"
        assert b"got 64" in _exchange(server.port, small)
        out = _exchange(server.port, b"GET /refuse HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 409") and b"x-why: test" in out and b"refused by the handler" in out
        out = _exchange(
            server.port, b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789"
        )
        assert out.startswith(b"HTTP/1.1 200") and b"connection: close" in out.lower()
    finally:
        server.stop()
