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
])
def test_framework_spellings_of_an_agent_span(name: str, attrs: dict, want: str | None) -> None:
    t = TraceBuilder()
    assert agent_of_span(t.span(name, None, attrs)) == want
