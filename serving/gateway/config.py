"""What one gateway process is set up with: its settings (``GatewayConfig``), its upstreams' URLs, and the
tracer provider that exports its spans.

Split from ``proxy.py`` (the proxy itself); it, the CLI and the tests import these names from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

# Spans exported per batch at most: the SDK's default. The exporter encodes a batch on its own thread with the
# GIL held, taking turns with the serving loop every switch interval (workers.py), so while it encodes the loop
# runs at about half speed; batches of 64 were tried against 512 at 256 streams in one run (load 0.8): p99
# +30.4 ms against +31.1, CPU per call 1.04 ms against 1.05, no difference, so the default stays.
EXPORT_BATCH_SPANS = 512


def span_processor(
    exporter: SpanExporter, schedule_delay_millis: int = 500, max_queue_size: int = 2048
) -> BatchSpanProcessor:
    """The gateway's span processor: batches of at most ``EXPORT_BATCH_SPANS``, exported when one is full
    or ``schedule_delay_millis`` after the last export; spans beyond ``max_queue_size`` waiting (the SDK's
    default) are dropped. The bench's rig exports through it too."""
    return BatchSpanProcessor(
        exporter,
        schedule_delay_millis=schedule_delay_millis,
        max_export_batch_size=EXPORT_BATCH_SPANS,
        max_queue_size=max_queue_size,
    )


@dataclass
class GatewayConfig:
    """Settings of one gateway process."""

    upstreams: list[str] = field(default_factory=list)
    token: str | None = None
    upstream_api_key: str | None = None
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_connections: int = 1024  # client connections; as many upstream connections at most
    tls_cert: str | None = None  # PEM chain; with tls_key the gateway speaks HTTPS only
    tls_key: str | None = None
    latest_alias: bool = True  # "policy" -> newest "policy@k" the upstream serves
    models_ttl_s: float = 2.0  # how long a /v1/models answer is trusted for the alias
    version_max_age_s: float = 0.25  # a weight-version read this fresh is reused before sending a call
    reuse_port: bool = False  # other processes serve the same port (--workers, serving/gateway/workers.py)
    canary: float | None = None  # the candidate's share of new rollouts (canary.py); needs upstream_for
    upstream_for: dict[str, str] = field(default_factory=dict)  # "policy@5" -> URL: the canary's two arms
    record_content: bool = True  # chat spans carry the request messages and response (the content join)


def normalise_upstream(url: str) -> str:
    """``http://host:8000/v1/`` and ``http://host:8000`` both -> ``http://host:8000``."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"upstream {url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8000")
    return u


def make_tracer_provider(otlp_endpoint: str, service_name: str = "tracerl-gateway") -> TracerProvider:
    """A provider exporting with BatchSpanProcessor + OTLP/gRPC, separate from any global one."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = otlp_endpoint.startswith("http://") or "://" not in otlp_endpoint
    # process.pid tells the spans of --workers processes apart (each exports its own)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, "process.pid": os.getpid()})
    )
    provider.add_span_processor(span_processor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure)))
    return provider
