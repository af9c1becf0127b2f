"""The one HTTP server shell of tracerl: every HTTP server (the collector's OTLP/HTTP receiver,
``tracerl gateway``, ``tracerl serve``) runs its ASGI app through ``start()``.

See ``httpshell.server`` for the stack choice and the guarantees; this package imports no other
tracerl package, so ``collector_exporter`` and ``serving`` can both depend on it without either
depending on the other.
"""

from httpshell.guard import RequestError, bearer_error
from httpshell.server import (
    ErrorRenderer,
    RunningServer,
    ServerOptions,
    exception_handlers,
    header,
    inflate,
    plain_error,
    run_blocking,
    start,
)

__all__ = [
    "ErrorRenderer",
    "RequestError",
    "RunningServer",
    "ServerOptions",
    "bearer_error",
    "exception_handlers",
    "header",
    "inflate",
    "plain_error",
    "run_blocking",
    "start",
]
