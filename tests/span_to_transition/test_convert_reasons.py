"""When a pass converts nothing, its stats say why: which wait a pending rollout is on, why a rollout
has no calls or is excluded, and they point to ``tracerl doctor``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from span_to_transition.convert import NO_CALLS_NONE, NO_CALLS_WITHOUT_CONTENT, NO_REWARD, ConvertConfig
from span_to_transition.records import Span
from span_to_transition.store import convert_store
from store.location import parse_store

from .factory import TraceBuilder, spans_table, user
from .test_store import put

S = 1_000_000_000


def headless(trace_id: str, received_at_ns: int) -> list[Span]:
    """A rollout whose root span never arrived: its agent span names a parent that is not there."""
    t = TraceBuilder(trace_id, received_at_ns=received_at_ns)
    agent = t.span("invoke_agent solver", agent="solver")
    agent = replace(agent, parent_span_id="00000000000000ff")
    t.spans[0] = agent
    t.chat(agent, [user("hi")], "hello", response_id=f"r-{trace_id[:4]}")
    t.reward(agent, 1.0)
    return t.spans


def rooted(trace_id: str, received_at_ns: int) -> list[Span]:
    t = TraceBuilder(trace_id, received_at_ns=received_at_ns)
    root = t.span("invoke_agent solver", agent="solver")
    t.chat(root, [user("hi")], "hello", response_id=f"r-{trace_id[:4]}")
    t.reward(root, 1.0)
    return t.spans


def test_pending_rollouts_name_the_wait_they_are_on_and_point_to_doctor(store: Path) -> None:
    put(store, "spans", spans_table(headless("a" * 32, 100 * S) + rooted("b" * 32, 100 * S)), "a")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=30, max_wait_s=600), now_ns=110 * S)
    assert stats.rollouts_pending == 2
    assert stats.pending_waits == {"waiting_root": 1, "waiting_quiet": 1}
    text = stats.summary()
    assert "1: waiting --max-wait-s" in text and "1: waiting --quiet-s" in text
    assert "tracerl doctor" in text


def test_a_rollout_converted_on_max_wait_names_max_wait_in_its_repair_problem(store: Path) -> None:
    put(store, "spans", spans_table(headless("a" * 32, 100 * S)), "a")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=30, max_wait_s=600), now_ns=701 * S)
    assert (stats.rollouts_converted, stats.orphan_spans) == (1, 1)
    [problem] = stats.problems
    assert "raise --max-wait-s" in problem and "--quiet-s" not in problem
    assert "tracerl doctor" not in stats.summary()


def test_an_orphan_under_an_arrived_root_still_names_quiet_s(store: Path) -> None:
    spans = rooted("c" * 32, 100 * S)
    t = TraceBuilder("c" * 32, received_at_ns=100 * S)
    t._n = 40
    lost = t.span("tool", None)
    spans.append(replace(lost, parent_span_id="00000000000000ee"))
    put(store, "spans", spans_table(spans), "a")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=30), now_ns=200 * S)
    assert stats.rollouts_converted == 1
    assert ["raise --quiet-s" in p for p in stats.problems] == [True]


def test_rollouts_without_calls_and_excluded_ones_carry_their_reason(store: Path) -> None:
    no_calls = TraceBuilder("d" * 32, received_at_ns=100 * S)
    no_calls.reward(no_calls.span("invoke_agent solver", agent="solver"), 1.0)
    no_content = TraceBuilder("e" * 32, received_at_ns=100 * S)
    root = no_content.span("invoke_agent solver", agent="solver")
    no_content.span("chat policy", root, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy"})
    no_content.reward(root, 1.0)
    unrewarded = TraceBuilder("f" * 32, received_at_ns=100 * S)
    unrewarded.chat(unrewarded.span("invoke_agent solver", agent="solver"), [user("hi")], "hello")
    put(store, "spans", spans_table(no_calls.spans + no_content.spans + unrewarded.spans), "a")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=200 * S)
    assert stats.without_calls_reasons == {NO_CALLS_NONE: 1, NO_CALLS_WITHOUT_CONTENT: 1}
    assert stats.excluded_reasons == {NO_REWARD: 1}
    text = stats.summary()
    assert NO_CALLS_WITHOUT_CONTENT in text and NO_REWARD in text and "tracerl doctor" in text
