"""Agent frameworks recorded through their own OpenTelemetry route convert to exactly what went over the wire.

Each fixture (``fixtures/record_frameworks.py``) is a real framework agent run unchanged under
``opentelemetry-instrument`` against a recording server; ``<name>.wire.json`` holds the requests that
server received. The transitions must equal that wire: roles, text, tool calls, tool results, order. The
one representation difference allowed is the canonical one (``wire_message``): a content of one text
part reads as its text, an absent content as null.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracerl_testing import wire_message

from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic
from store.views import connect_readonly

from .factory import FIXTURES, fixture_tables

FRAMEWORKS = {  # fixture -> the agent name the user gave the agent
    "strands": "weather", "strands-latest": "weather",
    "smolagents": "calculator", "smolagents-stream": "calculator",
    "llamaindex": "weather", "llamaindex-stream": "weather",
    "crewai": "calculator",  # its AGENT span is calculator._execute_core, with graph.node.id = calculator
}
LATER = 2_000_000_000 * 10**9  # a "now" long after the recording: every rollout is complete


def convert(name: str, tmp_path: Path, **config) -> list[dict]:
    traces, logs = fixture_tables(name)
    layout = StoreLayout.at(tmp_path)
    write_table_atomic(traces, layout.partition("spans", "2026-11-24") / "f.parquet", "spans")
    if logs is not None:
        write_table_atomic(logs, layout.partition("logs", "2026-11-24") / "f.parquet", "logs")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(missing_reward="fill", **config), now_ns=LATER)
    assert stats.problems == [], stats.problems
    con = connect_readonly(parse_store(tmp_path))
    rows = con.sql("SELECT * EXCLUDE (started_at, ended_at) FROM transitions ORDER BY step").to_arrow_table().to_pylist()
    con.close()
    return rows


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_each_framework_converts_to_the_recorded_wire(name: str, tmp_path: Path) -> None:
    wire = json.loads((FIXTURES / f"{name}.wire.json").read_text())
    rows = convert(name, tmp_path)
    assert len(rows) == len(wire) == 2
    for row, sent in zip(rows, wire):
        assert [wire_message(m) for m in json.loads(row["prompt_messages"])] == \
            [wire_message(m) for m in sent["request"]["messages"]]
        assert wire_message(json.loads(row["response_message"])) == \
            wire_message(sent["response"]["choices"][0]["message"])
        assert row["finish_reason"] == sent["response"]["choices"][0]["finish_reason"]
        assert row["agent_name"] == FRAMEWORKS[name]
        assert row["model"] == "policy@3" and row["policy_version"] == 3


@pytest.mark.parametrize("name", ["strands", "smolagents", "llamaindex", "crewai"])
def test_agents_select_by_the_name_the_user_gave(name: str, tmp_path: Path) -> None:
    rows = convert(name, tmp_path / "on", agents=FRAMEWORKS[name])
    assert [r["trainable"] for r in rows] == [True, True]
    rows = convert(name, tmp_path / "off", agents="someone_else")
    assert [r["trainable"] for r in rows] == [False, False]


def test_smolagents_internal_roles_never_reach_a_transition(tmp_path: Path) -> None:
    rows = convert("smolagents", tmp_path)
    roles = [m["role"] for m in json.loads(rows[1]["prompt_messages"])]
    assert roles == ["system", "user", "assistant", "user"]
