"""An agent whose framework records its calls itself and sends no ``traceparent`` (as Strands does): semconv
``chat`` spans with the messages and the reply, no response id; two calls through the gateway, one streamed."""

import json

from openai import OpenAI
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
tracer = provider.get_tracer("content-agent")
client = OpenAI()


def parts(messages: list[dict]) -> str:
    return json.dumps([{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in messages])


with tracer.start_as_current_span("invoke_agent solver", attributes={"gen_ai.agent.name": "solver"}):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for stream in (False, True):
        with tracer.start_as_current_span("chat policy") as span:
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="policy", messages=msgs, max_tokens=8, stream=True) if c.choices)
            else:
                text = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8).choices[0].message.content
            span.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy",
                                 "gen_ai.input.messages": parts(msgs),
                                 "gen_ai.output.messages": parts([{"role": "assistant", "content": text}])})
        msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "And in Rome?"}]
provider.shutdown()
