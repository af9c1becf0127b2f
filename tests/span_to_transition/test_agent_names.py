"""Agent names where the framework gives none: the process's resource attribute, or ``--agent-from span-name``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from span_to_transition.convert import ConvertConfig
from span_to_transition.doctor import diagnose
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.location import parse_store

from .factory import TraceBuilder, spans_table
from .test_store import LATER, put, transitions


def dspy_run(store: Path, resource: dict[str, str] | None = None, agent: str | None = None) -> None:
    """DSPy's ReAct under OpenInference: CHAIN spans ``ReAct.forward`` > ``Predict.forward``, no agent name or kind,
    and the LLM span below (here with the process's resource attributes)."""
    t = TraceBuilder("c" * 32, rollout_id="dspy-1", received_at_ns=100)
    react = t.span("ReAct.forward", None, {"openinference.span.kind": "CHAIN"}, agent=agent)
    predict = t.span("Predict(StringSignature).forward", react, {"openinference.span.kind": "CHAIN"})
    t.span("LM.__call__", predict, {"openinference.span.kind": "LLM", "llm.model_name": "policy@1",
                                    "llm.input_messages.0.message.role": "user",
                                    "llm.input_messages.0.message.content": "2+2?",
                                    "llm.output_messages.0.message.role": "assistant",
                                    "llm.output_messages.0.message.content": "4"})
    t.reward(react, 1.0)
    spans = [dataclasses.replace(s, resource_attributes=dict(resource or {})) for s in t.spans]
    put(store, "spans", spans_table(spans), "dspy")


def _names(store: Path, **config) -> list[tuple[str | None, bool]]:
    convert_store(parse_store(store), ConvertConfig(quiet_s=0, **config), now_ns=LATER)
    return [(r["agent_name"], r["trainable"]) for r in transitions(store)]


def test_a_framework_that_names_no_agent_gives_none(tmp_path: Path) -> None:
    dspy_run(tmp_path)
    assert _names(tmp_path, agents="ReAct") == [(None, False)]


def test_agent_from_span_name_takes_the_nearest_chain_span(tmp_path: Path) -> None:
    dspy_run(tmp_path)
    assert _names(tmp_path, agents="Predict.*", agent_from="span-name") == [("Predict(StringSignature)", True)]


def test_the_resource_attribute_names_every_call_of_the_process(tmp_path: Path) -> None:
    dspy_run(tmp_path, resource={"gen_ai.agent.name": "solver"})
    assert _names(tmp_path, agents="solver") == [("solver", True)]


def test_the_framework_name_wins_over_the_resource_attribute(tmp_path: Path) -> None:
    dspy_run(tmp_path, resource={"gen_ai.agent.name": "solver"}, agent="react")
    assert _names(tmp_path, agent_from="span-name") == [("react", True)]


def test_the_doctor_suggests_both_ways_when_agents_selects_calls_with_no_name(tmp_path: Path) -> None:
    dspy_run(tmp_path)
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, agents="ReAct"), now_ns=LATER)
    [finding] = [f for f in diagnose(gather(parse_store(tmp_path), now_ns=LATER)) if f.problem == "calls without an agent name"]
    assert "1 of 1 transition" in finding.saw and "--agents 'ReAct'" in finding.means
    assert "OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=" in finding.fix and "--agent-from span-name" in finding.fix


def test_an_unknown_agent_from_is_a_usage_error() -> None:
    with pytest.raises(ValueError, match="--agent-from 'tree' is unknown; choose framework or span-name"):
        ConvertConfig(agent_from="tree").validate()
