"""The receiver, protocol-free: decode → validate → WAL append (fsync) → response.

gRPC and HTTP are thin shells over ``Ingest``; nothing is converted here (the collector's
receiver/processor split). Every failure is one of three exceptions, and ``failure_for`` is the
single place that maps them to gRPC codes and HTTP statuses, per the OTLP spec
(opentelemetry-proto docs/specification.md, "Failures" and "OTLP/HTTP Throttling"):
malformed → INVALID_ARGUMENT / 400 (never retried); overload → UNAVAILABLE + RetryInfo /
503 + Retry-After (retried by the SDK exporter, so nothing is lost).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from collector_exporter.rewards import RewardError, parse_rewards
from collector_exporter.storable import drop_unstorable_logs, drop_unstorable_spans
from collector_exporter.wal import Kind, WalClosed, WalWriteError, WriteAheadLog

MAX_BODY_BYTES = 64 << 20  # the gRPC max receive size; HTTP bodies and gunzipped bodies alike


class BadRequest(Exception):
    """The payload can never be accepted as sent: do not retry."""


class TooLarge(BadRequest):
    """Body over the size limit."""


class Overloaded(Exception):
    """Transient: WAL backlog or disk space. The client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 2):
        super().__init__(message)
        self.retry_after_s = retry_after_s


MIN_RETRY_S, MAX_RETRY_S = 1, 30


def retry_hint_s(backlog_bytes: int, resume_below_bytes: int, drain_bytes_per_s: float, refusing_for_s: float) -> int:
    """Seconds a refused client should wait before retrying: the RetryInfo / Retry-After value.

    It grows with the backlog: the time the compactor needs to drain it below the level where
    the collector accepts again, at the drain rate measured while refusing. When nothing drains
    (a full disk, a failing compaction) no estimate exists: the hint is 3 s plus the time refusals
    have lasted, so an exporter that keeps retrying doubles its wait each time. Clamped to [1, 30] s.

    The OTel SDK exporters (1.45) wait exactly this long between their at most 6 attempts, but
    give up once it exceeds what is left of their export timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``,
    10 s by default), so no hint lets a default exporter ride out more than about 10 s; with
    the timeout raised (e.g. 120 s) these hints carry one batch through a 60 s outage
    (``bench/overload_retry.py`` measures both).
    """
    excess = max(0, backlog_bytes - resume_below_bytes)
    wait = excess / drain_bytes_per_s if excess and drain_bytes_per_s > 0 else 3 + refusing_for_s
    return int(min(MAX_RETRY_S, max(MIN_RETRY_S, round(wait))))


def fit_to_deadline(retry_after_s: float, deadline_left_s: float | None) -> float:
    """The hint shortened to fit a client's remaining deadline, when the protocol tells it (gRPC).

    The SDK exporter's deadline covers the whole export, retries included, and it gives up as
    soon as a hint exceeds what is left of it; a hint just inside keeps it trying until its
    budget is spent (about 10 s by default) instead of dropping the batch at once."""
    if deadline_left_s is None or deadline_left_s <= 0.2:
        return float(retry_after_s)
    return min(float(retry_after_s), deadline_left_s * 0.9)


class Unauthenticated(Exception):
    """Missing or wrong bearer token."""


@dataclass(frozen=True)
class Failure:
    grpc_code: str  # grpc.StatusCode name
    http_status: int
    message: str
    retry_after_s: int | None = None


def failure_for(exc: BaseException) -> Failure:
    """The one mapping from receiver failures to protocol answers."""
    if isinstance(exc, TooLarge):
        return Failure("RESOURCE_EXHAUSTED", 413, str(exc))
    if isinstance(exc, BadRequest):
        return Failure("INVALID_ARGUMENT", 400, str(exc))
    if isinstance(exc, Unauthenticated):
        return Failure("UNAUTHENTICATED", 401, str(exc))
    if isinstance(exc, Overloaded):
        return Failure("UNAVAILABLE", 503, str(exc), exc.retry_after_s)
    if isinstance(exc, WalClosed):
        return Failure("UNAVAILABLE", 503, f"{exc}; retry", 1)
    return Failure("UNAVAILABLE", 503, f"collector could not store the data ({type(exc).__name__}: {exc}); retry", 5)


# -- OTLP/JSON ---------------------------------------------------------------------------------
# OTLP/JSON differs from the protobuf JSON mapping in one way that matters: trace and span ids
# are hex, not base64 (opentelemetry-proto docs/specification.md, "JSON Protobuf Encoding").

def _hex_to_b64(obj: dict, key: str, where: str) -> None:
    v = obj.get(key)
    if v is None or v == "":
        return
    if not isinstance(v, str):
        raise BadRequest(f"{where}.{key} must be a hex string, got {type(v).__name__}")
    try:
        obj[key] = base64.b64encode(bytes.fromhex(v)).decode()
    except ValueError:
        raise BadRequest(f"{where}.{key} is not hex: {v[:40]!r}") from None


def _fix_trace_json(d: dict) -> None:
    for i, rs in enumerate(d.get("resourceSpans") or []):
        for j, ss in enumerate(rs.get("scopeSpans") or []):
            for k, sp in enumerate(ss.get("spans") or []):
                where = f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]"
                for key in ("traceId", "spanId", "parentSpanId"):
                    _hex_to_b64(sp, key, where)
                for m, ln in enumerate(sp.get("links") or []):
                    for key in ("traceId", "spanId"):
                        _hex_to_b64(ln, key, f"{where}.links[{m}]")


