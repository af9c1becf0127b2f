"""An unmodified agent: the plain `openai` client, configured only by environment variables.

Run under `opentelemetry-instrument`; OPENAI_BASE_URL points it at the tracerl gateway. Prints,
as its last line, what the client saw of each call (id and text), for the test to compare.
"""

import json

from openai import OpenAI

client = OpenAI()
seen = []
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, temperature=0.7, seed=3)
seen.append({"id": r.id, "text": r.choices[0].message.content, "finish": r.choices[0].finish_reason})
text, rid, finish = "", None, None
for chunk in client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, stream=True):
    rid = rid or chunk.id
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
seen.append({"id": rid, "text": text, "finish": finish})
print(json.dumps(seen))
