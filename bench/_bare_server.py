"""The bare baseline for bench/ingest.py: a minimal grpcio TraceService that decodes each
request straight to an Arrow table and a Parquet file, then acks. No WAL, no fsync, no dedupe:
the cheapest way to land OTLP in Parquet, to measure our collector against."""

import signal
import sys
import threading
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)


def text(v):
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


class Bare(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        rows = {
            "trace_id": [],
            "span_id": [],
            "parent_span_id": [],
            "name": [],
            "start": [],
            "end": [],
            "attributes": [],
        }
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    rows["trace_id"].append(sp.trace_id.hex())
                    rows["span_id"].append(sp.span_id.hex())
                    rows["parent_span_id"].append(sp.parent_span_id.hex())
                    rows["name"].append(sp.name)
                    rows["start"].append(sp.start_time_unix_nano)
                    rows["end"].append(sp.end_time_unix_nano)
                    rows["attributes"].append([(kv.key, str(text(kv.value))) for kv in sp.attributes])
        table = pa.table(
            rows,
            schema=pa.schema(
                [
                    ("trace_id", pa.string()),
                    ("span_id", pa.string()),
                    ("parent_span_id", pa.string()),
                    ("name", pa.string()),
                    ("start", pa.int64()),
                    ("end", pa.int64()),
                    ("attributes", pa.map_(pa.string(), pa.string())),
                ]
            ),
        )
        pq.write_table(table, out / f"{uuid.uuid4().hex}.parquet", compression="zstd")
        return trace_service_pb2.ExportTraceServiceResponse()


server = grpc.server(
    futures.ThreadPoolExecutor(max_workers=16), options=[("grpc.max_receive_message_length", 64 << 20)]
)
trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Bare(), server)
server.add_insecure_port(sys.argv[1])
server.start()
print("ready", flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
server.stop(5).wait()
