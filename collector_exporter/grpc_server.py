"""OTLP/gRPC transport: TraceService, LogsService, MetricsService over ``Ingest``.

Handlers are registered generically with no request deserializer, so the receiver gets the
raw request bytes: it parses them once to validate and appends those same bytes to the WAL
without re-encoding.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo

from collector_exporter.auth import check_bearer
from collector_exporter.receive import MAX_BODY_BYTES, Ingest, failure_for, fit_to_deadline

_SERVICES = {
    "opentelemetry.proto.collector.trace.v1.TraceService": "traces",
    "opentelemetry.proto.collector.logs.v1.LogsService": "logs",
    "opentelemetry.proto.collector.metrics.v1.MetricsService": "metrics",
}


def _handler(ingest: Ingest, method: str, token: str | None):
    fn = getattr(ingest, method)

    def export(request: bytes, context: grpc.ServicerContext):
        try:
            check_bearer(dict(context.invocation_metadata()).get("authorization"), token)
            return fn(request)
        except Exception as exc:
            f = failure_for(exc)
            if f.retry_after_s is not None:
                # The OTel SDK exporter reads this trailer for its backoff (exporter.py, 1.45).
                delay = Duration()
                delay.FromNanoseconds(int(fit_to_deadline(f.retry_after_s, context.time_remaining()) * 1e9))
                info = RetryInfo(retry_delay=delay)
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
            context.abort(getattr(grpc.StatusCode, f.grpc_code), f.message)

    return grpc.unary_unary_rpc_method_handler(export, response_serializer=lambda m: m.SerializeToString())


def start_grpc(
    ingest: Ingest,
    address: str,
    *,
    token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the bound port (``:0`` picks a free one)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="otlp-grpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_BODY_BYTES),
            ("grpc.max_send_message_length", 4 << 20),
        ],
    )
    for service, method in _SERVICES.items():
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"Export": _handler(ingest, method, token)}),)
        )
    if tls:
        key, cert = tls
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind OTLP/gRPC to {address}: address in use or not local; pass --grpc HOST:PORT")
    server.start()
    return server, port
