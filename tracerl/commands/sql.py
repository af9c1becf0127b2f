"""Run DuckDB SQL over the store, read-only.

Every table is a view (spans, logs, rewards, transitions, rounds, plus derived views). The
connection cannot write, attach, or read files outside the store: file access is switched
off and the configuration locked before your query runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass

from options import UsageError, add_options, from_args, opt
from store.layout import default_store

EPILOG = """\
examples:
  tracerl sql "SELECT name, count(*) AS n FROM spans GROUP BY 1 ORDER BY n DESC"
  tracerl sql "SELECT attributes['gen_ai.request.model'] AS model, count(*) FROM spans GROUP BY 1"
  tracerl sql --format csv "SELECT * FROM rewards" > rewards.csv
  tracerl sql --views            # the CREATE VIEW statements, for your own DuckDB session
"""


@dataclass
class SqlConfig:
    store: str = opt(default_store(), "store directory, or s3://bucket/prefix", metavar="DIR|URI")
    format: str = opt("table", "output format", choices=["table", "csv", "json"])
    max_width: int = opt(60, "truncate table cells wider than this (table format only)")
    views: bool = opt(False, "print the view definitions instead of running a query")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("query", nargs="?", help="SQL to run ('-' reads it from stdin)")
    add_options(parser, SqlConfig)


def _cell(v: object) -> str:
    """A table cell; floats to 6 significant digits (``0.225``, not ``0.22499999999999998``: the table
    is for reading; --format csv/json keep every digit)."""
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return v if isinstance(v, str) else str(v)


def format_table(columns: list[str], rows: list[tuple], max_width: int) -> str:
    cells = [[_cell(v).replace("\n", "\\n") for v in row] for row in rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 1] + "…" for c in row] for row in cells]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


# what DuckDB's parser calls the statements that only read (DESCRIBE, SHOW, SUMMARIZE parse as SELECT)
READ_ONLY_STATEMENTS = {"SELECT", "EXPLAIN"}


def run(args: argparse.Namespace) -> int:
    import duckdb

    from store.location import parse_store
    from store.views import connect_readonly, view_sql

    cfg = from_args(SqlConfig, args)
    loc = parse_store(cfg.store)  # --store parsed once
    if cfg.views:
        print(view_sql(loc))
        return 0
    query = sys.stdin.read() if args.query == "-" else args.query
    if not query:
        raise UsageError('give a query, e.g. tracerl sql "SELECT count(*) FROM spans"')
    if not loc.exists():
        raise UsageError(f"no store at {cfg.store}; pass --store DIR (or set TRACERL_STORE) to the directory "
                         "or s3://bucket/prefix `tracerl collect` writes")
    con = connect_readonly(loc)
    try:
        kinds = {s.type.name for s in con.extract_statements(query)}
        if kinds - READ_ONLY_STATEMENTS:
            raise UsageError(f"tracerl sql only reads: {', '.join(sorted(kinds - READ_ONLY_STATEMENTS))} statements "
                             "are refused (SELECT, FROM, WITH, DESCRIBE, SHOW, SUMMARIZE and EXPLAIN run); to "
                             "change data, copy it out with --format csv/json or use your own DuckDB on "
                             "`tracerl sql --views`")
        cur = con.execute(query)
    except duckdb.Error as e:
        raise UsageError(f"{e}".strip()) from None
    if cur.description is None:
        return 0
    columns = [d[0] for d in cur.description]
    rows = cur.fetchall()
    if cfg.format == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(columns)
        w.writerows(rows)
    elif cfg.format == "json":
        json.dump([dict(zip(columns, r)) for r in rows], sys.stdout, default=str, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(format_table(columns, rows, cfg.max_width))
    return 0
