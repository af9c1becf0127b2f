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
(``/update_weight_version``) inside the reload's pause, and the gateway brackets each call served
by the base name with two reads of ``GET /weight_info`` (versions.py): one completed before the call
is sent (a paused upstream is waited out first) and one started after its last chunk. Equal reads
are the call's exact version; unequal ones mean it straddled a swap, and the span says
``tracerl.policy_version_ambiguous`` with both ``tracerl.policy_version_candidates`` instead of a
version. Upstreams without ``/weight_info`` (and LoRA calls, whose name is their version) skip this.
The gateway is asynchronous end to end (ASGI on ``httpshell``, ``aiohttp`` upstream, see upstream.py):
a waiting call costs a coroutine and two sockets, not a thread, so a training round's thousands of
concurrent agent calls fit in one process; streams are relayed chunk by chunk as they arrive.
Upstream errors are passed through with their status; an unreachable upstream is a 502 and a
timeout a 504, each an OpenAI-style error body, and the span records ``error.type``.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import time

import aiohttp
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from httpshell import ServerOptions, bearer_error
from schemas.attributes import parse_policy_version
from serving.asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    ShellServer,
    error_response,
    json_response,
    parse_json,
)
from serving.gateway.call import Answered, Call, Stream, UpstreamFailure, transport_failure
from serving.gateway.canary import (
    Arm,
    CanaryRoute,
    arm_for,
    canary_route,
    serves,
    session_from_baggage,
)
from serving.gateway.canary_admin import canary_endpoint
from serving.gateway.config import GatewayConfig, normalise_upstream
from serving.gateway.record import CallRecord
from serving.gateway.upstream import (
    CONNECT_ERRORS,
    TRANSPORT_ERRORS,
    ReadDeadlines,
    UpstreamClient,
    error_name,
)
from serving.gateway.upstream_state import UpstreamStates
from serving.protocol import (
    OPERATIONS,
    error_body,
    latest_version_name,
    pick_upstream,
    prepare_upstream_body,
    rollout_from_baggage,
    trace_id_from_traceparent,
)

log = logging.getLogger("tracerl.gateway")
ROLLOUT_HEADER = "X-Tracerl-Rollout-Id"
GATEWAY_TOKEN_HEADER = "X-Tracerl-Gateway-Token"
# Client headers forwarded upstream; everything else (Host, Content-Length, hop-by-hop) is ours.
_FORWARD = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "X-Request-Id", "User-Agent")
_PROPAGATOR = TraceContextTextMapPropagator()


_NOT_SERVED = (
    "is not served by the tracerl gateway (POST /v1/chat/completions, /v1/completions; GET /v1/models)"
)


def sticky_key(client: Headers) -> str | None:
    """What keeps a rollout on one upstream: its rollout id (header, else baggage), else its trace id."""
    return (
        client.get(ROLLOUT_HEADER)
        or rollout_from_baggage(client.get("baggage"))
        or trace_id_from_traceparent(client.get("traceparent"))
    )


