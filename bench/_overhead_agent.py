"""The agent bench/agent_overhead.py times: a writer and a rewriter taking turns, on the plain `openai` client.

An ordinary agent, configured by environment variables only (OPENAI_BASE_URL, OPENAI_API_KEY):
it imports neither tracerl nor OpenTelemetry, so the bench can run the very same file plain and
under `opentelemetry-instrument`. Each call is timed around `client.chat.completions.create`
alone; greedy decoding with `ignore_eos` (a vLLM sampling option the embedded server honours)
makes every call generate exactly MAX_TOKENS tokens, so both variants ask the model for
identical work.

    python bench/_overhead_agent.py CALLS MAX_TOKENS

Prints one JSON line: {"latencies_s": [...], "response_ids": [...], "loop_cpu_s": ...}, the last
being the process's CPU time (all threads, so an exporter's too) from the end of the first call
to the end of the last.
"""

import json
import sys
import time

from openai import OpenAI

SYSTEM = {
    "writer": "You are a writer. Answer with one short sentence.",
    "rewriter": "You are an editor. Rewrite the draft more clearly, in one short sentence.",
}


def main() -> None:
    calls, max_tokens = int(sys.argv[1]), int(sys.argv[2])
    client = OpenAI()
    draft, latencies, ids, cpu0 = "", [], [], 0.0
    for i in range(calls):
        role = "writer" if i % 2 == 0 else "rewriter"
        user = f"Write a note about topic {i // 2}." if role == "writer" else f"Draft: {draft}"
        messages = [{"role": "system", "content": SYSTEM[role]}, {"role": "user", "content": user}]
        t = time.perf_counter()
        r = client.chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        latencies.append(time.perf_counter() - t)
        ids.append(r.id)
        draft = r.choices[0].message.content or ""
        if i == 0:
            cpu0 = time.process_time()
    print(
        json.dumps({"latencies_s": latencies, "response_ids": ids, "loop_cpu_s": time.process_time() - cpu0})
    )


if __name__ == "__main__":
    main()
