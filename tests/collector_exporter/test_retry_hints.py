"""Retry hints grow with the backlog (and with how long refusals last) and fit a gRPC client's deadline."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from collector_exporter.receive import MAX_RETRY_S, fit_to_deadline, retry_hint_s
from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly

from .helpers import make_spans, trace_request
from .test_receivers import EXPORT


def test_hint_is_the_time_to_drain_the_backlog_below_the_resume_level():
    mib = 1 << 20
    assert retry_hint_s(120 * mib, 100 * mib, drain_bytes_per_s=10 * mib, refusing_for_s=0) == 2
    assert retry_hint_s(300 * mib, 100 * mib, drain_bytes_per_s=10 * mib, refusing_for_s=0) == 20
    assert retry_hint_s(10_000 * mib, 100 * mib, drain_bytes_per_s=10 * mib, refusing_for_s=0) == MAX_RETRY_S


def test_without_a_drain_rate_the_hint_grows_with_how_long_refusals_last():
    hints = [retry_hint_s(0, 0, 0.0, t) for t in (0, 3, 9, 21, 45)]
    assert hints == [3, 6, 12, 24, 30]  # an exporter honouring them waits 3+6+12+24+30 = 75 s over 6 tries


def test_a_hint_is_shortened_to_fit_the_callers_deadline():
    assert fit_to_deadline(12, 100.0) == 12
    assert fit_to_deadline(12, 5.0) == pytest.approx(4.5)
    assert fit_to_deadline(12, None) == 12


def test_grpc_refusal_carries_a_hint_inside_the_client_deadline(store):
    with running_collector(store, min_free_disk_bytes=1 << 60) as c:  # refused as if the disk were full
        c.ingest.retry_after = lambda: 30  # as after a long outage
        with grpc.insecure_channel(c.grpc_endpoint.removeprefix("http://")) as ch:
            call = ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                call(trace_request(1).SerializeToString(), timeout=20)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    info = RetryInfo.FromString(dict(e.value.trailing_metadata())["google.rpc.retryinfo-bin"])
    delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    assert 1 < delay < 20  # 30 s by policy, cut to fit: the SDK exporter retries instead of giving up


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_real_sdk_exporter_waits_out_a_refusal_and_delivers(store, protocol):
    """OTLPSpanExporter 1.45 with default settings: refused (as if the disk were full), it waits the
    hint and retries; the disk frees meanwhile, and the batch is delivered, not dropped."""
    with running_collector(store, min_free_disk_bytes=1 << 60) as c:
        exporter = (
            GrpcExporter(endpoint=c.grpc_endpoint.removeprefix("http://"), insecure=True)
            if protocol == "grpc"
            else HttpExporter(endpoint=c.http_endpoint + "/v1/traces")
        )
        spans = make_spans(20)
        result: list[SpanExportResult] = []
        worker = threading.Thread(target=lambda: result.append(exporter.export(spans)))
        worker.start()
        deadline = time.monotonic() + 30
        while c.ingest.stats.refused_overload == 0:  # the first attempt was refused with a hint
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.02)
        guard = c.ingest.overload
        guard.min_free, guard._at = 0, 0.0  # space again: the next measurement accepts
        worker.join(timeout=60)
        exporter.shutdown()
        assert result == [SpanExportResult.SUCCESS]
        c.flush()
    stored = (
        connect_readonly(parse_store(store))
        .execute("SELECT count(DISTINCT (trace_id, span_id)) FROM spans")
        .fetchone()[0]
    )
    assert stored == 20
