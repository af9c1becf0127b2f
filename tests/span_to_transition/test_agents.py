"""Agent attribution in a multi-agent trace, and --agents selection."""

from __future__ import annotations

import pytest

from span_to_transition.agents import agent_of_span, compile_agents
from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout

from .factory import TraceBuilder, user


def writer_checker_rewriter() -> TraceBuilder:
    """writer drafts, checker (nested inside writer) critiques, rewriter revises; same model."""
    t = TraceBuilder()
    root = t.span("workflow")
    writer = t.span("invoke_agent writer", root, agent="writer")
    t.chat(writer, [user("write a haiku")], "draft", response_id="w1")
    checker = t.span("invoke_agent checker", writer, agent="checker")
    t.chat(checker, [user("check: draft")], "too long", response_id="c1")
    rewriter = t.span("agent", root, {"agent.name": "rewriter"})  # OpenInference spelling
    t.chat(rewriter, [user("rewrite: draft")], "final", response_id="x1")
    t.reward(root, 0.5)
    return t


def test_each_call_gets_its_nearest_agent() -> None:
    out = convert_rollout(RolloutInput("r", writer_checker_rewriter().spans), ConvertConfig())
    assert [(t.agent_name, t.response_message) for t in out.transitions] == [
        ("writer", '{"role":"assistant","content":"draft"}'),
        ("checker", '{"role":"assistant","content":"too long"}'),
        ("rewriter", '{"role":"assistant","content":"final"}'),
    ]
    assert all(t.trainable for t in out.transitions)


def test_agents_regex_selects_exactly_those_agents_and_keeps_the_others() -> None:
    out = convert_rollout(RolloutInput("r", writer_checker_rewriter().spans), ConvertConfig(agents="writer|rewriter"))
    assert [(t.agent_name, t.trainable) for t in out.transitions] == [
        ("writer", True), ("checker", False), ("rewriter", True)]


def test_agents_regex_must_match_the_whole_name() -> None:
    out = convert_rollout(RolloutInput("r", writer_checker_rewriter().spans), ConvertConfig(agents="writer"))
    assert [t.trainable for t in out.transitions] == [True, False, False]  # not "rewriter"


def test_bad_regex_names_the_fix() -> None:
    with pytest.raises(ValueError, match="--agents"):
        compile_agents("writer(")


@pytest.mark.parametrize(("name", "attrs", "want"), [
    ("invoke_agent planner", {}, "planner"),
    ("x", {"gen_ai.agent.name": "a"}, "a"),
    ("x", {"agent_name": "pyd"}, "pyd"),
    ("x", {"crewai.agent.role": "Researcher"}, "Researcher"),
    ("research.agent", {"traceloop.span.kind": "agent", "traceloop.entity.name": "research"}, "research"),
    ("x", {"traceloop.span.kind": "task", "traceloop.entity.name": "t"}, None),
    ("Planner", {"openinference.span.kind": "AGENT"}, "Planner"),
    ("chat", {"gen_ai.operation.name": "chat"}, None),
    # the framework's identity over the span name (one rule, agents.py docstring)
    ("calculator.run", {"openinference.span.kind": "AGENT"}, "calculator"),  # smolagents
    ("calculator._execute_core", {"openinference.span.kind": "AGENT", "graph.node.id": "calc"}, "calc"),  # CrewAI
    ("calculator._execute_core", {"openinference.span.kind": "AGENT"}, "calculator"),
    ("v1.2", {"openinference.span.kind": "AGENT"}, "v1.2"),  # not a method: the name as it is
    ("Team.run", {"openinference.span.kind": "AGENT", "agent.name": "team"}, "team"),
    ("BaseWorkflowAgent.run_agent_step", {"openinference.span.kind": "CHAIN", "input.value":  # LlamaIndex
     '{"ev": "AgentSetup(input=[], current_agent_name=\'weather\')"}'}, "weather"),
    ("BaseWorkflowAgent.call_tool", {"openinference.span.kind": "CHAIN", "input.value": "{}"}, None),
    ("RunnableSequence", {"openinference.span.kind": "CHAIN"}, None),
])
def test_framework_spellings_of_an_agent_span(name: str, attrs: dict, want: str | None) -> None:
    t = TraceBuilder()
    assert agent_of_span(t.span(name, None, attrs)) == want


def langgraph_trace() -> TraceBuilder:
    """What OpenLLMetry's LangChain instrumentation 0.62.4 records (attributes as observed, trimmed): a
    LangGraph 1.2 ``StateGraph`` with ``writer`` and ``checker`` nodes, then LangChain 1.4's
    ``create_agent(name="solo")``, whose inner nodes are ``model`` and ``tools``."""
    t = TraceBuilder()
    p = "traceloop.association.properties."
    graph = t.span("invoke_agent LangGraph", None, {"gen_ai.provider.name": "langgraph"}, agent="LangGraph")
    flow = t.span("LangGraph.workflow", graph, {"traceloop.span.kind": "workflow", "traceloop.entity.name": "LangGraph",
                                                f"{p}ls_integration": "langgraph"}, agent="LangGraph")
    for node, rid in (("writer", "w1"), ("checker", "c1")):
        task = t.span(f"execute_task {node}", flow, {
            "gen_ai.operation.name": "execute_task", "gen_ai.task.name": node, "traceloop.span.kind": "task",
            "traceloop.entity.name": node, f"{p}langgraph_node": node, f"{p}ls_integration": "langgraph"})
        t.chat(task, [user(f"{node} this")], node, response_id=rid, extra={
            f"{p}langgraph_node": node, f"{p}ls_integration": "langchain_chat_model", "traceloop.entity.path": node})
    solo = t.span("invoke_agent solo", None, {"gen_ai.provider.name": "langgraph"}, agent="solo")
    solo_flow = t.span("solo.workflow", solo, {"traceloop.span.kind": "workflow", "traceloop.entity.name": "solo",
                                               f"{p}lc_agent_name": "solo",
                                               f"{p}ls_integration": "langchain_create_agent"}, agent="solo")
    model = t.span("execute_task model", solo_flow, {
        "gen_ai.operation.name": "execute_task", "traceloop.span.kind": "task", "traceloop.entity.name": "model",
        f"{p}langgraph_node": "model", f"{p}lc_agent_name": "solo", f"{p}ls_integration": "langchain_create_agent"})
    t.chat(model, [user("solo this")], "solo", response_id="s1", extra={f"{p}langgraph_node": "model"})
    t.reward(solo, 1.0)
    return t


def test_a_langgraph_node_is_the_agent_of_its_calls_but_not_create_agents_inner_nodes() -> None:
    out = convert_rollout(RolloutInput("r", langgraph_trace().spans), ConvertConfig(agents="writer|solo"))
    assert [(t.agent_name, t.trainable) for t in out.transitions] == [
        ("writer", True), ("checker", False), ("solo", True)]
