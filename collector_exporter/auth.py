"""Bearer-token check shared by both transports (constant-time compare)."""

from __future__ import annotations

import hmac

from collector_exporter.receive import Unauthenticated


def check_bearer(header_value: str | None, token: str | None) -> None:
    """Raise ``Unauthenticated`` unless ``header_value`` is ``Bearer <token>`` (no-op without a token)."""
    if not token:
        return
    if not header_value:
        raise Unauthenticated("missing 'authorization: Bearer <token>' (set OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>)")
    if not hmac.compare_digest(header_value.encode(), f"Bearer {token}".encode()):
        raise Unauthenticated("bearer token does not match the collector's --token")
