"""examples/vercel_agent: a TypeScript agent (Vercel AI SDK ``generateText``, a tool, several steps) run through tracerl.

The agent runs in Node with its own pinned npm packages (``npm ci`` in ``examples/vercel_agent``,
once per lock hash), exactly as its README says: ``node --import ./instrumentation.mjs agent.mjs``.
The official OpenTelemetry JS SDK exports the AI SDK's spans over OTLP/HTTP (http/protobuf, the JS
default) to the real collector; the undici instrumentation propagates ``traceparent`` on the AI SDK's
fetch, so the real gateway's span (exact token ids) sits under each model call. The scripted model
answers with tool calls, then a final sentence, so every transition's content is known exactly.
Skipped only when npm cannot be reached, never under ``CI``.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from example_rig import EXAMPLES, ROOT, answer_text, prompt_text, stored_spans, token_ids
from tracerl_testing import npm_ci

pytestmark = pytest.mark.slow

AGENT_DIR = EXAMPLES / "vercel_agent"
AGENT = ["node", "--import", str(AGENT_DIR / "instrumentation.mjs"), str(AGENT_DIR / "agent.mjs")]
REWARD = "examples/vercel_agent/reward.py:score"
TASKS = [json.loads(line) for line in (AGENT_DIR / "tasks.jsonl").read_text().splitlines()[:2]]
# The scripted model's conversions per task, one tool call per step, then its final sentence:
# right for "marathon" (reward 1.0), a wrong sum for "flour" (1.134 + 0.3 is 1.434, not 1.4: reward 0.0).
CONVERSIONS = {
    "marathon": [{"value": 42.195, "from": "km", "to": "mi"}],
    "flour": [{"value": 2.5, "from": "lb", "to": "kg"}, {"value": 300, "from": "g", "to": "kg"}],
}
RESULTS = {"marathon": ["26.2188"], "flour": ["1.134", "0.3"]}
FINAL = {"marathon": "That is 26.2188 miles.", "flour": "That is 1.4 kg in total."}


def _task_of(body: dict) -> str:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    text = user if isinstance(user, str) else "".join(p.get("text", "") for p in user)
    return next(t["id"] for t in TASKS if t["question"] in text)


def _call_id(task_id: str, i: int) -> str:
    return f"call_{task_id}_{i}"


def script(body: dict) -> dict:
    """The model: one `convert` call per step until every conversion of the task is done, then the answer."""
    task_id = _task_of(body)
    done = sum(m["role"] == "tool" for m in body["messages"])
    if done == len(CONVERSIONS[task_id]):
        return {"content": FINAL[task_id]}
    return {
        "tool_calls": [
            {
                "id": _call_id(task_id, done),
                "type": "function",
                "function": {"name": "convert", "arguments": json.dumps(CONVERSIONS[task_id][done])},
            }
        ]
    }


@pytest.fixture
def http_traces(monkeypatch) -> list[bytes]:
    """Every OTLP trace body the collector's HTTP transport handed to its receiver (inflated protobuf)."""
    from collector_exporter import http_server

    bodies: list[bytes] = []
    real = http_server.run_blocking

    async def spy(fn, *args, **kw):
        if getattr(fn, "__name__", "") == "traces":
            assert not kw.get("is_json"), "the JS SDK's default protocol is http/protobuf"
            bodies.append(args[0])
        return await real(fn, *args, **kw)

    monkeypatch.setattr(http_server, "run_blocking", spy)
    return bodies


