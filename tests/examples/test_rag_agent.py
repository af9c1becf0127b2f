"""examples/rag_agent end to end: an OpenAI Agents SDK researcher → writer handoff over a BM25 tool.

The agent runs in its own virtualenv under ``opentelemetry-instrument`` (OpenInference's Agents SDK
processor + OpenLLMetry's openai instrumentation), through the real ``tracerl rollout`` driver,
collector and gateway; only the model is scripted. Per rollout the script answers:

1. researcher, no tool result yet → ``search_docs({"query": <question>})``;
2. researcher, with the tool result → ``transfer_to_writer({})`` (the handoff);
3. writer → "From the docs: <the first retrieved passage>".

The rollouts run once per module; the tests read the same spans, transitions and driver records.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from types import ModuleType

import pytest
from example_rig import EXAMPLES, example_venv, prompt_text, running_stack, token_ids

pytestmark = [pytest.mark.slow, pytest.mark.prebuilt("rag_agent")]
EXAMPLE = EXAMPLES / "rag_agent"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"rag_agent_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reward = _load("reward")
RETURNS = _load("make_tasks").make_tasks(["returns"])[0]
# Not in make_tasks: the top passage names the office but not the founder, so the reward is 0.5.
OFFICE = {"id": "founder-office", "question": "Who founded Brightwater Outfitters, and where is its head office?",
          "keywords": ["Ingrid Halvorsen", "Storgata 14"]}
TASKS = [RETURNS, OFFICE]
TOP_PASSAGE = {"returns": ("returns.md", 0), "founder-office": ("company.md", 1)}  # (document, paragraph)


def passage(doc: str, paragraph: int) -> str:
    """How search_docs prints a corpus paragraph: ``[doc] Title: text`` (read here from the file)."""
    title, *paragraphs = [p.strip() for p in (EXAMPLE / "corpus" / doc).read_text().split("\n\n") if p.strip()]
    return f"[{doc}] {title.lstrip('# ')}: {' '.join(paragraphs[paragraph].split())}"


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def script(body: dict) -> dict:
    """The model: which agent is asking is read from its system prompt, the turn from the tool results."""
    messages = body["messages"]
    system = messages[0]["content"]
    results = [m for m in messages if m["role"] == "tool"]
    if system.startswith("You are the researcher"):
        if not results:
            question = next(m["content"] for m in messages if m["role"] == "user")
            return {"tool_calls": [call("call_search_1", "search_docs", {"query": question})]}
        return {"tool_calls": [call("call_handoff_1", "transfer_to_writer", {})]}
    assert system.startswith("You are the writer"), system
    return {"content": "From the docs: " + results[0]["content"].splitlines()[0]}


def answer_text(message: dict) -> str:
    """What the scripted engine 'tokenizes' as the answer (example_rig.ScriptedEngine.answer)."""
    calls = json.dumps(message["tool_calls"], sort_keys=True) if message.get("tool_calls") else ""
    return (message.get("content") or "") + calls


@dataclass
class Run:
    rows: list[dict]
    spans: list[dict]
    records: list[dict]
    requests: list[dict]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Both tasks through ``tracerl rollout --reward examples/rag_agent/reward.py:score`` (the rig's
    stack, built once for the module's tests)."""
    import pyarrow as pa

    from store.layout import StoreLayout
    from store.parquet import read_table

    bin_dir = example_venv("rag_agent")
    tmp = tmp_path_factory.mktemp("rag_agent")
    with running_stack(tmp / "store", script) as stack:
        stack.rollout(bin_dir, ["python", str(EXAMPLE / "agent.py")], TASKS,
                      rollout_args=("--reward", f"{EXAMPLE / 'reward.py'}:score"))
        rows = stack.transitions()  # flushes the gateway's and the collector's spans first
        table = read_table(StoreLayout.at(tmp / "store").table("spans"), "spans")
        requests = list(stack.engine.requests)
    for name in ("start_time_ns", "end_time_ns", "received_at"):
        table = table.set_column(table.schema.get_field_index(name), name, table.column(name).cast(pa.int64()))
    spans = [{**s, "attributes": dict(s["attributes"] or [])} for s in table.to_pylist()]
    records = [json.loads(line) for f in sorted((tmp / "store" / "rollouts").glob("driver-*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    return Run(rows, spans, records, requests)


def test_rag_agent_researcher_searches_hands_off_and_writer_answers(run: Run) -> None:
    by_task = {r["task_id"]: r for r in run.records}
    assert sorted(by_task) == ["founder-office", "returns"]
    assert all(r["status"] == "ok" and r["exit_code"] == 0 for r in run.records), run.records
    # Nothing was uploaded to OpenAI's trace ingest: the SDK's default processor would log this here.
    assert not any("Tracing request failed" in (r["stderr_tail"] or "") for r in run.records)

    calls = run.rows
    for task in TASKS:
        rollout = [r for r in calls if r["task_id"] == task["id"]]
        requests = [q for q in run.requests if q["messages"][1]["content"] == task["question"]]
        assert [r["agent_name"] for r in rollout] == ["researcher", "researcher", "writer"], rollout
        assert len({r["rollout_id"] for r in rollout}) == 1 and len(requests) == 3
        search, handoff, final = (json.loads(r["response_message"]) for r in rollout)
        found = passage(*TOP_PASSAGE[task["id"]])

        # 1: the researcher's search_docs call, and the tool definition it was offered
        assert search["tool_calls"] == [call("call_search_1", "search_docs", {"query": task["question"]})]
        assert rollout[0]["finish_reason"] == "tool_calls"
        assert [t["function"]["name"] for t in json.loads(rollout[0]["tools"])] == ["search_docs", "transfer_to_writer"]
        # 2: the tool's real BM25 result in the next call's prompt, then the handoff
        prompt = json.loads(rollout[1]["prompt_messages"])
        assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool"]
        assert prompt[2]["tool_calls"] == search["tool_calls"]
        assert prompt[3]["tool_call_id"] == "call_search_1"
        assert prompt[3]["content"].splitlines()[0] == found
        assert handoff["tool_calls"] == [call("call_handoff_1", "transfer_to_writer", {})]
        # 3: the writer sees the whole conversation (search result and handoff) and answers
        prompt = json.loads(rollout[2]["prompt_messages"])
        assert prompt[0]["content"].startswith("You are the writer")
        assert [m["role"] for m in prompt[1:]] == ["user", "assistant", "tool", "assistant", "tool"]
        assert prompt[3]["content"].splitlines()[0] == found
        assert final == {"role": "assistant", "content": f"From the docs: {found}"}
        assert rollout[2]["finish_reason"] == "stop"

        # exact token ids from the gateway, per call
        for row, request in zip(rollout, requests):
            assert row["prompt_token_ids"] == token_ids(prompt_text(request))
            assert row["response_token_ids"] == token_ids(answer_text(script(request)))
            assert row["response_logprobs"] == [-0.25] * len(row["response_token_ids"])

        # the reward from --reward examples/rag_agent/reward.py:score, on the agent's stdout
        expected = reward.score(task, final["content"])
        assert by_task[task["id"]]["reward"] == expected
        assert all(r["rollout_reward"] == expected and r["reward_source"] == "side_channel" for r in rollout)
    assert {t["id"]: reward.score(t, "From the docs: " + passage(*TOP_PASSAGE[t["id"]])) for t in TASKS} == {
        "returns": 1.0, "founder-office": 0.5}

    # the agent spans the Agents SDK reported, as OpenTelemetry spans (OpenInference)
    kinds = {(s["name"], s["attributes"].get("openinference.span.kind")) for s in run.spans}
    assert {("researcher", "AGENT"), ("writer", "AGENT"), ("search_docs", "TOOL"), ("handoff to writer", "TOOL")} <= kinds


def test_rag_agent_one_transition_per_llm_call(run: Run) -> None:
    """OpenInference's ``generation`` span (no response id) over OpenLLMetry's ``openai.chat`` is one
    request: the converter keeps the inner record, the one the gateway's token span hangs under."""
    for task in TASKS:
        rollout = [r for r in run.rows if r["task_id"] == task["id"]]
        assert [(r["step"], r["agent_name"], r["token_source"]) for r in rollout] == [
            (0, "researcher", "gateway"), (1, "researcher", "gateway"), (2, "writer", "gateway")]
        assert [r["is_last"] for r in rollout] == [False, False, True]
