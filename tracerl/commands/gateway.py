"""OpenAI-compatible proxy that records exact token ids and logprobs as OpenTelemetry spans.

Point the agent's OPENAI_BASE_URL at the gateway. Each /v1/chat/completions and /v1/completions
call is forwarded to an upstream (vLLM >= 0.10.2 or `tracerl serve`) with return_token_ids and
logprobs added; the client gets back exactly what it asked for; the gateway exports a span
`tracerl.gateway {model}` (child of the client's traceparent) to the OTLP endpoint.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from options import UsageError, add_options, from_args, opt
from tracerl.signals import stop_requested, wait_for_stop

EPILOG = """\
example:
  tracerl gateway --upstream http://127.0.0.1:8000 --listen 127.0.0.1:8100 --otlp http://127.0.0.1:4317
  OPENAI_BASE_URL=http://127.0.0.1:8100/v1 opentelemetry-instrument python agent.py

canary (a fifth of new rollouts to policy@6, sticky per rollout; `tracerl promote --once` decides):
  tracerl gateway --canary 0.2 --upstream-for policy@5=http://127.0.0.1:8000 policy@6=http://127.0.0.1:8001
"""


@dataclass
class GatewayCommandConfig:
    """Settings for ``tracerl gateway``."""

    upstream: str = opt(
        "http://127.0.0.1:8000",
        "upstream server URL(s), comma-separated; calls of one rollout/trace stick to one upstream",
        metavar="URL[,URL...]",
    )
    listen: str = opt("127.0.0.1:8100", "HOST:PORT to bind", metavar="HOST:PORT")
    otlp: str = opt("http://127.0.0.1:4317", "OTLP/gRPC endpoint for the gateway's spans", metavar="URL")
    token: str = opt(
        "",
        "require this token (Authorization: Bearer, or X-Tracerl-Gateway-Token to keep the "
        "client's Authorization for the upstream)",
        env="TRACERL_GATEWAY_TOKEN",
    )
    upstream_api_key: str = opt(
        "",
        "bearer key sent upstream when the client's Authorization was the gateway token or absent",
        env="TRACERL_UPSTREAM_API_KEY",
    )
    timeout_s: float = opt(600.0, "upstream read timeout per call, seconds")
    connect_timeout_s: float = opt(5.0, "upstream connect timeout, seconds")
    max_body_mb: float = opt(8.0, "largest accepted request body, MiB")
    max_connections: int = opt(
        1024, "most open client connections (more are answered 503); also the most upstream connections"
    )
    tls_cert: str = opt("", "PEM certificate chain: serve HTTPS only (with --tls-key)", metavar="FILE")
    tls_key: str = opt("", "PEM private key of --tls-cert", metavar="FILE")
    latest_alias: bool = opt(
        True,
        "send calls for model NAME to the newest NAME@k adapter the upstream serves, "
        "so unmodified agents follow the trainer's published versions",
    )
    models_ttl_s: float = opt(
        2.0, "how long the upstream's /v1/models list is trusted for the alias, seconds"
    )
    canary: float | None = opt(
        None,
        "send this share of new rollouts (sticky per rollout id, conversation or trace) to the "
        "candidate, the higher of the two --upstream-for versions, the rest to the serving one; "
        "each call's span says its arm (tracerl.canary.arm). unset: no canary",
        metavar="FRACTION",
    )
    upstream_for: list[str] = opt(  # noqa: RUF009 (opt makes a default_factory for lists)
        [],
        "the canary's arms: the upstream serving each version (two of one name, NAME@k and NAME@k+1); "
        "calls for NAME are split, calls for NAME@k go to their arm",
        metavar="VERSION=URL",
    )
    record_content: bool = opt(
        True,
        "record each chat call's request messages and response on its span (tracerl.request.messages, "
        "tracerl.response.message), for the content join that gives exact token ids to calls whose client sends "
        "no traceparent and whose span records no response id; --no-record-content stores the content only once "
        "(in the agent's own spans), and such calls then stay retokenized",
    )
    workers: int = opt(
        1,
        "gateway processes serving the port (SO_REUSEPORT); one process relays what one core "
        "can, so give busy gateways one per core. --max-connections is per process",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, GatewayCommandConfig)


def _routes(cfg: GatewayCommandConfig) -> tuple[list[str], dict[str, str], str, int]:
    """The flags that say where requests go, checked together: the upstreams, the canary's version routes and
    the listen address. A bad combination is a ``UsageError`` naming the flags and the fix."""
    from serving.asgi import parse_listen
    from serving.gateway.canary import canary_route, parse_upstream_for
    from serving.gateway.proxy import normalise_upstream

    upstreams = [u for u in cfg.upstream.split(",") if u.strip()]
    try:
        for u in upstreams:
            normalise_upstream(u)
        upstream_for = parse_upstream_for(cfg.upstream_for)
        if (cfg.canary is None) != (not upstream_for):
            raise ValueError("--canary FRACTION and --upstream-for VERSION=URL (two) go together")
        if cfg.canary is not None:
            canary_route({v: normalise_upstream(u) for v, u in upstream_for.items()}, cfg.canary)
            if cfg.workers > 1:
                raise ValueError(
                    "--canary runs in one gateway process (--workers 1): promote switches one route"
                )
        host, port = parse_listen(cfg.listen, 8100)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise UsageError("--tls-cert and --tls-key go together; pass both (PEM files) or neither")
    if not upstreams:
        raise UsageError("--upstream needs at least one URL, e.g. http://127.0.0.1:8000")
    if cfg.workers < 1:
        raise UsageError(
            f"--workers {cfg.workers}: give at least 1 (one process per core is the most that helps)"
        )
    return upstreams, upstream_for, host, port


def _gateway_config(cfg: GatewayCommandConfig, upstreams: list[str], upstream_for: dict[str, str]) -> Any:
    """The command's flags as the proxy's ``GatewayConfig``."""
    from serving.gateway.proxy import GatewayConfig

    return GatewayConfig(
        upstreams=upstreams,
        token=cfg.token or None,
        upstream_api_key=cfg.upstream_api_key or None,
        timeout_s=cfg.timeout_s,
        connect_timeout_s=cfg.connect_timeout_s,
        max_body_bytes=int(cfg.max_body_mb * 1024 * 1024),
        max_connections=cfg.max_connections,
        tls_cert=cfg.tls_cert or None,
        tls_key=cfg.tls_key or None,
        latest_alias=cfg.latest_alias,
        models_ttl_s=cfg.models_ttl_s,
        record_content=cfg.record_content,
        reuse_port=cfg.workers > 1,
        canary=cfg.canary,
        upstream_for=upstream_for,
    )


def run(args: argparse.Namespace) -> int:
    cfg = from_args(GatewayCommandConfig, args)
    from serving.gateway.config import make_tracer_provider
    from serving.gateway.proxy import Gateway
    from serving.gateway.workers import fork_workers, tune_for_relaying

    upstreams, upstream_for, host, port = _routes(cfg)
    worker = fork_workers(cfg.workers, host, port)  # before any thread starts (the exporter's, the server's)
    provider = make_tracer_provider(cfg.otlp)
    gw = Gateway((host, worker.port), _gateway_config(cfg, upstreams, upstream_for), provider)
    try:
        gw.start_background()
        worker.serving()
        tune_for_relaying()
        stop = stop_requested()  # before the ready line: a SIGTERM right after it must stop gracefully
        if worker.parent:
            procs = f" ({cfg.workers} processes)" if cfg.workers > 1 else ""
            print(
                f"gateway on {gw.url}/v1{procs} -> {', '.join(gw.upstreams)}; spans to {cfg.otlp}", flush=True
            )
        wait_for_stop(stop)
    finally:
        gw.stop()
        provider.shutdown()
        worker.finish()
    return 0
