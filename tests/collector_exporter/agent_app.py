"""A plain agent that only uses the OpenTelemetry API, as instrumentation libraries do.

It knows nothing of tracerl: `opentelemetry-instrument` and environment variables decide where
its telemetry goes. Prints the ids of the spans it made, for the test to look for.
"""

import json
import logging
import sys

from opentelemetry import trace

tracer = trace.get_tracer("demo.agent", "1.0")
n_calls = int(sys.argv[1]) if len(sys.argv) > 1 else 3
made = []
with tracer.start_as_current_span("invoke_agent writer", attributes={"gen_ai.agent.name": "writer"}) as root:
    made.append(root)
    for i in range(n_calls):
        with tracer.start_as_current_span(
            "chat policy",
            kind=trace.SpanKind.CLIENT,
            attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy@0",
                        "gen_ai.usage.input_tokens": 10 + i, "gen_ai.input.messages": json.dumps([{"role": "user", "content": f"q{i}"}])},
        ) as call:
            call.add_event("gen_ai.evaluation.result", {"gen_ai.evaluation.score.value": i / 10})
            logging.getLogger("agent").warning("call %d done", i)
            made.append(call)
print(json.dumps([[f"{s.get_span_context().trace_id:032x}", f"{s.get_span_context().span_id:016x}"] for s in made]))
