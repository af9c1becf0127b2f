"""examples/calculator_agent: an AutoGen solver with a calculator tool and a verifier, run through tracerl.

The agent runs unmodified in its own virtualenv under ``opentelemetry-instrument``: AutoGen's own
GenAI spans (``invoke_agent solver``) name the agents, OpenLLMetry records the openai calls under
them and the gateway joins the token ids. The scripted model plays both agents, so every
transition's content is known exactly.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from types import ModuleType

import pytest
from example_rig import EXAMPLES, ROOT, answer_text, example_venv, prompt_text, stored_spans, token_ids

from store.location import parse_store

pytestmark = [pytest.mark.slow, pytest.mark.prebuilt("calculator_agent")]

AGENT = ["python", "examples/calculator_agent/agent.py"]
REWARD = "examples/calculator_agent/reward.py:score"
# The scripted solver writes the right expression for "pens" and a wrong one for "apples" (+ instead
# of -), so reward.py, reading the agent's stdout, gives 1.0 and 0.0.
TASKS = [
    {"id": "pens", "question": "A pen costs $8. Maria buys 9 pens and pays with $90. "
                               "How many dollars of change does she get?", "answer": 18},
    {"id": "apples", "question": "There are 3 boxes with 14 apples each. 9 apples are eaten. "
                                 "How many apples are left?", "answer": 33},
]
EXPRESSION = {"pens": "90 - 8 * 9", "apples": "3 * 14 + 9"}
RESULT = {"pens": "18", "apples": "51"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"calculator_{name}", EXAMPLES / "calculator_agent" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _task_of(body: dict) -> str:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    return next(t["id"] for t in TASKS if t["question"] in user)


def _call_id(task_id: str) -> str:
    return f"call_{task_id}_1"


def script(body: dict) -> dict:
    """The model, as both agents: the solver calls the calculator, then states the tool's result;
    the verifier approves. Which agent asks is read from its system message, as a model would."""
    messages = body["messages"]
    task_id = _task_of(body)
    if "check a solution" in messages[0]["content"]:
        return {"content": "APPROVE"}
    if messages[-1]["role"] == "tool":
        return {"content": f"The answer is {messages[-1]['content']}."}
    return {"tool_calls": [{"id": _call_id(task_id), "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": EXPRESSION[task_id]})}}]}


@pytest.mark.parametrize("runtime_tracing", ["on", "off"])
def test_solver_tool_call_and_verifier_become_three_gateway_joined_transitions_per_rollout(
        stack_factory, runtime_tracing: str, tmp_path) -> None:
    """AutoGen's runtime messaging spans (on by default) split a run over many traces; off
    (AUTOGEN_DISABLE_RUNTIME_TRACING=true) leaves only the GenAI spans. The transitions are the same."""
    bin_dir = example_venv("calculator_agent")
    stack = stack_factory(script)
    env = {"AUTOGEN_DISABLE_RUNTIME_TRACING": "true"} if runtime_tracing == "off" else {}
    stack.rollout(bin_dir, AGENT, TASKS, extra_env=env, rollout_args=("--reward", REWARD))
    rows = stack.transitions()

    # One transition per model call: 6 requests reached the model, 6 rows, nothing counted twice.
    assert len(stack.engine.requests) == 6 and len(rows) == 6
    assert {(b["model"], b.get("max_tokens"), b.get("temperature")) for b in stack.engine.requests} == {
        ("policy", 256, 1.0)}  # agent.py's defaults (CALC_MODEL, CALC_MAX_TOKENS, CALC_TEMPERATURE)
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    assert sorted(by_task) == ["apples", "pens"]
    spans = stored_spans(stack.store)
    for task in TASKS:
        tid = task["id"]
        calls = sorted(by_task[tid], key=lambda r: r["step"])
        requests = [b for b in stack.engine.requests if _task_of(b) == tid]  # this rollout's, in order
        assert [r["agent_name"] for r in calls] == ["solver", "solver", "verifier"]
        assert [r["step"] for r in calls] == [0, 1, 2] and [r["is_last"] for r in calls] == [False, False, True]
        assert len({r["rollout_id"] for r in calls}) == 1

        # 1. The solver asks for the calculator.
        first = calls[0]
        assert first["finish_reason"] == "tool_calls"
        (tc,) = json.loads(first["response_message"])["tool_calls"]
        assert tc["id"] == _call_id(tid) and tc["function"]["name"] == "calculator"
        assert json.loads(tc["function"]["arguments"]) == {"expression": EXPRESSION[tid]}
        assert [t["function"]["name"] for t in json.loads(first["tools"])] == ["calculator"]
        assert [m["role"] for m in json.loads(first["prompt_messages"])] == ["system", "user"]

        # 2. The solver answers from the tool result (computed by the agent's calculator), which is
        # in its prompt as a tool message after its own tool call.
        second = calls[1]
        prompt = json.loads(second["prompt_messages"])
        assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool"]
        assert prompt[2]["tool_calls"] == [tc]
        assert prompt[3] == {"role": "tool", "content": RESULT[tid], "tool_call_id": _call_id(tid)}
        assert json.loads(second["response_message"]) == {"role": "assistant", "content": f"The answer is {RESULT[tid]}."}
        assert second["finish_reason"] == "stop"
        # max_tool_iterations=3: the follow-up is an ordinary call with the tool still offered, not
        # the tool_choice="none" reflection call (which comes only after 3 rounds of tool calls).
        assert requests[1].get("tools") and requests[1].get("tool_choice", "auto") == "auto"

        # 3. The verifier sees the question and the solver's answer (not its tool traffic) and approves.
        third = calls[2]
        vprompt = json.loads(third["prompt_messages"])
        assert "check a solution" in vprompt[0]["content"]
        assert [m["role"] for m in vprompt] == ["system", "user", "user"]
        assert vprompt[1]["content"] == task["question"]
        assert vprompt[2]["content"] == f"The answer is {RESULT[tid]}."
        assert json.loads(third["response_message"])["content"] == "APPROVE"
        assert third["tools"] is None

        # Exact token ids, joined from the gateway's span of the same call.
        for row, request in zip(calls, requests, strict=True):
            assert row["token_source"] == "gateway"
            assert row["prompt_token_ids"] == token_ids(prompt_text(request))
            assert row["response_token_ids"] == token_ids(answer_text(json.loads(row["response_message"])))

        # The reward came from the agent's stdout via `tracerl rollout --reward` and is on every call.
        want = 1.0 if tid == "pens" else 0.0
        assert [r["reward"] for r in calls] == [want] * 3 and calls[0]["rollout_reward"] == want

        # The spans behind it: AutoGen runs the tool inside the solver's invoke_agent span.
        mine = [s for s in spans if s["rollout_id"] == calls[0]["rollout_id"]]
        by_id = {(s["trace_id"], s["span_id"]): s for s in mine}
        (tool,) = [s for s in mine if s["name"] == "execute_tool calculator"]
        assert dict(tool["attributes"])["gen_ai.tool.call.id"] == _call_id(tid)
        assert by_id[(tool["trace_id"], tool["parent_span_id"])]["name"] == "invoke_agent solver"
        llm = [s for s in mine if s["name"] == "openai.chat"]
        assert sorted(by_id[(s["trace_id"], s["parent_span_id"])]["name"] for s in llm) == [
            "invoke_agent solver", "invoke_agent solver", "invoke_agent verifier"]
        assert any(s["name"].startswith("autogen process") for s in mine) == (runtime_tracing == "on")

    if runtime_tracing == "on":
        assert _rollouts_by_links(stack.store, tmp_path) == {
            frozenset(r["span_id"] for r in rows if r["task_id"] == t["id"]) for t in TASKS}


def _rollouts_by_links(store, tmp_path) -> set[frozenset[str]]:
    """The same spans as a hand-run AutoGen agent would leave them (no ``tracerl.rollout_id``: one trace
    per message), converted afresh: the span links AutoGen records join each run's traces again.
    Returns the call span ids of each converted rollout."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from schemas.tables import SPANS_SCHEMA
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from store.layout import StoreLayout
    from store.parquet import read_table, write_table_atomic
    from store.views import connect_readonly

    spans = read_table(StoreLayout.at(store).table("spans"), "spans")
    res = [[(k, v) for k, v in m if k != "tracerl.rollout_id"] for m in spans.column("resource_attributes").to_pylist()]
    spans = spans.set_column(spans.schema.get_field_index("resource_attributes"), "resource_attributes",
                             pa.array(res, spans.schema.field("resource_attributes").type))
    spans = spans.set_column(spans.schema.get_field_index("rollout_id"), "rollout_id", spans.column("trace_id"))
    assert pc.any(pc.greater(pc.list_value_length(spans.column("links")), 0)).as_py()
    hand_run = tmp_path / "hand-run"
    write_table_atomic(spans.select(SPANS_SCHEMA.names),
                       StoreLayout.at(hand_run).partition("spans", "2026-11-21") / "all.parquet", "spans")
    convert_store(parse_store(hand_run), ConvertConfig(quiet_s=0, missing_reward="fill"))
    con = connect_readonly(parse_store(hand_run))
    groups = con.execute("SELECT list(span_id) FROM transitions GROUP BY rollout_id").fetchall()
    return {frozenset(g) for (g,) in groups}


