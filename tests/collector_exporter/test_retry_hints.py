"""Retry hints grow with the backlog (and with how long refusals last) and fit a gRPC client's deadline."""

from __future__ import annotations

import grpc
import pytest
from google.rpc.error_details_pb2 import RetryInfo

from collector_exporter.receive import MAX_RETRY_S, fit_to_deadline, retry_hint_s
from collector_exporter.testing import running_collector

from .helpers import trace_request
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
