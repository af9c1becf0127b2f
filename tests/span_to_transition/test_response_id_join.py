"""Exact token ids without traceparent: a gateway span in a trace of its own joins the call with its response id."""

from __future__ import annotations

from pathlib import Path

from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.location import parse_store
from store.views import connect_readonly

from .factory import TraceBuilder, fixture_tables, spans_table, user
from .test_store import LATER, S, put, transitions

IDS = {"tracerl.prompt_token_ids": [5, 6], "tracerl.response_token_ids": [7], "tracerl.response_logprobs": [-0.5]}


def agent_run(store: Path, rollout_id: str | None, response_ids: list[str | None]) -> TraceBuilder:
    t = TraceBuilder("a" * 32, rollout_id=rollout_id, received_at_ns=100 * S)
    root = t.span("invoke_agent a", agent="a")
    for i, rid in enumerate(response_ids):
        t.chat(root, [user(f"q{i}")], "x", response_id=rid)
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "agent")
    return t


def gateway_trace(store: Path, trace_hex: str, response_id: str, name: str) -> None:
    """What ``tracerl gateway`` records for a request that came without traceparent: a root span, its own trace,
    no rollout id (the collector's default is the trace id)."""
    gw = TraceBuilder(trace_hex * 32, received_at_ns=101 * S)
    gw.span("tracerl.gateway policy", None, {"tracerl.gateway": True, "gen_ai.response.id": response_id, **IDS})
    put(store, "spans", spans_table(gw.spans), name)


def test_a_gateway_span_in_its_own_trace_joins_the_call_with_its_response_id(tmp_path: Path) -> None:
    agent_run(tmp_path, "run-1", ["r1", "r2"])
    gateway_trace(tmp_path, "b", "r1", "gw1")
    gateway_trace(tmp_path, "c", "r2", "gw2")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.problems == []
    assert (stats.rollouts_seen, stats.transitions_written) == (1, 2)  # the gateway traces are not rollouts
    rows = sorted(transitions(tmp_path), key=lambda r: r["step"])
    assert [(r["rollout_id"], r["token_source"], r["prompt_token_ids"]) for r in rows] == [
        ("run-1", "gateway", [5, 6]), ("run-1", "gateway", [5, 6])]


def test_the_join_needs_no_rollout_id_on_the_agent_either(tmp_path: Path) -> None:
    agent_run(tmp_path, None, ["r1"])  # rollout = the agent's trace id
    gateway_trace(tmp_path, "b", "r1", "gw")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    [row] = transitions(tmp_path)
    assert (stats.rollouts_seen, row["rollout_id"], row["token_source"]) == (1, "a" * 32, "gateway")


def test_a_call_with_no_matching_gateway_span_stays_retokenized_and_says_why(tmp_path: Path) -> None:
    agent_run(tmp_path, "run-1", ["r1", None])
    gateway_trace(tmp_path, "b", "r1", "gw")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    rows = sorted(transitions(tmp_path), key=lambda r: r["step"])
    assert [r["token_source"] for r in rows] == ["gateway", "retokenized"]
    [why] = stats.problems
    assert "has no exact token ids" in why and "records no gen_ai.response.id" in why


def test_a_gateway_span_whose_response_id_matches_no_call_stays_apart(tmp_path: Path) -> None:
    agent_run(tmp_path, "run-1", ["r1"])
    gateway_trace(tmp_path, "b", "elsewhere", "gw")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER)
    assert stats.rollouts_seen == 2  # the run, and the lone gateway trace
    [row] = [r for r in transitions(tmp_path) if r["rollout_id"] == "run-1"]
    assert row["token_source"] == "retokenized"


def test_an_openinference_call_joins_by_the_response_id_inside_output_value(tmp_path: Path) -> None:
    """LlamaIndex records the response id only in the outer ``achat`` span's ``output.value`` (``raw.id``)."""
    traces, _ = fixture_tables("llamaindex")
    put(tmp_path, "spans", traces, "agent")
    for i, rid in enumerate(["chatcmpl-llamaindex-1", "chatcmpl-llamaindex-2"]):
        gateway_trace(tmp_path, "bc"[i], rid, f"gw{i}")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER)
    assert stats.problems == [] and stats.rollouts_seen == 1
    con = connect_readonly(parse_store(tmp_path))
    got = con.sql("SELECT agent_name, token_source FROM transitions ORDER BY step").fetchall()
    con.close()
    assert got == [("weather", "gateway"), ("weather", "gateway")]
