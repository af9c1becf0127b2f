"""Trace assembly: repair, completion, and delivery order never changes the output."""

from __future__ import annotations

import random
from dataclasses import replace

from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.tree import RolloutStatus, build_tree, decide_completion, dedupe, rollout_status

from .factory import TraceBuilder, user

S = 1_000_000_000


def two_agent_rollout() -> TraceBuilder:
    t = TraceBuilder()
    root = t.span("invoke_agent planner", agent="planner")
    t.chat(root, [user("plan")], "step 1", response_id="r1")
    tool = t.span("execute_tool search", root)
    t.chat(tool, [user("search")], "found", response_id="r2")
    t.chat(root, [user("answer")], "done", response_id="r3")
    t.reward(root, 1.0)
    return t


def rows(spans) -> list[tuple]:
    out = convert_rollout(RolloutInput("a" * 32, spans), ConvertConfig())
    return [(t.transition_id, t.step, t.span_id, t.agent_name, t.prompt_messages, t.response_message, t.reward)
            for t in out.transitions]


def test_out_of_order_and_duplicated_delivery_give_the_same_transitions() -> None:
    spans = two_agent_rollout().spans
    in_order = rows(spans)
    assert len(in_order) == 3
    rng = random.Random(7)
    for _ in range(5):
        shuffled = list(spans) + [replace(s, received_at_ns=s.received_at_ns + 5) for s in rng.sample(spans, 3)]
        rng.shuffle(shuffled)
        assert rows(shuffled) == in_order


def test_children_before_parents_still_link() -> None:
    spans = two_agent_rollout().spans
    tree = build_tree("r", reversed(spans))
    assert tree.orphans == [] and len(tree.roots) == 1
    assert [tree.spans[k].name for k in tree.children[tree.roots[0]]][:2] == ["chat policy@1", "execute_tool search"]


def test_dedupe_keeps_one_copy_per_span_and_counts_the_rest() -> None:
    spans = two_agent_rollout().spans
    unique, dropped = dedupe(spans + spans[:2])
    assert dropped == 2 and len(unique) == len(spans)


def test_missing_parent_is_repaired_and_reported_with_the_fix() -> None:
    t = TraceBuilder()
    root = t.span("invoke_agent writer", agent="writer")
    lost = t.span("step", root)
    t.chat(lost, [user("q")], "a")
    spans = [s for s in t.spans if s is not lost]
    tree = build_tree("r", spans)
    assert len(tree.orphans) == 1
    assert tree.problems == [
        f"span {t.spans[2].span_id} has parent {lost.span_id}, which is missing from trace {t.trace_id}; it was "
        "converted as a root of its own subtree (agent names above it are lost); raise --quiet-s if traces arrive late"
    ]
    out = convert_rollout(RolloutInput("r", [*spans, t.reward(None, 1.0)]), ConvertConfig())
    assert len(out.transitions) == 1 and out.transitions[0].agent_name is None and out.orphans == 1


def test_completion_waits_for_root_and_quiet_period() -> None:
    st = RolloutStatus("r", n_traces=1, n_traces_with_root=1, last_received_ns=100 * S)
    assert decide_completion(st, 120 * S, 30 * S, 600 * S).reason == "waiting_quiet"
    assert decide_completion(st, 130 * S, 30 * S, 600 * S).complete
    no_root = replace(st, n_traces_with_root=0)
    assert decide_completion(no_root, 500 * S, 30 * S, 600 * S).reason == "waiting_root"
    assert decide_completion(no_root, 700 * S, 30 * S, 600 * S).reason == "timeout_without_root"
    marked = replace(no_root, end_marker=True)
    assert decide_completion(marked, 100 * S, 30 * S, 600 * S).reason == "end_marker"


def test_a_rollout_over_two_traces_needs_both_roots() -> None:
    a, b = TraceBuilder("a" * 32, rollout_id="run-1"), TraceBuilder("b" * 32, rollout_id="run-1")
    a.span("invoke_agent x", agent="x")
    b_root = b.span("invoke_agent y", agent="y")
    b.chat(b_root, [user("q")], "a")
    spans = a.spans + [s for s in b.spans if s is not b_root]
    assert rollout_status("run-1", spans) == RolloutStatus("run-1", 2, 1, 1_000)
    assert rollout_status("run-1", a.spans + b.spans).n_traces_with_root == 2
