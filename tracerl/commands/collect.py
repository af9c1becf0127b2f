"""Receive OTLP from unmodified agents and store every span durably as Parquet.

Listens on OTLP/gRPC and OTLP/HTTP (protobuf and JSON, gzip), writes each request to a
write-ahead log with fsync before acknowledging it, and compacts the log into
STORE/spans, STORE/logs and STORE/rewards (Parquet, partitioned by date). Rewards can be
posted to the HTTP port at /v1/rewards. SIGINT/SIGTERM stop gracefully; after a crash the
next start replays the log, so nothing acknowledged is lost.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from options import UsageError, add_options, from_args, from_fields, opt
from span_to_transition.convert import ConvertConfig
from store.layout import default_store
from store.location import is_uri
from tracerl.signals import stop_requested, wait_for_stop

EPILOG = """\
point an unmodified agent at it:
  export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_EXPORTER_OTLP_INSECURE=true
  opentelemetry-instrument python agent.py
post a reward for a rollout:
  curl -X POST http://127.0.0.1:4318/v1/rewards -H 'Content-Type: application/json' \\
       -d '{"rollout_id": "r-17", "value": 1.0}'
"""


@dataclass
class CollectConfig(ConvertConfig):
    """The collector's settings; with --convert, also the converter's (same flags as `tracerl convert`)."""

    store: str = opt(default_store(), "store directory (spans/, logs/, rewards/, wal/), or s3://bucket/prefix "
                     "(endpoint and keys from the AWS_* variables)", metavar="DIR|URI")
    wal: str | None = opt(None, "write-ahead log directory on this host's disk (default: STORE/wal; "
                          "./tracerl-wal when the store is s3://)", metavar="DIR")
    grpc: str = opt("127.0.0.1:4317", "OTLP/gRPC listen address; 'off' to disable", metavar="HOST:PORT")
    http: str = opt("127.0.0.1:4318", "OTLP/HTTP + /v1/rewards listen address; 'off' to disable", metavar="HOST:PORT")
    token: str | None = opt(None, "require 'authorization: Bearer TOKEN' on both protocols", env="TRACERL_TOKEN")
    tls_cert: str | None = opt(None, "PEM certificate: serve TLS on both ports (with --tls-key)", metavar="FILE")
    tls_key: str | None = opt(None, "PEM private key for --tls-cert", metavar="FILE")
    segment_age_s: float = opt(1.0, "seal a WAL segment after this many seconds, making its spans queryable")
    max_backlog_mb: int = opt(2048, "refuse new data (retryable) when the uncompacted WAL exceeds this")
    min_free_disk_mb: int = opt(512, "refuse new data (retryable) when the store's disk has less free space")
    convert: bool = opt(False, "also convert complete rollouts into transitions, continuously")
    convert_every_s: float = opt(2.0, "with --convert: seconds between conversion passes")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CollectConfig)


def run(args: argparse.Namespace) -> int:
    from collector_exporter.collector import Collector, CollectorSettings

    cfg = from_args(CollectConfig, args)
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise UsageError("--tls-cert and --tls-key go together; give both or neither")
    grpc_addr = None if cfg.grpc == "off" else cfg.grpc
    http_addr = None if cfg.http == "off" else cfg.http
    if not grpc_addr and not http_addr:
        raise UsageError("both receivers are off; enable --grpc or --http")
    settings = from_fields(  # store, wal, token, tls_*: by name; the rest in the collector's units
        CollectorSettings, cfg, grpc=grpc_addr, http=http_addr, max_segment_age_s=cfg.segment_age_s,
        max_backlog_bytes=cfg.max_backlog_mb << 20, min_free_disk_bytes=cfg.min_free_disk_mb << 20,
    )
    convert_cfg = from_fields(ConvertConfig, cfg)
    try:
        convert_cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        collector = Collector(settings).start()
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    loop = None
    if cfg.convert:
        from span_to_transition.convert_loop import ConvertLoop

        loop = ConvertLoop(collector.compactor.out, convert_cfg, every_s=cfg.convert_every_s).start()
    parts = []
    if grpc_addr:
        parts.append(f"OTLP/gRPC {collector.grpc_endpoint}")
    if http_addr:
        parts.append(f"OTLP/HTTP {collector.http_endpoint}")
    if loop is not None:
        parts.append(f"converting every {cfg.convert_every_s:g}s")
    stop = stop_requested()  # before the ready line: a SIGTERM right after it must stop gracefully
    where = cfg.store if is_uri(cfg.store) else collector.store.root
    print(f"tracerl collect: {', '.join(parts)} → {where}", flush=True)
    wait_for_stop(stop)
    print("tracerl collect: stopping (flushing the write-ahead log)…", file=sys.stderr, flush=True)
    problems = collector.stop()
    if loop is not None:
        loop.stop()  # one final pass over everything the collector just flushed
    st = collector.compactor.stats
    print(f"tracerl collect: stopped; stored {st.spans} spans, {st.logs} log records, {st.rewards} rewards "
          f"({st.duplicates} duplicate deliveries dropped, {st.quarantined} quarantined)", file=sys.stderr, flush=True)
    for p in problems:
        print(f"tracerl collect: not a clean stop: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0
