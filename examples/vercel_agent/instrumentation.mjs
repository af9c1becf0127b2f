// Standard OpenTelemetry setup for a Node.js AI SDK app; agent.mjs itself has no tracing code.
// Loaded before the agent: `node --import ./instrumentation.mjs agent.mjs`.
//
// - NodeSDK configures itself from the standard variables: OTEL_EXPORTER_OTLP_ENDPOINT,
//   OTEL_EXPORTER_OTLP_PROTOCOL (default http/protobuf), OTEL_RESOURCE_ATTRIBUTES (tracerl puts
//   tracerl.rollout_id / tracerl.task_id there), OTEL_SERVICE_NAME, OTEL_*_EXPORTER.
// - The undici instrumentation traces Node's global fetch, which the AI SDK's providers use, and
//   injects the W3C `traceparent` header: that is what parents the gateway's span (exact token
//   ids) under the model call. The AI SDK does not propagate context itself.
// - registerTelemetry(new OpenTelemetry()) turns on the AI SDK's own spans (ai@7 + @ai-sdk/otel):
//   each generateText call, each step's model call, each tool execution.
import { OpenTelemetry } from "@ai-sdk/otel";
import { UndiciInstrumentation } from "@opentelemetry/instrumentation-undici";
import { NodeSDK } from "@opentelemetry/sdk-node";
import { registerTelemetry } from "ai";

const sdk = new NodeSDK({ instrumentations: [new UndiciInstrumentation()] });
sdk.start();
registerTelemetry(new OpenTelemetry());

// A script ends when its event loop is empty: flush the batched spans before it goes.
let stopping = false;
const shutdown = () => {
  if (stopping) return;
  stopping = true;
  sdk.shutdown().catch((err) => console.error("OpenTelemetry shutdown failed:", err));
};
process.on("beforeExit", shutdown);
process.on("SIGTERM", () => { shutdown(); setTimeout(() => process.exit(143), 2000).unref(); });
