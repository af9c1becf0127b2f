// Export a small agent-shaped trace with the official OpenTelemetry JS SDK, then print what was
// sent (ids, parents, exact start times, int attributes) as one JSON line for the Python test.
//
//   node export.mjs http/json|http/protobuf|grpc ENDPOINT N_SPANS
// Headers (the bearer token) and compression come from the standard OTEL_EXPORTER_OTLP_* variables.
import { context, trace } from "@opentelemetry/api";
import { resourceFromAttributes } from "@opentelemetry/resources";
import {
  BasicTracerProvider,
  BatchSpanProcessor,
  InMemorySpanExporter,
  SimpleSpanProcessor,
} from "@opentelemetry/sdk-trace-base";

const [protocol, endpoint, nArg] = process.argv.slice(2);
const exporters = {
  "http/json": async () => new (await import("@opentelemetry/exporter-trace-otlp-http")).OTLPTraceExporter({ url: `${endpoint}/v1/traces` }),
  "http/protobuf": async () => new (await import("@opentelemetry/exporter-trace-otlp-proto")).OTLPTraceExporter({ url: `${endpoint}/v1/traces` }),
  grpc: async () => new (await import("@opentelemetry/exporter-trace-otlp-grpc")).OTLPTraceExporter({ url: endpoint }),
};
const exporter = await exporters[protocol]();
const sent = new InMemorySpanExporter();
const provider = new BasicTracerProvider({
  resource: resourceFromAttributes({ "service.name": `js-agent-${protocol}` }),
  // Small batches: several export requests per run, each its own HTTP body.
  spanProcessors: [new BatchSpanProcessor(exporter, { maxExportBatchSize: 7 }), new SimpleSpanProcessor(sent)],
});
const tracer = provider.getTracer("js-agent", "1.0.0");
const root = tracer.startSpan("invoke_agent", { attributes: { "gen_ai.agent.name": "js" } });
const inRoot = trace.setSpan(context.active(), root);
for (let i = 0; i < Number(nArg) - 1; i++) {
  const span = tracer.startSpan("chat", {
    attributes: { "gen_ai.usage.input_tokens": 1000 + i, "big.int": Number.MAX_SAFE_INTEGER - i, "neg.int": -7 - i },
  }, inRoot);
  span.end();
}
root.end();
await provider.forceFlush();
const finished = sent.getFinishedSpans(); // read before shutdown, which empties the in-memory exporter
await provider.shutdown();
const ns = ([s, n]) => (BigInt(s) * 1000000000n + BigInt(n)).toString();
console.log(JSON.stringify(finished.map((s) => ({
  trace_id: s.spanContext().traceId,
  span_id: s.spanContext().spanId,
  parent_span_id: s.parentSpanContext?.spanId ?? null,
  start_ns: ns(s.startTime),
  end_ns: ns(s.endTime),
  attributes: s.attributes,
}))));