def _fix_logs_json(d: dict) -> None:
    for i, rl in enumerate(d.get("resourceLogs") or []):
        for j, sl in enumerate(rl.get("scopeLogs") or []):
            for k, rec in enumerate(sl.get("logRecords") or []):
                for key in ("traceId", "spanId"):
                    _hex_to_b64(rec, key, f"resourceLogs[{i}].scopeLogs[{j}].logRecords[{k}]")


def decode(body: bytes, cls: type[Message], *, is_json: bool) -> Message:
    msg = cls()
    if is_json:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int past Python's digit limit, too deep
            raise BadRequest(f"body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"OTLP/JSON body must be an object, got {type(data).__name__}")
        try:
            if cls is ExportTraceServiceRequest:
                _fix_trace_json(data)
            elif cls is ExportLogsServiceRequest:
                _fix_logs_json(data)
            json_format.ParseDict(data, msg, ignore_unknown_fields=True)
        except BadRequest:
            raise
        except (json_format.ParseError, AttributeError, TypeError, ValueError, RecursionError) as e:
            # wrong shapes (a list where an object belongs, a number where a list does) land here
            raise BadRequest(f"body is not a valid OTLP/JSON {cls.__name__}: {type(e).__name__}: {str(e)[:300]}") from None
        return msg
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(f"body is not a valid protobuf {cls.__name__}: {e}") from None
    return msg


def _check_size(body: bytes) -> None:
    if len(body) > MAX_BODY_BYTES:
        raise TooLarge(f"request of {len(body)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")


@dataclass
class IngestStats:
    requests: int = 0
    spans: int = 0
    logs: int = 0
    rewards: int = 0
    rejected: int = 0
    refused_overload: int = 0


class Ingest:
    """Receiver core used by every transport. ``overload`` returns a reason to refuse, or None;
    ``retry_after`` the hint (seconds) to send with a refusal (see ``retry_hint_s``)."""

    def __init__(self, wal: WriteAheadLog, overload: Callable[[], str | None] = lambda: None,
                 retry_after: Callable[[], int] = lambda: 2):
        self.wal = wal
        self.overload = overload
        self.retry_after = retry_after
        self.stats = IngestStats()

    def _check_capacity(self) -> None:
        reason = self.overload()
        if reason:
            self.stats.refused_overload += 1
            raise Overloaded(reason, self.retry_after())

    def _append(self, kind: Kind, payload: bytes) -> None:
        """WAL append; a write that failed (disk full, I/O error) is a retryable refusal, never an ack."""
        try:
            self.wal.append(kind, payload, time.time_ns())
        except WalWriteError as e:
            self.stats.refused_overload += 1
            raise Overloaded(f"{e}; retry", self.retry_after()) from e

    def traces(self, body: bytes, *, is_json: bool = False) -> ExportTraceServiceResponse:
        resp = ExportTraceServiceResponse()
        kept, rejected, reason = self._export(body, is_json, ExportTraceServiceRequest, drop_unstorable_spans, Kind.TRACES)
        if rejected:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = f"{rejected} span(s) rejected: {reason}"
        self.stats.spans += kept
        return resp

    def logs(self, body: bytes, *, is_json: bool = False) -> ExportLogsServiceResponse:
        resp = ExportLogsServiceResponse()
        kept, rejected, reason = self._export(body, is_json, ExportLogsServiceRequest, drop_unstorable_logs, Kind.LOGS)
        if rejected:
            resp.partial_success.rejected_log_records = rejected
            resp.partial_success.error_message = f"{rejected} log record(s) rejected: {reason}"
        self.stats.logs += kept
        return resp

    def _export(self, body: bytes, is_json: bool, cls: type[Message],
                drop_invalid: Callable[[Message], tuple[int, int, str]], kind: Kind) -> tuple[int, int, str]:
        """Decode, drop what can never be stored, append the rest durably: (kept, rejected, reason).

        The WAL gets the client's own bytes when nothing was dropped and they were protobuf, so the
        hot path never re-encodes.
        """
        _check_size(body)
        req = decode(body, cls, is_json=is_json)
        kept, rejected, reason = drop_invalid(req)
        if kept:
            self._check_capacity()
            payload = body if (not rejected and not is_json) else req.SerializeToString()
            self._append(kind, payload)
        self.stats.rejected += rejected
        self.stats.requests += 1
        return kept, rejected, reason

    def metrics(self, body: bytes, *, is_json: bool = False) -> ExportMetricsServiceResponse:
        """Accepted (so agents exporting metrics to the same endpoint see no errors) and dropped."""
        _check_size(body)
        decode(body, ExportMetricsServiceRequest, is_json=is_json)
        self.stats.requests += 1
        return ExportMetricsServiceResponse()

    def rewards(self, body: bytes) -> dict:
        _check_size(body)
        try:
            rows = parse_rewards(body)
        except RewardError as e:
            raise BadRequest(str(e)) from None
        self._check_capacity()
        self._append(Kind.REWARDS, json.dumps(rows).encode())
        self.stats.rewards += len(rows)
        return {"accepted": len(rows), "reward_ids": [r["reward_id"] for r in rows]}
