"""Bearer-token check shared by both transports (the HTTP one runs it in ``httpshell``, before
any body is read; gRPC calls ``check_bearer``). One rule for both: ``httpshell.bearer_error``
(scheme case-insensitive per RFC 7235, constant-time compare)."""

from __future__ import annotations

from collector_exporter.receive import Unauthenticated
from httpshell import bearer_error

AUTH_HINT = " (set OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token> to the collector's --token)"


def check_bearer(header_value: str | None, token: str | None) -> None:
    """Raise ``Unauthenticated`` unless ``header_value`` is ``Bearer <token>`` (no-op without a token)."""
    why = bearer_error(header_value, token)
    if why:
        raise Unauthenticated(why + AUTH_HINT)
