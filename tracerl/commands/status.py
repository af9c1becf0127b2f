"""Row counts per table, write-ahead-log backlog, quarantined records, compaction errors, the
time of the newest span, and (on a bucket) who holds the converter's and the trainer's leases."""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from options import UsageError, add_options, from_args, opt
from store.layout import StoreLayout, default_store
from store.location import StoreLocation, parse_store


@dataclass
class StatusConfig:
    store: str = opt(default_store(), "store directory, or s3://bucket/prefix", metavar="DIR|URI")
    wal: str = opt("", "the write-ahead log to report: default STORE/wal for a local store; for s3:// the WALs "
                       "are on the collectors' disks, so name this host's (collect --wal)", metavar="DIR")
    json: bool = opt(False, "print one JSON object instead of text")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, StatusConfig)


def collect_status(loc: StoreLocation, wal: str = "") -> dict:
    import time

    from collector_exporter.compactor import COMPACTION_ERROR
    from collector_exporter.quarantine import quarantine_counts
    from collector_exporter.wal import iter_wal_dirs
    from schemas.tables import TABLES
    from span_to_transition.ledger import Ledger
    from store.lease import lease_states
    from store.views import connect_readonly

    con = connect_readonly(loc)
    counts = {name: con.execute(f"SELECT count(*) FROM {name}").fetchone()[0] for name in TABLES}
    last_received, last_end = con.execute("SELECT max(received_at), max(end_time_ns) FROM spans").fetchone()
    writers, segments, backlog, errors, oldest = [], 0, 0, {}, None
    # the WAL is on each collector's local disk: the store's own when it is local, else the one named
    wal_root = Path(wal).expanduser() if wal else StoreLayout.at(loc.root).wal if loc.is_local else None
    for d in iter_wal_dirs(wal_root) if wal_root is not None else ():
        segs = list(d.glob("seg-*"))
        writers.append(d.name)
        segments += len(segs)
        for p in segs:
            try:
                st = p.stat()
            except FileNotFoundError:  # compacted meanwhile
                continue
            backlog += st.st_size
            if p.suffix == ".wal":
                oldest = st.st_mtime if oldest is None else min(oldest, st.st_mtime)
        with contextlib.suppress(OSError, ValueError):  # absent unless that writer's compaction is failing
            errors[d.name] = json.loads((d / COMPACTION_ERROR).read_text())
    return {
        "store": loc.root if loc.is_local else loc.uri,
        "rows": counts,
        "quarantined": quarantine_counts(loc),
        "wal": {"writers": writers, "segments": segments, "backlog_bytes": backlog,
                "oldest_sealed_segment_age_s": None if oldest is None else round(time.time() - oldest, 1),
                "compaction_errors": errors},
        "last_span_received_at": str(last_received) if last_received is not None else None,
        "last_span_end_time_ns": last_end,
        "leases": lease_states(loc) if _has_boto3() else {},  # {} for a local store
        # feedback rows whose keys match no rollout, as the converter's last pass counted them
        "rewards_unjoined": Ledger.load(loc).unjoined or {"count": 0, "samples": []},
    }


def _has_boto3() -> bool:
    """Leases are read with boto3 (the ``s3`` extra); without it status shows the rest."""
    import importlib.util

    return importlib.util.find_spec("boto3") is not None


def run(args: argparse.Namespace) -> int:
    cfg = from_args(StatusConfig, args)
    loc = parse_store(cfg.store)  # --store parsed once
    if not loc.exists():
        raise UsageError(f"no store at {cfg.store}; start `tracerl collect --store {cfg.store}` or pass --store")
    s = collect_status(loc, cfg.wal)
    if cfg.json:
        print(json.dumps(s))
        return 0
    print(f"store  {s['store']}")
    for name, n in s["rows"].items():
        print(f"  {name:<12} {n:>12,} rows")
    w = s["wal"]
    print(f"wal    {w['segments']} segment(s), {w['backlog_bytes']:,} bytes not yet compacted, "
          f"{len(w['writers'])} writer(s)")
    if w["oldest_sealed_segment_age_s"] is not None:
        print(f"       oldest sealed segment waiting {w['oldest_sealed_segment_age_s']:g}s for compaction")
    for writer, err in w["compaction_errors"].items():
        print(f"       COMPACTION FAILING in {writer}: {err['error']} ({err['failures']} failed pass(es); "
              f"retrying every {err['retry_in_s']:g}s; nothing is lost, the WAL keeps the data)")
    q = s["quarantined"]
    if q:
        print(f"quarantine {sum(q.values()):,} record(s) kept in {s['store']}/quarantine with their reason: "
              + ", ".join(f"{n:,} {t}" for t, n in sorted(q.items())))
    else:
        print("quarantine 0 records")
    u = s["rewards_unjoined"]
    if u["count"]:
        print(
            f"rewards {u['count']:,} feedback row(s) match no rollout (kept in rewards/; e.g. "
            f"{', '.join(u['samples'][:3])}): run tracerl doctor for what to check"
        )
    print(f"last span received at {s['last_span_received_at'] or '-'}")
    for who, lease in s["leases"].items():
        left = lease["expires_in_s"]
        state = (f"held by {lease['holder']}, {left:g}s left before it can be taken over" if left > 0
                 else f"free (last held by {lease['holder']})")
        print(f"lease  {who}: {state}")
    return 0
