"""What a gateway span's token ids cost from the gateway to the store: int/double array attributes (the
gateway before session 13) against one compact-JSON string each (``serving.gateway.record.span_attributes`` now).

Each span carries what the gateway records for one call: ``--prompt`` prompt token ids, ``--response``
response ids and as many logprobs. Printed per encoding, CPU µs per span:

* set: building the attributes and starting/ending the span with the real SDK (on the gateway's serving
  thread: the SDK checks an array attribute element by element);
* encode: the OTLP exporter's protobuf encoding of the batch (on the exporter thread, GIL held);
* compaction: the collector's WAL → Parquet (``Compactor.run_once``; best of ``--repeats``);

and the stored text of the prompt ids, which must be the same bytes for both (the store keeps a
non-string attribute as compact JSON text, ``schemas/compact_json.py``).

    python bench/gateway_spans.py                       # 1000-token prompts, 200-token responses
    python bench/gateway_spans.py --prompt 4000 --response 500
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector_exporter.compactor import Compactor
from collector_exporter.receive import Ingest
from collector_exporter.wal import WriteAheadLog
from schemas.attributes import PROMPT_TOKEN_IDS, RESPONSE_LOGPROBS, RESPONSE_TOKEN_IDS
from schemas.compact_json import compact_json
from store.layout import StoreLayout


def requests(
    packed: bool, n_req: int, per: int, prompt: int, response: int
) -> tuple[list[bytes], float, float]:
    """OTLP request bodies of ``n_req`` batches of ``per`` gateway spans; CPU µs per span to set and to encode."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("bench")
    bodies, set_s, encode_s = [], 0.0, 0.0
    for _ in range(n_req):
        mem.clear()
        for i in range(per):
            ids, out = list(range(i, i + prompt)), list(range(response))
            logprobs = [-0.5 - k * 1e-3 for k in range(response)]
            t = time.process_time()
            values = (ids, out, logprobs)
            attrs = dict(
                zip(
                    (PROMPT_TOKEN_IDS, RESPONSE_TOKEN_IDS, RESPONSE_LOGPROBS),
                    (compact_json(v) for v in values) if packed else values,
                )
            )
            with tracer.start_as_current_span("tracerl.gateway policy", attributes=attrs):
                pass
            set_s += time.process_time() - t
        t = time.process_time()
        bodies.append(encode_spans(mem.get_finished_spans()).SerializeToString())
        encode_s += time.process_time() - t
    n = n_req * per
    return bodies, set_s / n * 1e6, encode_s / n * 1e6


def compaction(bodies: list[bytes], n: int, repeats: int) -> tuple[float, str]:
    """Best CPU µs per span of WAL → Parquet over ``repeats`` fresh stores, and the stored prompt ids."""
    best, stored = float("inf"), ""
    for _ in range(repeats):
        store = StoreLayout.at(tempfile.mkdtemp(prefix="bench-gwspans-"))
        wal = WriteAheadLog(store.wal / "bench", max_segment_age_s=3600)
        ingest = Ingest(wal)
        for b in bodies:
            ingest.traces(b)
        wal.close()
        t = time.process_time()
        Compactor(store).run_once()
        best = min(best, (time.process_time() - t) / n * 1e6)
        table = pq.read_table(next((store.root / "spans").rglob("*.parquet")), columns=["attributes"])
        stored = dict(table.column("attributes")[0].as_py())[PROMPT_TOKEN_IDS]
    return best, stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--prompt", type=int, default=1000, help="prompt token ids per span (default: %(default)s)"
    )
    ap.add_argument(
        "--response", type=int, default=200, help="response ids and logprobs (default: %(default)s)"
    )
    ap.add_argument("--requests", type=int, default=10, help="OTLP requests (default: %(default)s)")
    ap.add_argument("--per-request", type=int, default=64, help="spans per request (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="compactions, best kept (default: %(default)s)")
    args = ap.parse_args()
    n = args.requests * args.per_request
    print(
        f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {n} spans of "
        f"{args.prompt} prompt ids, {args.response} response ids and logprobs"
    )
    rows, texts = {}, {}
    for packed in (False, True):
        bodies, set_us, encode_us = requests(
            packed, args.requests, args.per_request, args.prompt, args.response
        )
        compact_us, texts[packed] = compaction(bodies, n, args.repeats)
        rows[packed] = (set_us, encode_us, compact_us)
    print(f"{'CPU µs per span':<28} {'set':>8} {'encode':>8} {'compaction':>11} {'total':>8}")
    for packed, label in ((False, "int/double arrays (before)"), (True, "one JSON string each (now)")):
        r = rows[packed]
        print(f"{label:<28} {r[0]:>8.0f} {r[1]:>8.0f} {r[2]:>11.0f} {sum(r):>8.0f}")
    ratio = [a / b for a, b in zip(rows[False], rows[True])]
    print(
        f"{'arrays / string':<28} {ratio[0]:>7.1f}x {ratio[1]:>7.1f}x {ratio[2]:>10.1f}x "
        f"{sum(rows[False]) / sum(rows[True]):>7.1f}x"
    )
    same = texts[False] == texts[True]
    print(f"stored prompt ids identical for both: {same} ({len(texts[True])} characters)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