def _span_ids(bodies: list[bytes]) -> set[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = set()
    for body in bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            out |= {s.span_id.hex() for ss in rs.scope_spans for s in ss.spans}
    return out


def test_generate_text_steps_become_gateway_joined_transitions_over_otlp_http(
    stack_factory, http_traces
) -> None:
    npm_ci(AGENT_DIR)
    stack = stack_factory(script)
    stack.run_rollout(
        AGENT,
        TASKS,
        otlp_protocol="http/protobuf",
        rollout_args=("--reward", REWARD),
        extra_env={"OTEL_SERVICE_NAME": "units-agent"},
    )
    rows = stack.transitions()

    # One transition per model call: 1 + 1 steps for marathon, 2 + 1 for flour; nothing counted twice.
    assert len(stack.engine.requests) == 5 and len(rows) == 5
    assert {(b["model"], b.get("max_tokens"), b.get("temperature")) for b in stack.engine.requests} == {
        ("policy", 256, 1.0)
    }  # agent.mjs's defaults (UNITS_MODEL, UNITS_MAX_TOKENS, UNITS_TEMPERATURE)
    spans = stored_spans(stack.store)
    for task in TASKS:
        tid = task["id"]
        calls = sorted((r for r in rows if r["task_id"] == tid), key=lambda r: r["step"])
        requests = [b for b in stack.engine.requests if _task_of(b) == tid]  # this rollout's, in order
        n_tools = len(CONVERSIONS[tid])
        assert len(calls) == len(requests) == n_tools + 1 and len({r["rollout_id"] for r in calls}) == 1
        assert [r["step"] for r in calls] == list(range(n_tools + 1))
        assert [r["is_last"] for r in calls] == [False] * n_tools + [True]
        assert {r["agent_name"] for r in calls} == {"units"}  # generateText's telemetry.functionId

        for i, row in enumerate(calls):
            prompt = json.loads(row["prompt_messages"])
            # The conversation so far: system, the question, then each earlier step's call and result.
            assert [m["role"] for m in prompt] == ["system", "user"] + ["assistant", "tool"] * i
            assert prompt[1]["content"] in (task["question"], [{"type": "text", "text": task["question"]}])
            for k in range(i):
                (earlier,) = prompt[2 + 2 * k]["tool_calls"]
                assert earlier["id"] == _call_id(tid, k) and earlier["function"]["name"] == "convert"
                assert prompt[3 + 2 * k]["tool_call_id"] == _call_id(tid, k)
                assert RESULTS[tid][k] in json.dumps(prompt[3 + 2 * k]["content"])  # the agent's own tool ran
            assert [t["function"]["name"] for t in json.loads(row["tools"])] == ["convert"]
            response = json.loads(row["response_message"])
            if i < n_tools:  # a tool-call step
                assert row["finish_reason"] == "tool_calls"
                (tc,) = response["tool_calls"]
                assert tc["id"] == _call_id(tid, i) and tc["function"]["name"] == "convert"
                assert json.loads(tc["function"]["arguments"]) == CONVERSIONS[tid][i]
            else:
                assert row["finish_reason"] == "stop" and response["content"] == FINAL[tid]
                assert not response.get("tool_calls")

        # Exact token ids, joined from the gateway's span of the same call: what the engine produced.
        for row, request in zip(calls, requests, strict=True):
            assert row["token_source"] == "gateway"
            assert row["prompt_token_ids"] == token_ids(prompt_text(request))
            assert row["response_token_ids"] == token_ids(answer_text({"content": None, **script(request)}))

        # The reward from the agent's stdout (`tracerl rollout --reward`), credited to every call.
        want = 1.0 if tid == "marathon" else 0.0
        assert [r["reward"] for r in calls] == [want] * len(calls) and calls[0]["rollout_reward"] == want

        # The spans behind it: the run is one trace (the gateway's spans in it, though the gateway
        # process has no rollout id of its own); each gateway span sits under the AI SDK's model-call
        # span, through undici's fetch span, which carried the traceparent.
        assert len({r["trace_id"] for r in calls}) == 1
        mine = [s for s in spans if s["trace_id"] == calls[0]["trace_id"]]
        assert {
            s["rollout_id"]
            for s in mine
            if s["resource_attributes"].get("telemetry.sdk.language") == "nodejs"
        } == {calls[0]["rollout_id"]}
        by_id = {s["span_id"]: s for s in mine}
        gateways = [s for s in mine if s["attributes"].get("tracerl.gateway", "").lower() == "true"]
        assert len(gateways) == len(calls)
        for g in gateways:
            fetch = by_id[g["parent_span_id"]]
            assert fetch["name"] == "POST" and fetch["attributes"]["url.full"].endswith("/chat/completions")
            call = by_id[fetch["parent_span_id"]]
            assert call["name"] == "chat policy" and call["span_id"] in {r["span_id"] for r in calls}
        tools = [s for s in mine if s["name"] == "execute_tool convert"]
        assert len(tools) == n_tools and {by_id[s["parent_span_id"]]["name"] for s in tools} <= {
            f"step {i + 1}" for i in range(n_tools)
        }

    # Every span of the agent (Node) came in over OTLP/HTTP; the gateway's (Python) over gRPC.
    node = {s["span_id"] for s in spans if s["resource_attributes"].get("telemetry.sdk.language") == "nodejs"}
    assert node and node <= _span_ids(http_traces)
    gateway = {s["span_id"] for s in spans if s["attributes"].get("tracerl.gateway", "").lower() == "true"}
    assert len(gateway) == 5 and not gateway & _span_ids(http_traces)
    assert {s["resource_attributes"].get("service.name") for s in spans if s["span_id"] in node} == {
        "units-agent"
    }


def test_convert_tool_and_reward() -> None:
    """The tool runs in the agent's own Node environment; reward.py reads the agent's JSON line."""
    from importlib.util import module_from_spec, spec_from_file_location

    npm_ci(AGENT_DIR)
    code = """import("./examples/vercel_agent/agent.mjs").then(({ convert }) => {
        const out = {};
        for (const [value, from, to] of JSON.parse(process.argv[1])) {
          try { out[`${value} ${from} ${to}`] = convert({ value, from, to }); }
          catch (e) { out[`${value} ${from} ${to}`] = "Error: " + e.message; }
        }
        console.log(JSON.stringify(out));
      })"""
    cases = [
        [42.195, "km", "mi"],
        [2.5, "lb", "kg"],
        [14, "gal", "l"],
        [190, "min", "h"],
        [1, "kg", "m"],
        [1, "parsec", "m"],
    ]
    proc = subprocess.run(
        ["node", "-e", code, json.dumps(cases)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out = json.loads(proc.stdout)
    assert [out[f"{v} {f} {t}"] for v, f, t in cases[:4]] == [26.2188, 1.134, 52.9958, 3.1667]
    assert out["1 kg m"] == "Error: cannot convert mass (kg) to length (m)"
    assert out["1 parsec m"].startswith("Error: unknown unit parsec")

    spec = spec_from_file_location("vercel_reward", AGENT_DIR / "reward.py")
    reward = module_from_spec(spec)
    spec.loader.exec_module(reward)
    tasks = {t["id"]: t for t in map(json.loads, (AGENT_DIR / "tasks.jsonl").read_text().splitlines())}
    line = lambda answer: json.dumps({"answer": answer, "final": "...", "steps": 2}) + "\n"  # noqa: E731
    assert reward.score(tasks["marathon"], line(26.22)) == 1.0
    assert reward.score(tasks["marathon"], line(26.5)) == 0.0
    assert reward.score(tasks["flour"], line(1.434)) == 1.0 and reward.score(tasks["flour"], line(1.4)) == 0.0
    assert reward.score(tasks["tank"], line(None)) == 0.0 and reward.score(tasks["tank"], "crashed\n") == 0.0
    assert reward.score(tasks["tank"], line(True)) == 0.0 and reward.score(tasks["tank"], "") == 0.0
