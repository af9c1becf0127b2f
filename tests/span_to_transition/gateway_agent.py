"""An unmodified agent behind the tracerl gateway: two plain ``openai`` calls, one streamed."""

from openai import OpenAI

client = OpenAI()
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, temperature=0.7, seed=3)
for _ in client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, stream=True):
    pass