class Gateway(ShellServer):
    """The proxy, an ASGI app. ``tracer_provider`` is injected so tests can read spans in memory."""

    def __init__(self, address: tuple[str, int], config: GatewayConfig, tracer_provider: TracerProvider):
        self.route: CanaryRoute | None = None
        if (config.canary is None) != (not config.upstream_for):
            raise ValueError(
                "a canary needs both its share and its arms: --canary FRACTION with "
                "--upstream-for policy@k=URL policy@k+1=URL (one flag, both versions)"
            )
        if config.canary is not None:
            arms = {v: normalise_upstream(u) for v, u in config.upstream_for.items()}
            self.route = canary_route(arms, config.canary)
        if not config.upstreams and not config.upstream_for:
            raise ValueError("no upstreams configured; pass --upstream URL[,URL...]")
        super().__init__(
            ServerOptions(
                host=address[0],
                port=address[1],
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
                max_body_bytes=config.max_body_bytes,
                max_connections=config.max_connections,
                reuse_port=config.reuse_port,
                name="tracerl-gateway",
            )
        )
        self.config = config
        self.upstreams = [normalise_upstream(u) for u in config.upstreams]
        # the servers a new canary pair is looked for on (POST /v1/canary), in the --upstream-for order
        self.canary_servers = list(dict.fromkeys(normalise_upstream(u) for u in config.upstream_for.values()))
        for u in self.canary_servers:
            if u not in self.upstreams:
                self.upstreams.append(u)
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("tracerl.gateway")
        self.client = UpstreamClient(config.timeout_s, config.connect_timeout_s, config.max_connections)
        self.read_deadlines = ReadDeadlines(config.timeout_s)
        self._rr = itertools.count()
        self.states = UpstreamStates(self.client, config.models_ttl_s, config.version_max_age_s)
        self.plain_upstreams: set[str] = set()  # upstreams that refuse return_token_ids
        self.warned_no_ids: set[str] = set()

    def upstream_order(self, key: str | None) -> list[int]:
        """The upstreams to try, in order: the key's own first (rendezvous hashing), then the others."""
        if len(self.upstreams) == 1:  # the common deployment: no hash to compute on every call
            return [0]
        first = pick_upstream(key, self.upstreams, next(self._rr))
        n = len(self.upstreams)
        return [(first + k) % n for k in range(n)]

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path = scope["path"].rstrip("/")
        method = scope["method"]
        try:
            replace_auth = self._auth(request.headers)
            if method == "GET" and path == "/health":
                response: Response = Response(b"", 200, media_type="application/json")
            elif path == "/v1/canary" and method in ("GET", "POST"):
                response = await canary_endpoint(self, request)
            elif method == "GET" and path == "/v1/models":
                response = await self._passthrough_get(request.headers, replace_auth, "/v1/models")
            elif method == "POST" and path in OPERATIONS:
                response = await self._proxy(request, path, OPERATIONS[path], replace_auth)
            else:
                raise HTTPError(
                    404 if method in ("GET", "POST") else 405,
                    f"{method} {path} {_NOT_SERVED}",
                    "NotFoundError",
                )
        except HTTPError as e:
            response = error_response(e)
        except Exception as e:  # a bug or an upstream surprise must still get an answer
            log.exception("gateway error on %s %s", method, path)
            response = json_response(
                500, error_body(f"gateway error: {type(e).__name__}: {e}", "gateway_error", 500)
            )
        await response(scope, receive, send)

    def canary_arm(self, model: str | None, client: Headers) -> Arm | None:
        """The call's arm when the canary routes its model (read once: a switch never splits a call)."""
        route = self.route
        if route is None or not route.routes(model):
            return None
        name = route.for_model(model)
        if name is None:
            key = (
                client.get(ROLLOUT_HEADER)
                or rollout_from_baggage(client.get("baggage"))
                or session_from_baggage(client.get("baggage"))
                or trace_id_from_traceparent(client.get("traceparent"))
            )
            name = arm_for(key, route.fraction)
        return route.arm(name)

    # -- auth and headers ------------------------------------------------------------------

    def _auth(self, headers: Headers) -> bool:
        """Own token via ``X-Tracerl-Gateway-Token`` (client auth then passes through) or bearer.

        Returns whether the client's ``Authorization`` was the gateway's own (then it is not sent on).
        Checked before the body is read.
        """
        token = self.config.token
        if not token:
            return False
        own = headers.get(GATEWAY_TOKEN_HEADER)
        if own is not None:
            if not hmac.compare_digest(own.encode(), token.encode()):
                raise HTTPError(401, "wrong gateway token", "AuthenticationError")
            return False
        why = bearer_error(headers.get("Authorization"), token)
        if why:
            raise HTTPError(401, f"missing or wrong bearer token ({why})", "AuthenticationError")
        return True

    def _upstream_headers(self, client: Headers, replace_auth: bool) -> dict[str, str]:
        h = {k: v for k in _FORWARD if (v := client.get(k)) is not None}
        key = self.config.upstream_api_key
        if replace_auth:
            h.pop("Authorization", None)
        if key and "Authorization" not in h:
            h["Authorization"] = f"Bearer {key}"
        h["Content-Type"] = "application/json"
        return h

    async def _passthrough_get(self, client: Headers, replace_auth: bool, path: str) -> Response:
        last: Exception | None = None
        for i in self.upstream_order(None):
            try:
                status, media_type, raw = await self.client.get(
                    self.upstreams[i] + path, self._upstream_headers(client, replace_auth)
                )
            except TRANSPORT_ERRORS as e:
                last = e
                continue
            return Response(raw, status, media_type=media_type)
        raise HTTPError(
            502,
            f"no upstream reachable ({type(last).__name__}: {last}); check that the model "
            f"server is running at {', '.join(self.upstreams)}",
            "upstream_unreachable",
        )

    # -- the proxied call ------------------------------------------------------------------

    async def _proxy(
        self, request: Request, path: str, op: str, replace_auth: bool
    ) -> Response | Stream | Answered:
        start = time.time_ns()
        body = parse_json(await request.body())
        model = body.get("model")
        client_headers = request.headers
        parent = _PROPAGATOR.extract(
            carrier={
                "traceparent": client_headers.get("traceparent", ""),
                "tracestate": client_headers.get("tracestate", ""),
            }
        )
        span = self.tracer.start_span(
            f"tracerl.gateway {model}", context=parent, kind=SpanKind.CLIENT, start_time=start
        )
        call = Call(self, span, body, op)
        call.deadline = time.monotonic() + self.config.timeout_s
        try:
            up_body, wants = prepare_upstream_body(body, op)
            call.wants = wants
            headers = self._upstream_headers(client_headers, replace_auth)
            _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
            call.arm = self.canary_arm(model, client_headers)
            # an arm's calls never fail over to the other arm: that would serve (and label) another version
            order = (
                [self.upstreams.index(call.arm.upstream)]
                if call.arm
                else [0]
                if len(self.upstreams) == 1
                else self.upstream_order(sticky_key(client_headers))
            )
            return await self._forward(call, order, path, up_body, headers)
        except UpstreamFailure as f:
            call.fail(f)
            return f.response or json_response(f.status, error_body(f.message, f.err_type, f.status))
        except HTTPError as e:
            call.fail_with(str(e.status), e.message)
            raise
        except BaseException as e:  # cancelled (the client left) or a bug: the span says so
            call.fail_with(type(e).__name__, str(e))
            raise
        finally:
            if not call.streaming:
                call.end()

    async def _forward(
        self, call: Call, order: list[int], path: str, up_body: dict, headers: dict[str, str]
    ) -> Response | Stream | Answered:
        """Send the call to the first upstream in ``order`` that takes the connection; its answer,
        streamed (``Stream``) or whole (``Answered``), owns the span from here."""
        last: Exception | None = None
        for i in order:
            call.upstream = self.upstreams[i]
            try:
                resp = await self._send(call, path, call.body, up_body, headers)
            except CONNECT_ERRORS as e:  # nothing ran there: try the next one
                last = e
                continue
            except TRANSPORT_ERRORS as e:
                raise transport_failure(call.upstream, e, "failed") from e
            if resp.status == 200 and call.wants is not None and call.wants.stream:
                return call.stream(resp)  # the stream now owns the span and the upstream response
            try:
                response = await call.whole(resp)
            finally:
                resp.release()
            call.streaming = True  # the answer ends the span once the client has it
            return Answered(call, response)
        raise UpstreamFailure(
            502,
            "upstream_unreachable",
            error_name(last),
            f"no upstream reachable ({type(last).__name__}: {last}); check that the "
            f"model server is running at {', '.join(self.upstreams)}",
        )

    async def _send(
        self, call: Call, path: str, client_body: dict, up_body: dict, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST to one upstream (response not yet read), retrying once for each of two recoverable refusals.

        A 404 for a latest-version alias means the version was unloaded since the gateway looked:
        refresh the list and retry. A 400 naming ``return_token_ids`` means the upstream is not
        vLLM >= 0.10.2 (e.g. the OpenAI API rejects unknown fields): remember that, and send the
        client's own request from now on, so the agent keeps working (its spans then lack ids).

        A call the base name serves (no ``@k``) on an upstream that reports a weight version is sent
        only once the upstream is not paused, and ``call.before`` keeps the version read before it went.
        """
        upstream = call.upstream
        plain = upstream in self.plain_upstreams
        refreshed = False
        while True:
            body = client_body if plain else up_body
            state = await self.states.get(upstream, headers, refreshed)  # cached; also feeds the span's version
            alias = latest_version_name(body.get("model"), state.names) if self.config.latest_alias else None
            if call.arm is not None:  # the arm's version by name where the upstream serves it (LoRA)
                alias = call.arm.version if call.arm.version in state.names else None
                base_is_arm = serves(call.arm.version, [], state.weight_version)  # e.g. policy@0, untouched
                if alias is None and not base_is_arm and latest_version_name(body.get("model"), state.names):
                    # it serves other versions by name: the base name would be neither arm's weights
                    raise UpstreamFailure(
                        502,
                        "canary_version_missing",
                        "canary_version_missing",
                        f"upstream {upstream} serves {body.get('model')}@k versions but not "
                        f"{call.arm.version} (the {call.arm.name} arm): load it there, or fix --upstream-for",
                    )
            call.watch = None
            if state.weight_version is not None and parse_policy_version(alias or body.get("model")) is None:
                call.watch = self.states.watch(upstream, headers)
                call.before = (await call.watch.before(call.deadline)).version
            payload = json.dumps({**body, "model": alias} if alias else body, separators=(",", ":")).encode()
            resp = await self.client.post(upstream + path, payload, headers)
            if alias and resp.status == 404 and not refreshed:  # unloaded since we looked: look again
                resp.release()
                refreshed = True
                continue
            if (
                resp.status == 400
                and not plain
                and "return_token_ids" in (await resp.read()).decode("utf-8", "replace")
            ):
                log.warning(
                    "upstream %s refuses return_token_ids (not vLLM >= 0.10.2); proxying its calls "
                    "unchanged, so their spans carry no token ids",
                    upstream,
                )
                self.plain_upstreams.add(upstream)
                resp.release()
                plain = True
                continue
            return resp

    def warn_if_no_ids(self, rec: CallRecord, upstream: str) -> None:
        if (
            not rec.prompt_token_ids
            and upstream not in self.plain_upstreams
            and upstream not in self.warned_no_ids
        ):
            self.warned_no_ids.add(upstream)
            log.warning(
                "upstream %s answered without prompt_token_ids although asked (vLLM < 0.10.2 ignores "
                "return_token_ids); upgrade vLLM for exact tokens",
                upstream,
            )
