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
from collector_exporter.wal import Kind, WalClosed, WriteAheadLog

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
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"OTLP/JSON body must be an object, got {type(data).__name__}")
        if cls is ExportTraceServiceRequest:
            _fix_trace_json(data)
        elif cls is ExportLogsServiceRequest:
            _fix_logs_json(data)
        try:
            json_format.ParseDict(data, msg, ignore_unknown_fields=True)
        except json_format.ParseError as e:
            raise BadRequest(f"body is not a valid OTLP/JSON {cls.__name__}: {e}") from None
        return msg
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise BadRequest(f"body is not a valid protobuf {cls.__name__}: {e}") from None
    return msg


# -- validation ----------------------------------------------------------------------------------

def _bad_id(raw: bytes, size: int) -> bool:
    return len(raw) != size or raw == bytes(size)


def drop_invalid_spans(req: ExportTraceServiceRequest) -> tuple[int, int, str]:
    """Remove spans whose ids are unusable (wrong length, all zero); (kept, rejected, reason)."""
    kept = rejected = 0
    reason = ""
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            bad = []
            for i, sp in enumerate(ss.spans):
                if _bad_id(sp.trace_id, 16):
                    bad.append(i)
                    reason = reason or f"span {sp.name!r}: trace_id must be 16 non-zero bytes, got {len(sp.trace_id)}"
                elif _bad_id(sp.span_id, 8):
                    bad.append(i)
                    reason = reason or f"span {sp.name!r}: span_id must be 8 non-zero bytes, got {len(sp.span_id)}"
                elif sp.parent_span_id and len(sp.parent_span_id) != 8:
                    bad.append(i)
                    reason = reason or f"span {sp.name!r}: parent_span_id must be empty or 8 bytes"
            for i in reversed(bad):
                del ss.spans[i]
            rejected += len(bad)
            kept += len(ss.spans)
    return kept, rejected, reason


def drop_invalid_logs(req: ExportLogsServiceRequest) -> tuple[int, int, str]:
    """Log records may lack trace context, but ids that are present must have the right size."""
    kept = rejected = 0
    reason = ""
    for rl in req.resource_logs:
        for sl in rl.scope_logs:
            bad = [
                i
                for i, rec in enumerate(sl.log_records)
                if (rec.trace_id and len(rec.trace_id) != 16) or (rec.span_id and len(rec.span_id) != 8)
            ]
            if bad and not reason:
                reason = "log record trace_id/span_id must be 16/8 bytes when present"
            for i in reversed(bad):
                del sl.log_records[i]
            rejected += len(bad)
            kept += len(sl.log_records)
    return kept, rejected, reason


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
    """Receiver core used by every transport. ``overload`` returns a reason to refuse, or None."""

    def __init__(self, wal: WriteAheadLog, overload: Callable[[], str | None] = lambda: None):
        self.wal = wal
        self.overload = overload
        self.stats = IngestStats()

    def _check_capacity(self) -> None:
        reason = self.overload()
        if reason:
            self.stats.refused_overload += 1
            raise Overloaded(reason)

    def traces(self, body: bytes, *, is_json: bool = False) -> ExportTraceServiceResponse:
        resp = ExportTraceServiceResponse()
        kept, rejected, reason = self._export(body, is_json, ExportTraceServiceRequest, drop_invalid_spans, Kind.TRACES)
        if rejected:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = f"{rejected} span(s) rejected: {reason}"
        self.stats.spans += kept
        return resp

    def logs(self, body: bytes, *, is_json: bool = False) -> ExportLogsServiceResponse:
        resp = ExportLogsServiceResponse()
        kept, rejected, reason = self._export(body, is_json, ExportLogsServiceRequest, drop_invalid_logs, Kind.LOGS)
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
            self.wal.append(kind, payload, time.time_ns())
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
        self.wal.append(Kind.REWARDS, json.dumps(rows).encode(), time.time_ns())
        self.stats.rewards += len(rows)
        return {"accepted": len(rows), "reward_ids": [r["reward_id"] for r in rows]}