def test_calculator_evaluates_arithmetic_and_refuses_anything_else() -> None:
    """The tool runs in the example's own environment (agent.py imports AutoGen)."""
    bin_dir = example_venv("calculator_agent")
    code = """if True:
        import json, sys
        sys.path.insert(0, "examples/calculator_agent")
        from agent import calculator, last_number
        out = {}
        for e in sys.argv[1:]:
            try:
                out[e] = calculator(e)
            except ValueError as err:
                out[e] = "ValueError: " + str(err)
        out["last"] = last_number("Change: 90 - 72 = 1,018.")
        print(json.dumps(out))
    """
    exprs = ["90 - 8 * 9", "7 / 2", "6 / 3", "(1 + 2) * -3", "2 ** 10", "0.1 + 0.2", "17 // 5 + 17 % 5",
             "__import__('os')", "2 ** 1000", "1 / 0", "abc", "True + 1", "1 +"]
    proc = subprocess.run([str(bin_dir / "python"), "-c", code, *exprs], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    out = json.loads(proc.stdout)
    assert [out[e] for e in exprs[:7]] == ["18", "3.5", "2", "-9", "1024", "0.3", "5"]
    for e in exprs[7:]:
        assert out[e].startswith("ValueError: "), (e, out[e])
    assert "too large" in out["2 ** 1000"] and out["1 / 0"] == "ValueError: division by zero"
    assert out["last"] == "1018"


def test_reward_matches_the_final_number_of_make_tasks_answers() -> None:
    reward, make_tasks = _load("reward"), _load("make_tasks")
    tasks = make_tasks.make_tasks(12, seed=3)
    assert len({t["id"] for t in tasks}) == 12 and tasks == make_tasks.make_tasks(12, seed=3)
    for t in tasks:
        assert isinstance(t["answer"], int) and t["answer"] > 0
        assert reward.score(t, json.dumps({"answer": str(t["answer"]), "final": "..."}) + "\n") == 1.0
        assert reward.score(t, json.dumps({"answer": str(t["answer"] + 1)})) == 0.0
    assert reward.score({"answer": 18}, "The answer is 18.\n") == 1.0
    assert reward.score({"answer": 18}, "The answer is 1,018.") == 0.0
    assert reward.score({"answer": 2.5}, '{"answer": "2.50"}') == 1.0
    assert reward.score({"answer": 18}, '{"answer": null}') == 0.0
    assert reward.score({"answer": 18}, "") == 0.0
