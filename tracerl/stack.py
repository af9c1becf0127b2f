"""The stack a loop runs against: ``tracerl collect``, ``tracerl serve`` and ``tracerl gateway``, healthy.

One home for their command lines and their readiness checks, used by ``tracerl demo``, the examples'
drivers (examples/production_service/run.py, examples/sql_agent/train_real.py), the benches
(bench/round.py; bench/agent_overhead.py, with its own upstream as ``server``) and the tests that
start the same processes, so a flag the three need together (the gateway exporting to the
collector's gRPC port, in front of the server) is written once. The processes are real ``tracerl``
commands, each in its own session with a log file (``tracerl.supervisor.Child``); they are stopped in
reverse order (gateway first, so it flushes its spans to a collector still running) however the
``with`` block ends.

    with running_stack(StackConfig(store="./store", logs=Path("logs"), model="./tiny")) as stack:
        ...  # agents call stack.urls.gateway + "/v1" and export spans to stack.urls.otlp
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tracerl.supervisor import BIN, Child, Children, http_ok, pick_port, tcp_open


@dataclass(frozen=True)
class StackPorts:
    """Ports on 127.0.0.1; 0 picks a free one."""

    grpc: int = 0
    """OTLP/gRPC of ``tracerl collect`` (where the gateway and the agents export spans)."""
    http: int = 0
    """OTLP/HTTP, ``/v1/rewards`` and ``/healthz`` of ``tracerl collect``."""
    serve: int = 0
    """``tracerl serve``'s OpenAI-compatible API (unused with ``StackConfig.server``)."""
    gateway: int = 0
    """``tracerl gateway``, the URL the agents call."""


@dataclass(frozen=True)
class StackConfig:
    """What the three commands are started with. Flags beyond the wiring go in the ``*_args`` fields verbatim,
    as a user would type them after the command."""

    store: str
    """The store ``tracerl collect --store`` writes (a directory or s3://bucket/prefix)."""
    logs: Path
    """Each process's output goes to ``logs/<command>.log``."""
    model: str = ""
    """The model directory ``tracerl serve --model`` serves; required unless ``server`` is given."""
    server: str = ""
    """An engine already running (e.g. a vLLM the caller owns): no ``tracerl serve`` is started."""
    engine: str = "embedded"
    """``tracerl serve --engine``: embedded (CPU, any model) or vllm."""
    collect_args: tuple[str, ...] = ()
    """More ``tracerl collect`` flags, e.g. ``("--convert", "--quiet-s", "5")``."""
    serve_args: tuple[str, ...] = ()
    """More ``tracerl serve`` flags, e.g. ``("--threads", "1")``."""
    gateway_args: tuple[str, ...] = ()
    """More ``tracerl gateway`` flags, e.g. ``("--models-ttl-s", "0.5")``."""
    ports: StackPorts = field(default_factory=StackPorts)
    serve_timeout_s: float = 600.0
    """How long the server may take to load its model (vLLM on CPU compiles for minutes)."""
    timeout_s: float = 60.0
    """How long the collector and the gateway may take to answer their health checks."""
    stop_grace_s: float = 15.0
    """SIGTERM, then SIGKILL after this long: the collector flushes its write-ahead log meanwhile."""
    announce: Callable[[str], None] | None = None
    """Called with each command line as it starts (``$ tracerl … > logs/x.log``), for drivers that print them."""


@dataclass(frozen=True)
class StackUrls:
    """Where the started (or given) processes answer."""

    otlp: str
    """OTLP/gRPC endpoint of the collector (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``gateway --otlp``)."""
    collector: str
    """The collector's HTTP base URL (OTLP/HTTP, rewards, health)."""
    server: str
    """The engine's base URL (``tracerl train --server``)."""
    gateway: str
    """The gateway's base URL; agents call ``{gateway}/v1``."""

    @property
    def rewards(self) -> str:
        return f"{self.collector}/v1/rewards"


