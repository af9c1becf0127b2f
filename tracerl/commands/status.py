"""Row counts per table, write-ahead-log backlog, and the time of the newest span."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from schemas.store import StoreLayout, default_store
from tracerl.options import UsageError, add_options, from_args, opt


@dataclass
class StatusConfig:
    store: str = opt(default_store(), "store directory", metavar="DIR")
    json: bool = opt(False, "print one JSON object instead of text")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, StatusConfig)


def collect_status(store: str) -> dict:
    from collector_exporter.wal import iter_wal_dirs
    from schemas.tables import TABLES
    from schemas.views import connect_readonly

    layout = StoreLayout.at(store)
    con = connect_readonly(store)
    counts = {name: con.execute(f"SELECT count(*) FROM {name}").fetchone()[0] for name in TABLES}
    last_received, last_end = con.execute("SELECT max(received_at), max(end_time_ns) FROM spans").fetchone()
    writers, segments, backlog = [], 0, 0
    for d in iter_wal_dirs(layout.wal):
        segs = list(d.glob("seg-*"))
        writers.append(d.name)
        segments += len(segs)
        backlog += sum(p.stat().st_size for p in segs if p.exists())
    return {
        "store": str(layout.root),
        "rows": counts,
        "wal": {"writers": writers, "segments": segments, "backlog_bytes": backlog},
        "last_span_received_at": str(last_received) if last_received is not None else None,
        "last_span_end_time_ns": last_end,
    }


def run(args: argparse.Namespace) -> int:
    cfg = from_args(StatusConfig, args)
    if not StoreLayout.at(cfg.store).root.exists():
        raise UsageError(f"no store at {cfg.store}; start `tracerl collect --store {cfg.store}` or pass --store")
    s = collect_status(cfg.store)
    if cfg.json:
        print(json.dumps(s))
        return 0
    print(f"store  {s['store']}")
    for name, n in s["rows"].items():
        print(f"  {name:<12} {n:>12,} rows")
    w = s["wal"]
    print(f"wal    {w['segments']} segment(s), {w['backlog_bytes']:,} bytes not yet compacted, "
          f"{len(w['writers'])} writer(s)")
    print(f"last span received at {s['last_span_received_at'] or '-'}")
    return 0
