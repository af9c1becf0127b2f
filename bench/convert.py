"""Benchmark: LLM-call spans -> transitions per second, against a bare Parquet read of the same spans.

Generates a store of N spans (default 1,000,000) with Arrow columns built directly (no per-span
Python): rollouts of 10 spans each (an ``invoke_agent`` root, 4 semconv chat calls, 4 tool spans,
a ``tracerl.reward`` span). Then, in the same run, times (1) reading every span file with
``pyarrow.parquet`` and (2) ``convert_store`` over the store, and prints calls/s and the ratio.

    python bench/convert.py                 # 1M spans
    python bench/convert.py --spans 200000 --keep /tmp/bench-store
    python bench/convert.py --store s3      # the same store copied to a bucket, converted there

With ``--store s3`` the store is built locally as always, copied to ``s3://bench/convert`` on moto's S3
server on 127.0.0.1 (``pyarrow.fs.copy_files``), and both the bare read and the conversion (ledger,
transitions and the lease included) go to the bucket. moto is a stand-in sharing these cores: the
figures measure our object-storage code path, not S3's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _shared (only --store s3 imports it)

from schemas.tables import SPANS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic

CALLS_PER_ROLLOUT = 4
SPANS_PER_ROLLOUT = 2 + 2 * CALLS_PER_ROLLOUT
T0 = 1_763_700_000_000_000_000


def _ids(values: np.ndarray, width: int) -> pa.Array:
    return pc.utf8_lpad(pc.cast(pa.array(values), pa.string()), width, "0")


def _map(n: int, columns: list[tuple[str, pa.Array]]) -> pa.MapArray:
    """n rows, each with the same keys; per-key value arrays of length n (or length 1: constant)."""
    k = len(columns)
    keys = pa.array(np.tile(np.array([c[0] for c in columns], dtype=object), n), pa.string())
    vals = pa.concat_arrays(
        [(v if len(v) == n else pa.array(np.repeat(v.to_pylist()[0], n), pa.string())) for _, v in columns]
    )
    order = (np.arange(n)[:, None] + np.arange(k)[None, :] * n).ravel()
    items = pc.take(vals, pa.array(order))
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    return pa.MapArray.from_arrays(offsets, keys, items)


def _const(text: str) -> pa.Array:
    return pa.array([text], pa.string())


def generate(n_spans: int) -> pa.Table:
    """Spans of n_spans // 10 rollouts, as one SPANS_SCHEMA table, vectorised."""
    n_roll = n_spans // SPANS_PER_ROLLOUT
    r = np.arange(n_roll)
    trace = _ids(r, 32)
    r_str = pc.cast(pa.array(r), pa.string())
    parts = []

    def block(kind: int, rows_per: int, name: str, attrs: list[tuple[str, pa.Array]], parent: bool) -> None:
        n = n_roll * rows_per
        ro = np.repeat(r, rows_per)
        j = np.tile(np.arange(rows_per), n_roll)
        slot = kind * 10 + j
        span_id = _ids(ro * 100 + slot, 16)
        start = T0 + ro * 10_000_000_000 + slot * 1_000_000
        parts.append(
            pa.table(
                {
                    "trace_id": pc.take(trace, pa.array(ro)),
                    "span_id": span_id,
                    "parent_span_id": pc.take(_ids(r * 100, 16), pa.array(ro))
                    if parent
                    else pa.nulls(n, pa.string()),
                    "name": pa.array(np.repeat(name, n), pa.string()),
                    "start_time_ns": pa.array(start, pa.int64()),
                    "end_time_ns": pa.array(start + 500_000, pa.int64()),
                    "attributes": _map(n, attrs),
                    "received_at": pa.array(np.full(n, T0), pa.int64()).cast(
                        SPANS_SCHEMA.field("received_at").type
                    ),
                    "rollout_id": pc.take(trace, pa.array(ro)),
                }
            )
        )

    block(
        0,
        1,
        "invoke_agent solver",
        [("gen_ai.operation.name", _const("invoke_agent")), ("gen_ai.agent.name", _const("solver"))],
        parent=False,
    )
    nc = n_roll * CALLS_PER_ROLLOUT
    step = pc.cast(pa.array(np.tile(np.arange(CALLS_PER_ROLLOUT), n_roll)), pa.string())
    rc = pc.take(r_str, pa.array(np.repeat(r, CALLS_PER_ROLLOUT)))
    prompt = pc.binary_join_element_wise(
        '[{"role":"system","parts":[{"type":"text","content":"You solve tasks."}]},'
        '{"role":"user","parts":[{"type":"text","content":"task ',
        rc,
        " step ",
        step,
        '"}]}]',
        "",
    )
    output = pc.binary_join_element_wise(
        '[{"role":"assistant","parts":[{"type":"text","content":"answer ',
        rc,
        '"}],"finish_reason":"stop"}]',
        "",
    )
    response_id = pc.binary_join_element_wise("chatcmpl-", rc, "-", step, "")
    assert len(prompt) == nc
    block(
        1,
        CALLS_PER_ROLLOUT,
        "chat policy@2",
        [
            ("gen_ai.operation.name", _const("chat")),
            ("gen_ai.request.model", _const("policy@2")),
            ("gen_ai.response.model", _const("policy@2")),
            ("gen_ai.response.id", response_id),
            ("gen_ai.input.messages", prompt),
            ("gen_ai.output.messages", output),
            ("gen_ai.usage.input_tokens", _const("31")),
            ("gen_ai.usage.output_tokens", _const("7")),
        ],
        parent=True,
    )
    block(
        2,
        CALLS_PER_ROLLOUT,
        "execute_tool search",
        [("gen_ai.operation.name", _const("execute_tool")), ("gen_ai.tool.name", _const("search"))],
        parent=True,
    )
    block(3, 1, "reward", [("tracerl.reward", _const("1.0"))], parent=True)
    table = pa.concat_tables(parts, promote_options="default")
    full = []
    for f in SPANS_SCHEMA:
        full.append(table.column(f.name) if f.name in table.column_names else pa.nulls(len(table), f.type))
    return pa.Table.from_arrays(full, schema=SPANS_SCHEMA)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10, help="span files the store is split into")
    ap.add_argument("--keep", type=Path, help="build the store here and keep it")
    ap.add_argument(
        "--workers", type=int, default=0, help="conversion worker processes (0: one per CPU; 1: in-process)"
    )
    ap.add_argument(
        "--store",
        choices=["local", "s3"],
        default="local",
        help="convert the local store, or a copy of it in a bucket on moto's S3 server on 127.0.0.1 "
        "(a stand-in: our code path, not S3's latency)",
    )
    args = ap.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="tracerl-bench-"))
    if root.exists():
        shutil.rmtree(root)
    layout = StoreLayout.at(root)
    t = time.perf_counter()
    table = generate(args.spans)
    gen_s = time.perf_counter() - t
    step = -(-len(table) // args.files)
    for i in range(args.files):  # rollouts are contiguous per block; spread them like a collector would
        write_table_atomic(
            table.slice(i * step, step),
            layout.partition("spans", "2025-11-21") / f"part-{i}.parquet",
            "spans",
        )
    n_spans = len(table)
    del table

    if args.store == "s3":
        from _shared import S3_NOTE, s3_stand_in

        print(f"--store s3: {S3_NOTE}.", flush=True)
        with s3_stand_in() as bucket:
            measure(args, layout, n_spans, gen_s, f"{bucket}/convert")
        print(f"--store s3: {S3_NOTE}.")
    else:
        measure(args, layout, n_spans, gen_s)
    if not args.keep:
        shutil.rmtree(root)
    return 0


def _grandchildren_cpu_s() -> float:
    """CPU our live children have reaped from their own children (``cutime + cstime`` in /proc/PID/stat).

    On a bucket the converter holds the lease, whose renewal is a thread, so its workers start from a
    ``forkserver`` (never fork a process with threads): they are the forkserver's children, not ours,
    and ``RUSAGE_CHILDREN`` misses them. moto, our other live child, starts none."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == os.getpid():  # fields: state, ppid, …; cutime, cstime are the 16th, 17th
            total += int(fields[13]) + int(fields[14])
    return total / os.sysconf("SC_CLK_TCK")


def measure(
    args: argparse.Namespace, layout: StoreLayout, n_spans: int, gen_s: float, bucket: str | None = None
) -> None:
    """Time the bare read and the conversion of the store at ``layout`` and print both; with ``bucket``
    (``s3://…``), of a copy of its spans there instead, so only where the bytes live differs."""
    root, extra = layout.location, {}
    if bucket is None:
        files = sorted(layout.table("spans").rglob("*.parquet"))
        fs = None
    else:
        loc = parse_store(bucket)
        t = time.perf_counter()
        pafs.copy_files(
            str(layout.table("spans")),
            loc.table("spans"),
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=loc.fs,
        )
        extra = {
            "store": f"{bucket} (moto on 127.0.0.1: a stand-in)",
            "copy_to_bucket_s": round(time.perf_counter() - t, 2),
        }
        root, files, fs = loc, loc.files("spans"), loc.fs
    t = time.perf_counter()
    read_rows = sum(pq.read_table(f, filesystem=fs).num_rows for f in files)
    read_s = time.perf_counter() - t

    t = time.perf_counter()
    cpu = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    forkserved = 0.0 if bucket is None else _grandchildren_cpu_s()
    load_before = os.getloadavg()[0]
    stats = convert_store(root, ConvertConfig(quiet_s=0, workers=args.workers), now_ns=T0 + 10**18)
    conv_s = time.perf_counter() - t
    conv_cpu = time.process_time() - cpu  # this process only
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # worker processes (reaped when the pool closed)
    workers_cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    if bucket is not None:
        workers_cpu += _grandchildren_cpu_s() - forkserved
    calls = stats.transitions_written
    result = {
        **extra,
        "spans": n_spans,
        "generate_s": round(gen_s, 2),
        "bare_read_s": round(read_s, 3),
        "bare_read_spans_per_s": round(read_rows / read_s),
        "convert_s": round(conv_s, 2),
        "calls": calls,
        "calls_per_s": round(calls / conv_s),
        "convert_cpu_s_this_process": round(conv_cpu, 2),
        "cpu_us_per_call": round(conv_cpu / max(calls, 1) * 1e6, 1),
        "convert_cpu_s_workers": round(workers_cpu, 2),
        "calls_per_cpu_s": round(calls / max(conv_cpu + workers_cpu, 1e-9)),
        "convert_over_read": round(conv_s / read_s, 1),
        "rollouts": stats.rollouts_converted,
        "cpus": os.cpu_count(),
        "workers": args.workers,
        "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "problems": len(stats.problems),
        "phases_s": stats.phase_seconds,
    }
    print(json.dumps(result, indent=2))
    where = "" if bucket is None else " (in the bucket)"
    print(
        f"convert{where}: {calls / conv_s:,.0f} calls/s ({n_spans / conv_s:,.0f} spans/s), "
        f"{calls / max(conv_cpu + workers_cpu, 1e-9):,.0f} calls per CPU-second; bare Parquet read: "
        f"{read_rows / read_s:,.0f} spans/s; convert takes {conv_s / read_s:.1f}x the bare read"
    )


if __name__ == "__main__":
    sys.exit(main())