def resolve_ports(ports: StackPorts, *, with_server: bool) -> StackPorts:
    """``ports`` with each 0 replaced by a distinct free port (the serve port only when a server is started)."""
    taken = {p for p in (ports.grpc, ports.http, ports.serve, ports.gateway) if p}

    def free(p: int) -> int:
        return p or pick_port(0, "", taken)

    return StackPorts(
        grpc=free(ports.grpc),
        http=free(ports.http),
        serve=free(ports.serve) if with_server else 0,
        gateway=free(ports.gateway),
    )


def stack_urls(cfg: StackConfig, ports: StackPorts) -> StackUrls:
    host = "http://127.0.0.1"
    server = cfg.server.rstrip("/") if cfg.server else f"{host}:{ports.serve}"
    return StackUrls(
        otlp=f"{host}:{ports.grpc}",
        collector=f"{host}:{ports.http}",
        server=server,
        gateway=f"{host}:{ports.gateway}",
    )


def stack_argvs(cfg: StackConfig, ports: StackPorts) -> dict[str, list[str]]:
    """The command line of each process to start, in start order (``serve`` absent with ``cfg.server``)."""
    tracerl, urls = str(BIN / "tracerl"), stack_urls(cfg, ports)
    argvs = {
        "collect": [
            tracerl,
            "collect",
            "--store",
            cfg.store,
            "--grpc",
            f"127.0.0.1:{ports.grpc}",
            "--http",
            f"127.0.0.1:{ports.http}",
            *cfg.collect_args,
        ]
    }
    if not cfg.server:
        if not cfg.model:
            raise ValueError("StackConfig needs a model to serve, or the URL of a running server")
        argvs["serve"] = [
            tracerl,
            "serve",
            "--engine",
            cfg.engine,
            "--model",
            cfg.model,
            "--listen",
            f"127.0.0.1:{ports.serve}",
            *cfg.serve_args,
        ]
    argvs["gateway"] = [
        tracerl,
        "gateway",
        "--upstream",
        urls.server,
        "--listen",
        f"127.0.0.1:{ports.gateway}",
        "--otlp",
        urls.otlp,
        *cfg.gateway_args,
    ]
    return argvs


@dataclass
class Stack:
    """The started stack: its URLs and its processes. ``start`` adds more (a trainer, a service) that are
    stopped with it, before it."""

    urls: StackUrls
    children: Children
    cfg: StackConfig
    started: dict[str, Child] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` with its output in ``logs/<name>.log``, announced as the stack's own are."""
        log = self.cfg.logs / f"{name}.log"
        if self.cfg.announce:
            self.cfg.announce(f"$ {shlex.join(argv)}   > {self.cfg.logs.name}/{log.name}")
        child = self.children.start(Child(name, argv, log, env=env))
        self.started[name] = child
        return child

    def check_alive(self) -> None:
        """Raise ``ChildError`` naming the first process that exited, with its log's tail."""
        self.children.check_alive()


def start_stack(cfg: StackConfig, children: Children) -> Stack:
    """Start collect, serve (unless ``cfg.server``) and gateway into ``children`` and wait until each answers
    its health check; ``ChildError`` names one that exited or never answered. The caller stops ``children``."""
    ports = resolve_ports(cfg.ports, with_server=not cfg.server)
    stack = Stack(stack_urls(cfg, ports), children, cfg)
    for name, argv in stack_argvs(cfg, ports).items():
        stack.start(name, argv)
    urls, started = stack.urls, stack.started
    started["collect"].wait_healthy(
        lambda: http_ok(f"{urls.collector}/healthz") and tcp_open(ports.grpc), cfg.timeout_s
    )
    if "serve" in started:
        started["serve"].wait_healthy(lambda: http_ok(f"{urls.server}/health"), cfg.serve_timeout_s)
    started["gateway"].wait_healthy(lambda: http_ok(f"{urls.gateway}/health"), cfg.timeout_s)
    return stack


@contextmanager
def running_stack(cfg: StackConfig) -> Iterator[Stack]:
    """``start_stack`` for one ``with`` block; every process it (or the block, via ``Stack.start``) started is
    stopped in reverse order when the block ends, by return, exception or Ctrl-C."""
    children = Children()
    try:
        yield start_stack(cfg, children)
    finally:
        children.stop_all(grace_s=cfg.stop_grace_s)
