"""Durability: acknowledged records survive torn writes, crashes mid-compaction, and replays."""

from __future__ import annotations

import os
import threading

import pyarrow.parquet as pq

from collector_exporter.compactor import Compactor
from collector_exporter.wal import Kind, WriteAheadLog, encode_record, read_records, sealed_segments
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly

from .helpers import trace_request


def _count(store, sql="SELECT count(*), count(DISTINCT (trace_id, span_id)) FROM spans"):
    return connect_readonly(parse_store(store)).execute(sql).fetchone()


def test_torn_tail_is_cut_and_earlier_records_survive(tmp_path):
    seg = tmp_path / "seg-000000000001.open"
    good = encode_record(Kind.TRACES, 1, b"first") + encode_record(Kind.TRACES, 2, b"second")
    seg.write_bytes(good + encode_record(Kind.TRACES, 3, b"third")[:-2])
    records, end = read_records(seg)
    assert [r.payload for r in records] == [b"first", b"second"] and end == len(good)


def test_corrupt_record_ends_the_segment(tmp_path):
    seg = tmp_path / "seg-000000000001.wal"
    a, b = encode_record(Kind.LOGS, 1, b"aaaa"), bytearray(encode_record(Kind.LOGS, 2, b"bbbb"))
    b[-1] ^= 0xFF
    seg.write_bytes(a + bytes(b))
    assert [r.payload for r in read_records(seg)[0]] == [b"aaaa"]


def test_concurrent_appends_share_fsyncs_and_all_land(tmp_path):
    wal = WriteAheadLog(tmp_path / "w", max_segment_bytes=4096, max_segment_age_s=60)
    threads = [threading.Thread(target=lambda i=i: [wal.append(Kind.TRACES, f"{i}-{j}".encode()) for j in range(50)])
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wal.close()
    segs = sealed_segments(tmp_path / "w")
    assert len(segs) > 1  # rotated by size
    payloads = [r.payload for s in segs for r in read_records(s)[0]]
    assert sorted(payloads) == sorted(f"{i}-{j}".encode() for i in range(8) for j in range(50))


def test_second_writer_on_a_live_wal_directory_is_refused(tmp_path):
    wal = WriteAheadLog(tmp_path / "w")
    try:
        import pytest

        with pytest.raises(RuntimeError, match="in use"):
            WriteAheadLog(tmp_path / "w")
    finally:
        wal.close()


def test_crash_after_parquet_before_segment_delete_replays_to_the_same_rows(store):
    layout = StoreLayout.at(store)
    wal_dir = layout.wal / "collector-dead"
    wal = WriteAheadLog(wal_dir)
    wal.append(Kind.TRACES, trace_request(30).SerializeToString())
    wal.append(Kind.TRACES, trace_request(20).SerializeToString())
    wal.close()
    (segment,) = sealed_segments(wal_dir)
    saved = segment.read_bytes()
    Compactor(layout).compact_segment(wal_dir.name, segment)
    assert _count(store) == (50, 50)
    segment.write_bytes(saved)  # as if the process died before unlinking the segment
    fresh = Compactor(layout)  # a restart: its dedupe window must not eat the rows it rewrites
    assert fresh.run_once() == 1
    assert _count(store) == (50, 50)
    assert not wal_dir.exists()  # an adopted directory is removed once drained


def test_restart_drops_a_retry_of_spans_stored_before_the_crash(store):
    layout = StoreLayout.at(store)
    req = trace_request(10)
    for name in ("collector-a", "collector-b"):  # the same batch acked twice (ack lost, exporter retried)
        wal = WriteAheadLog(layout.wal / name)
        wal.append(Kind.TRACES, req.SerializeToString())
        wal.close()
        Compactor(layout).run_once()  # a new process each time: the window comes from Parquet
    assert _count(store) == (10, 10)


def test_open_segment_of_a_dead_writer_is_recovered(store):
    layout = StoreLayout.at(store)
    wal_dir = layout.wal / "exporter-dead"
    wal_dir.mkdir(parents=True)
    rec = encode_record(Kind.TRACES, 5, trace_request(7).SerializeToString())
    (wal_dir / "seg-000000000001.open").write_bytes(rec + rec[:10])  # torn second write
    Compactor(layout).run_once()
    assert _count(store) == (7, 7)
    files = list(layout.table("spans").rglob("*.parquet"))
    assert len(files) == 1 and pq.read_metadata(files[0]).metadata[b"tracerl.schema_version"] == b"1"
    assert not any(p.name.endswith(".tmp") for p in layout.root.rglob("*"))
    assert os.listdir(layout.wal) == []
