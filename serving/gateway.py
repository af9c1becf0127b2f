"""Token-capturing OpenAI-compatible gateway (``tracerl gateway``).

Standard instrumentation records message text, never token ids, and retraining on
re-tokenised text drifts. The gateway sits on the agent's ``OPENAI_BASE_URL`` path, asks the
engine (vLLM >= 0.10.2 or ``tracerl serve``) for ``return_token_ids`` and the sampled tokens'
``logprobs``, returns to the client exactly what it asked for, and records one span per call
with the exact ids, parented on the client's W3C ``traceparent`` so the converter can join it
to the agent's own span. ``gen_ai.response.id`` is the upstream's id, passed through unchanged,
as a second join key.

Several upstreams: a call goes to the upstream chosen by rendezvous hashing of its rollout id
(``X-Tracerl-Rollout-Id`` header, else ``tracerl.rollout_id`` in W3C ``baggage``) or its trace id,
so one rollout stays on one engine (prefix cache, one policy version); on a refused connection
the next upstream is tried, since nothing ran there.

Latest-version alias (on by default): an unmodified agent asks for ``policy`` while the trainer
publishes LoRA adapters ``policy@k``; the gateway sends the call to the newest ``policy@k`` the
upstream lists in ``/v1/models`` (cached ``models_ttl_s``; a 404 on a just-unloaded version
refreshes and retries once). The span keeps the requested name in ``gen_ai.request.model`` and
the served one in ``gen_ai.response.model`` / ``tracerl.policy_version``. After a full-weight
reload the served name stays ``policy``; the publisher then sets the server's weight version
(``/update_weight_version``) and the gateway reads it from ``GET /weight_info`` (same cache), so
``tracerl.policy_version`` is known for full reloads too, within ``models_ttl_s`` of the switch.
Upstream errors are passed through with their status; an unreachable upstream is a 502 and a
timeout a 504, each an OpenAI-style error body, and the span records ``error.type``.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serving.httpserver import Handler, HTTPError, Server
from serving.protocol import (
    OPERATIONS,
    SSE_DONE,
    CallRecord,
    StreamAccumulator,
    error_body,
    error_message,
    iter_sse_data,
    latest_version_name,
    pick_upstream,
    prepare_upstream_body,
    record_from_response,
    rollout_from_baggage,
    span_attributes,
    sse_data,
    strip_chunk,
    strip_response,
    trace_id_from_traceparent,
)

log = logging.getLogger("tracerl.gateway")
ROLLOUT_HEADER = "X-Tracerl-Rollout-Id"
GATEWAY_TOKEN_HEADER = "X-Tracerl-Gateway-Token"
# Client headers forwarded upstream; everything else (Host, Content-Length, hop-by-hop) is ours.
_FORWARD = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "X-Request-Id", "User-Agent")
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass
class GatewayConfig:
    """Settings of one gateway process."""

    upstreams: list[str] = field(default_factory=list)
    token: str | None = None
    upstream_api_key: str | None = None
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    latest_alias: bool = True  # "policy" -> newest "policy@k" the upstream serves
    models_ttl_s: float = 2.0  # how long a /v1/models answer is trusted for the alias


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
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure),
                                                   schedule_delay_millis=500))
    return provider


@dataclass
class UpstreamState:
    """What the gateway last learned from an upstream: served names and its weight version."""

    at: float
    names: list[str]
    weight_version: str | None


class Gateway(Server):
    """The proxy server. ``tracer_provider`` is injected so tests can read spans in memory."""

    def __init__(self, address: tuple[str, int], config: GatewayConfig, tracer_provider: TracerProvider,
                 client: httpx.Client | None = None):
        if not config.upstreams:
            raise ValueError("no upstreams configured; pass --upstream URL[,URL...]")
        self.config = config
        self.upstreams = [normalise_upstream(u) for u in config.upstreams]
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("tracerl.gateway")
        self.client = client or httpx.Client(
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._rr = itertools.count()
        self._state: dict[str, UpstreamState] = {}
        self.plain_upstreams: set[str] = set()  # upstreams that refuse return_token_ids
        self.warned_no_ids: set[str] = set()
        self._state_lock = threading.Lock()
        handler = type("BoundGatewayHandler", (GatewayHandler,), {"max_body_bytes": config.max_body_bytes})
        super().__init__(address, handler)

    def upstream_order(self, key: str | None) -> list[int]:
        first = pick_upstream(key, self.upstreams, next(self._rr))
        n = len(self.upstreams)
        return [(first + k) % n for k in range(n)]

    def upstream_state(self, upstream: str, headers: dict[str, str], refresh: bool = False) -> UpstreamState:
        """The upstream's served names and weight version, cached ``models_ttl_s`` (stale on errors)."""
        now = time.monotonic()
        got = self._state.get(upstream)
        if got is not None and not refresh and now - got.at < self.config.models_ttl_s:
            return got
        with self._state_lock:
            got = self._state.get(upstream)
            if got is not None and not refresh and now - got.at < self.config.models_ttl_s:
                return got  # another thread refreshed it while we waited
            try:
                r = self.client.get(upstream + "/v1/models", headers=headers)
                names = [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
                w = self.client.get(upstream + "/weight_info", headers=headers)  # vLLM dev mode, main > 0.12
                version = w.json().get("weight_version") if w.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                return got or UpstreamState(0.0, [], None)
            state = UpstreamState(time.monotonic(), names, str(version) if version is not None else None)
            self._state[upstream] = state
            return state

    def stop(self) -> None:
        super().stop()
        self.client.close()


class GatewayHandler(Handler):
    server: Gateway

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        try:
            self._auth()
            if path == "/health":
                self.send_bytes(200, b"", "application/json")
            elif path == "/v1/models":
                self._passthrough_get("/v1/models")
            else:
                raise HTTPError(404, f"{path} is not served by the tracerl gateway "
                                     f"(POST /v1/chat/completions, /v1/completions; GET /v1/models)", "NotFoundError")
        except HTTPError as e:
            self.send_error_json(e)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        op = OPERATIONS.get(path)
        try:
            self._auth()
            if op is None:
                self.read_body()
                raise HTTPError(404, f"{path} is not served by the tracerl gateway "
                                     f"(POST /v1/chat/completions, /v1/completions; GET /v1/models)", "NotFoundError")
            self._proxy(path, op)
        except HTTPError as e:
            self.send_error_json(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug or an upstream surprise must not kill the connection silently
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.send_json(500, error_body(f"gateway error: {type(e).__name__}: {e}", "gateway_error", 500))

    # -- auth and headers ------------------------------------------------------------------

    def _auth(self) -> None:
        """Own token via ``X-Tracerl-Gateway-Token`` (client auth then passes through) or bearer."""
        token = self.server.config.token
        self._replace_auth = False
        if not token:
            return
        if self.headers.get(GATEWAY_TOKEN_HEADER) is not None:
            if not hmac.compare_digest(self.headers[GATEWAY_TOKEN_HEADER].encode(), token.encode()):
                raise HTTPError(401, "wrong gateway token", "AuthenticationError")
            return
        self.check_bearer(token)
        self._replace_auth = True  # the bearer was ours; the upstream gets its own key or none

    def _upstream_headers(self) -> dict[str, str]:
        h = {k: v for k in _FORWARD if (v := self.headers.get(k)) is not None}
        key = self.server.config.upstream_api_key
        if self._replace_auth:
            h.pop("Authorization", None)
        if key and "Authorization" not in h:
            h["Authorization"] = f"Bearer {key}"
        h["Content-Type"] = "application/json"
        return h

    def _passthrough_get(self, path: str) -> None:
        last: Exception | None = None
        for i in self.server.upstream_order(None):
            url = self.server.upstreams[i] + path
            try:
                r = self.server.client.get(url, headers=self._upstream_headers())
            except httpx.TransportError as e:
                last = e
                continue
            self.send_bytes(r.status_code, r.content, r.headers.get("content-type", "application/json"))
            return
        raise HTTPError(502, f"no upstream reachable ({type(last).__name__}: {last}); check that the model "
                             f"server is running at {', '.join(self.server.upstreams)}", "upstream_unreachable")

    # -- the proxied call ------------------------------------------------------------------

    def _proxy(self, path: str, op: str) -> None:
        start = time.time_ns()
        body = self.read_json()
        model = body.get("model")
        parent = _PROPAGATOR.extract(carrier={"traceparent": self.headers.get("traceparent", ""),
                                              "tracestate": self.headers.get("tracestate", "")})
        span = self.server.tracer.start_span(f"tracerl.gateway {model}", context=parent, kind=SpanKind.CLIENT,
                                             start_time=start)
        upstream = self.server.upstreams[0]
        rec: CallRecord | None = None
        try:
            up_body, wants = prepare_upstream_body(body, op)
            headers = self._upstream_headers()
            _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
            key = (self.headers.get(ROLLOUT_HEADER) or rollout_from_baggage(self.headers.get("baggage"))
                   or trace_id_from_traceparent(self.headers.get("traceparent")))
            last: Exception | None = None
            for i in self.server.upstream_order(key):
                upstream = self.server.upstreams[i]
                try:
                    resp = self._send(upstream, path, body, up_body, headers, wants.stream)
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing ran there: try the next one
                    last = e
                    continue
                except httpx.TimeoutException as e:
                    raise _UpstreamFailure(504, "upstream_timeout", type(e).__name__,
                                           f"upstream {upstream} did not answer within its timeout "
                                           f"({type(e).__name__}); raise --timeout-s if generations are long") from e
                except httpx.TransportError as e:
                    raise _UpstreamFailure(502, "upstream_error", type(e).__name__,
                                           f"upstream {upstream} failed: {type(e).__name__}: {e}") from e
                try:
                    rec = self._relay(resp, body, op, wants, upstream)
                finally:
                    resp.close()
                break
            else:
                raise _UpstreamFailure(502, "upstream_unreachable", type(last).__name__,
                                       f"no upstream reachable ({type(last).__name__}: {last}); check that the "
                                       f"model server is running at {', '.join(self.server.upstreams)}")
        except _UpstreamFailure as f:
            rec = f.record or rec
            span.set_attribute("error.type", f.error_type)
            span.set_status(Status(StatusCode.ERROR, f.message))
            if not f.sent:
                self.send_json(f.status, error_body(f.message, f.err_type, f.status))
        except HTTPError as e:
            span.set_attribute("error.type", str(e.status))
            span.set_status(Status(StatusCode.ERROR, e.message))
            raise
        except (BrokenPipeError, ConnectionResetError) as e:
            span.set_attribute("error.type", "client_disconnected")
            span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            state = self.server._state.get(upstream)
            attrs = span_attributes(rec or CallRecord(operation=op, request_model=model), upstream,
                                    weight_version=state.weight_version if state else None)
            span.set_attributes(attrs)
            span.end()

    def _send(self, upstream: str, path: str, client_body: dict, up_body: dict, headers: dict[str, str],
              stream: bool) -> httpx.Response:
        """POST to one upstream, retrying once for each of two recoverable refusals.

        A 404 for a latest-version alias means the version was unloaded since the gateway looked:
        refresh the list and retry. A 400 naming ``return_token_ids`` means the upstream is not
        vLLM >= 0.10.2 (e.g. the OpenAI API rejects unknown fields): remember that, and send the
        client's own request from now on, so the agent keeps working (its spans then lack ids).
        """
        gw = self.server
        plain = upstream in gw.plain_upstreams
        refreshed = False
        while True:
            body = client_body if plain else up_body
            state = gw.upstream_state(upstream, headers, refreshed)  # cached; also feeds the span's version
            alias = latest_version_name(body.get("model"), state.names) if gw.config.latest_alias else None
            payload = json.dumps({**body, "model": alias} if alias else body, separators=(",", ":")).encode()
            resp = gw.client.send(gw.client.build_request("POST", upstream + path, content=payload, headers=headers),
                                  stream=stream)
            if alias and resp.status_code == 404 and not refreshed:  # unloaded since we looked: look again
                resp.close()
                refreshed = True
                continue
            if resp.status_code == 400 and not plain and "return_token_ids" in resp.read().decode("utf-8", "replace"):
                log.warning("upstream %s refuses return_token_ids (not vLLM >= 0.10.2); proxying its calls "
                            "unchanged, so their spans carry no token ids", upstream)
                gw.plain_upstreams.add(upstream)
                resp.close()
                plain = True
                continue
            return resp

    def _relay(self, resp: httpx.Response, body: dict, op: str, wants: Any, upstream: str) -> CallRecord | None:
        if resp.status_code != 200:
            raw = resp.read()
            try:
                err = json.loads(raw)
            except json.JSONDecodeError:
                err = None
            msg = error_message(err) if err is not None else raw.decode("utf-8", "replace")[:500]
            out = err if isinstance(err, dict) and isinstance(err.get("error"), dict) else \
                error_body(msg or f"upstream answered HTTP {resp.status_code}", "upstream_error", resp.status_code)
            self.send_json(resp.status_code, out)
            raise _UpstreamFailure(resp.status_code, "upstream_error", str(resp.status_code),
                                   f"upstream {upstream} answered {resp.status_code}: {msg}", sent=True)
        if not wants.stream:
            try:
                data = json.loads(resp.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _UpstreamFailure(502, "upstream_error", "invalid_response",
                                       f"upstream {upstream} answered 200 with a body that is not JSON ({e})") from e
            rec = record_from_response(body, data, op)
            self.send_json(200, strip_response(data, wants))
            self._warn_if_no_ids(rec, upstream)
            return rec
        acc = StreamAccumulator(body, op)
        self.start_stream()
        failure: _UpstreamFailure | None = None
        try:
            for payload in iter_sse_data(resp.iter_lines()):
                if payload == "[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except json.JSONDecodeError:
                    chunk = error_body(f"upstream {upstream} sent a stream event that is not JSON: {payload[:200]!r}",
                                       "upstream_error", 502)
                if "error" in chunk and "choices" not in chunk:  # vLLM reports mid-stream errors this way
                    failure = _UpstreamFailure(500, "upstream_error", "stream_error",
                                               f"upstream {upstream} failed mid-stream: {error_message(chunk)}",
                                               sent=True)
                    self.write_chunk(sse_data(chunk))
                    continue
                acc.add(chunk)
                out = strip_chunk(chunk, wants)
                if out is not None:
                    self.write_chunk(sse_data(out))
        except httpx.TransportError as e:
            failure = _UpstreamFailure(502, "upstream_error", type(e).__name__,
                                       f"upstream {upstream} broke the stream: {type(e).__name__}: {e}", sent=True)
            self.write_chunk(sse_data(error_body(failure.message, failure.err_type, failure.status)))
        try:
            self.write_chunk(SSE_DONE)
            self.end_stream()
        except (BrokenPipeError, ConnectionResetError):
            if failure is None:
                raise
            self.close_connection = True  # the client hung up on the error event: record the upstream's fault
        rec = acc.finish()
        self._warn_if_no_ids(rec, upstream)
        if failure is not None:
            failure.record = rec
            raise failure
        return rec


    def _warn_if_no_ids(self, rec: CallRecord, upstream: str) -> None:
        gw = self.server
        if not rec.prompt_token_ids and upstream not in gw.plain_upstreams and upstream not in gw.warned_no_ids:
            gw.warned_no_ids.add(upstream)
            log.warning("upstream %s answered without prompt_token_ids although asked (vLLM < 0.10.2 ignores "
                        "return_token_ids); upgrade vLLM for exact tokens", upstream)


class _UpstreamFailure(Exception):
    def __init__(self, status: int, err_type: str, error_type: str, message: str, sent: bool = False):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.error_type = error_type
        self.message = message
        self.sent = sent
        self.record: CallRecord | None = None
