"""Test helper: a real collector on ephemeral 127.0.0.1 ports, in this process.

Used by every package's integration tests, so they exercise the real gRPC/HTTP receivers,
WAL and Parquet store rather than a stand-in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from collector_exporter.collector import Collector, CollectorSettings


@contextmanager
def running_collector(store: str | os.PathLike[str], **settings) -> Iterator[Collector]:
    """``with running_collector(tmp_path / "store") as c:`` → ``c.grpc_endpoint``, ``c.http_endpoint``,
    ``c.flush()`` (makes acknowledged data visible as Parquet). Stops gracefully on exit."""
    opts = {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "max_segment_age_s": 0.2}
    opts.update(settings)
    collector = Collector(CollectorSettings(store=str(store), **opts)).start()
    try:
        yield collector
    finally:
        collector.stop()
