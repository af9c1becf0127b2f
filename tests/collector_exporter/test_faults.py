"""Full disks, I/O errors and short writes on the capture path lose nothing that was acknowledged.

Each fault is injected at the OS-call boundary (``faults.py``) while a real collector takes real
gRPC exports. Every case ends the same way: the fault clears, the collector serves again without
a restart, a graceful stop and a restart on the same store leave every acknowledged span in
Parquet exactly once, and no WAL backlog.
"""

from __future__ import annotations

import errno
import time

import grpc
import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from collector_exporter.collector import Collector, CollectorSettings
from collector_exporter.compactor import COMPACTION_ERROR
from collector_exporter.sdk_exporter import TracerlSpanExporter
from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly
from tracerl.commands.status import collect_status

from .faults import Faults
from .helpers import make_spans, span_key, trace_request
from .test_receivers import grpc_export


def _keys(req) -> list[tuple[str, str]]:
    return [
        (s.trace_id.hex(), s.span_id.hex())
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]


class Client:
    """Sends 5-span requests and remembers which spans were acknowledged."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.acked: list[tuple[str, str]] = []
        self.sent: list[tuple[str, str]] = []
        self.refused: list[grpc.RpcError] = []

    def send(self) -> bool:
        req = trace_request(5)
        self.sent += _keys(req)
        try:
            grpc_export(self.endpoint, req.SerializeToString())
        except grpc.RpcError as e:
            self.refused.append(e)
            return False
        self.acked += _keys(req)
        return True

    def send_until_accepted(self, timeout_s: float = 30) -> None:
        """The collector serves again once the fault clears, without a restart."""
        deadline = time.monotonic() + timeout_s
        while not self.send():
            assert time.monotonic() < deadline, (
                f"still refused after the fault cleared: {self.refused[-1].details()}"
            )
            time.sleep(0.1)


def _poll(cond, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _assert_stored_exactly_once(store, client: Client) -> None:
    rows = (
        connect_readonly(parse_store(store))
        .execute("SELECT trace_id, span_id, count(*) FROM spans GROUP BY ALL")
        .fetchall()
    )
    counts = {(t, s): n for t, s, n in rows}
    missing = [k for k in client.acked if k not in counts]
    assert not missing, f"{len(missing)} of {len(client.acked)} acknowledged spans lost"
    assert max(counts.values()) == 1, "a span was stored twice"
    assert set(counts) <= set(client.sent)


def _restart_is_clean(store) -> None:
    with running_collector(store) as c:
        pass
    assert c.stop() == []  # already stopped by the context: nothing left to report
    assert not list((store / "wal").glob("*/seg-*")), "backlog left after a clean restart"
    assert not [p for p in store.rglob("*.tmp")]


WAL_FAULTS = {
    "write ENOSPC": ("write", errno.ENOSPC, False),
    "write EIO": ("write", errno.EIO, False),
    "short write then ENOSPC": ("write", errno.ENOSPC, True),
    "fdatasync EIO": ("fsync", errno.EIO, False),
}


@pytest.mark.parametrize("case", list(WAL_FAULTS))
def test_wal_write_faults_are_refused_never_acked_and_the_collector_recovers(store, monkeypatch, case):
    op, err, short = WAL_FAULTS[case]
    faults = Faults(monkeypatch)
    with running_collector(store) as c:
        client = Client(c.grpc_endpoint)
        for _ in range(3):
            assert client.send()
        rule = faults.inject(op, f"{store}/wal/", err, short=short)
        for _ in range(3):
            assert not client.send(), "a request whose WAL write failed was acknowledged"
        assert rule.hits >= 3
        for e in client.refused:  # retryable, with a hint the SDK exporters honour
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "google.rpc.retryinfo-bin" in dict(e.trailing_metadata())
        faults.clear()
        client.send_until_accepted()
        for _ in range(3):
            assert client.send()
        c.flush()
        _assert_stored_exactly_once(store, client)
        assert c.wal.write_errors >= 3
    assert c.stop() == []
    _restart_is_clean(store)
    _assert_stored_exactly_once(store, client)


COMPACTION_FAULTS = {
    "parquet write ENOSPC": ("parquet", "/spans/", errno.ENOSPC),
    "parquet fsync EIO": ("fsync", "/spans/", errno.EIO),
    "parquet rename ENOSPC": ("replace", "/spans/", errno.ENOSPC),
    "WAL seal rename EIO": ("replace", "/wal/", errno.EIO),
}


@pytest.mark.parametrize("case", list(COMPACTION_FAULTS))
def test_compaction_faults_keep_the_segment_report_and_retry(store, monkeypatch, case):
    op, where, err = COMPACTION_FAULTS[case]
    faults = Faults(monkeypatch)
    with running_collector(store) as c:
        client = Client(c.grpc_endpoint)
        assert client.send()
        c.flush()
        rule = faults.inject(op, f"{store}{where}", err)
        for _ in range(4):  # the WAL takes them: these are acknowledged while compaction fails
            assert client.send()
        _poll(lambda: rule.hits >= 2, what="the failing call to be retried")
        if where == "/spans/":
            _poll(lambda: (c.wal_dir / COMPACTION_ERROR).exists(), what="the error to be reported")
            assert c.compactor.stats.failures >= 1 and "Errno" in c.compactor.stats.last_error
            assert list(c.wal_dir.glob("seg-*.wal")), "the segment must be kept while its compaction fails"
            errors = collect_status(parse_store(store))["wal"]["compaction_errors"]  # what `tracerl status` prints
            assert (
                "No space left" in errors[c.wal_dir.name]["error"]
                or "Input/output" in errors[c.wal_dir.name]["error"]
            )
        else:
            assert c.wal.write_errors >= 1 and list(c.wal_dir.glob("seg-*.open"))
        faults.clear()
        client.send_until_accepted()
        c.flush()
        _assert_stored_exactly_once(store, client)
        assert not (c.wal_dir / COMPACTION_ERROR).exists()
    assert c.stop() == []
    _restart_is_clean(store)
    _assert_stored_exactly_once(store, client)


@pytest.mark.parametrize(
    ("op", "where", "said"),
    [("parquet", "/spans/", "final compaction failed"), ("replace", "/wal/", "could not seal")],
    ids=["parquet write", "WAL seal"],
)
def test_stop_while_the_disk_fails_reports_it_and_the_next_start_recovers(
    store, monkeypatch, op, where, said
):
    faults = Faults(monkeypatch)
    # segments stay open until the stop, so the stop itself has sealing (and compacting) to do
    c = Collector(
        CollectorSettings(store=str(store), grpc="127.0.0.1:0", http=None, max_segment_age_s=600)
    ).start()
    client = Client(c.grpc_endpoint)
    for _ in range(3):
        assert client.send()
    faults.inject(op, f"{store}{where}", errno.ENOSPC)
    problems = c.stop()
    assert problems and said in problems[0], problems  # `tracerl collect` exits 1 on this
    assert list(c.wal_dir.glob("seg-*")), "acknowledged data must stay in the WAL"
    faults.clear()
    _restart_is_clean(store)
    _assert_stored_exactly_once(store, client)


def test_a_kill_during_a_parquet_write_leaves_no_tmp_after_restart(store):
    with running_collector(store) as c:
        client = Client(c.grpc_endpoint)
        assert client.send()
    date_dir = next((store / "spans").iterdir())
    dead = date_dir / f".part-collector-dead-{1:012d}.parquet.{'ab' * 16}.tmp"
    dead.write_bytes(b"half a parquet file")
    _restart_is_clean(store)
    assert not dead.exists()
    _assert_stored_exactly_once(store, client)


def test_in_process_exporter_follows_the_same_rules(store, monkeypatch):
    """``OTEL_TRACES_EXPORTER=tracerl``: a failed WAL write is a FAILURE (the SDK keeps no false
    success), unstorable spans are dropped before the WAL, and a stop that cannot compact leaves
    the spans for the next writer on the store."""
    faults = Faults(monkeypatch)
    exporter = TracerlSpanExporter(str(store), compact_interval_s=0.2)
    stored: set[tuple[str, str]] = set()

    def export(spans) -> SpanExportResult:
        result = exporter.export(spans)
        if result == SpanExportResult.SUCCESS:
            stored.update(span_key(s) for s in spans)
        return result

    assert export(make_spans(3)) == SpanExportResult.SUCCESS
    faults.inject("write", f"{store}/wal/", errno.ENOSPC, short=True)
    assert export(make_spans(3)) == SpanExportResult.FAILURE
    faults.clear()
    assert export(make_spans(3)) == SpanExportResult.SUCCESS
    poison = make_spans(2)
    poison[0]._start_time = (1 << 64) - 1  # what a wrong clock source gives
    assert export(poison) == SpanExportResult.SUCCESS
    stored.discard(span_key(poison[0]))
    faults.inject("parquet", f"{store}/spans/", errno.ENOSPC)
    assert not exporter.force_flush()
    exporter.shutdown()
    assert exporter.problems and list((store / "wal").glob("*/seg-*.wal"))
    faults.clear()
    _restart_is_clean(store)
    rows = (
        connect_readonly(parse_store(store))
        .execute("SELECT trace_id, span_id, count(*) FROM spans GROUP BY ALL")
        .fetchall()
    )
    assert {(t, s) for t, s, _ in rows} == stored and {n for *_, n in rows} == {1}
