"""``--rollout-key``: a chat service's requests (a trace each) that share a conversation id form one rollout,
its reward at its end; on a real Parquet store, through the same shell ``tracerl convert`` runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from span_to_transition.convert import ConvertConfig
from span_to_transition.identity import assign_rollouts
from span_to_transition.records import Span
from span_to_transition.store import convert_store
from store.location import parse_store

from .factory import TraceBuilder, spans_table, user
from .test_store import LATER, S, put, side_reward, transitions


def turn(
    n: int,
    session: str | None,
    received_s: int,
    *,
    question: str,
    reward: float | None = None,
    rollout_id: str | None = None,
    on_resource: bool = False,
) -> list[Span]:
    """One request of a chat service: a server span (the session id on it, or on the process's resource),
    one chat call carrying the conversation so far, and, where the user said so, a reward."""
    t = TraceBuilder(f"{n:032x}", rollout_id=rollout_id, received_at_ns=received_s * S)
    t.clock += n * 10 * S  # turns happen one after another
    attrs = {"http.route": "/chat"} | ({"session.id": session} if session and not on_resource else {})
    root = t.span("POST /chat", None, attrs)
    t.chat(root, [user(question)], f"answer {n}", response_id=f"resp-{n}")
    if reward is not None:
        t.reward(root, reward)
    resource = {"session.id": session} if session and on_resource else {}
    return [replace(s, resource_attributes=resource) for s in t.spans]


def by_rollout(store: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(transitions(store), key=lambda r: (r["rollout_id"], r["step"])):
        out.setdefault(r["rollout_id"], []).append(r)
    return out


def test_a_conversations_turns_form_one_rollout_rewarded_at_its_end(tmp_path: Path) -> None:
    store = tmp_path / "store"
    spans = (
        turn(1, "s1", 100, question="hi")
        + turn(2, "s1", 101, question="and then?", reward=1.0)
        + turn(3, "s2", 102, question="other", reward=0.0, on_resource=True)
        + turn(4, "s1", 103, question="mine", reward=0.5, rollout_id="explicit-4")
    )  # tracerl.rollout_id wins
    put(store, "spans", spans_table(spans), "a")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, rollout_key="session.id"), now_ns=LATER)
    assert (stats.rollouts_converted, stats.transitions_written) == (3, 4)
    rows = by_rollout(store)
    assert sorted(rows) == ["explicit-4", "session.id=s1", "session.id=s2"]
    s1 = rows["session.id=s1"]
    assert [(r["trace_id"], r["step"], r["is_last"]) for r in s1] == [
        (f"{1:032x}", 0, False),
        (f"{2:032x}", 1, True),
    ]
    assert [(r["reward"], r["rollout_reward"]) for r in s1] == [
        (1.0, 1.0),
        (1.0, 1.0),
    ]  # the end's reward, both calls
    assert len({r["task_id"] for r in s1}) == 1
    assert [r["rollout_reward"] for r in rows["session.id=s2"]] == [0.0]  # the key on the resource

    plain = tmp_path / "plain"
    put(plain, "spans", spans_table(spans), "a")
    convert_store(parse_store(plain), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert len(by_rollout(plain)) == 3  # without the key each trace is a rollout (the first has no reward)


def test_a_later_turn_joins_its_conversation_and_feedback_keyed_by_its_trace_rewards_it(
    tmp_path: Path,
) -> None:
    """The first turn arrives and is not yet complete (--quiet-s); the second comes in a later pass, without
    a reward of its own; the user's feedback is posted for the second request's trace id."""
    store = tmp_path / "store"
    config = ConvertConfig(quiet_s=60, rollout_key="gen_ai.conversation.id")
    first = [
        replace(s, attributes={**s.attributes, "gen_ai.conversation.id": "c-9"})
        if s.parent_span_id is None
        else s
        for s in turn(1, None, 100, question="hi")
    ]
    put(store, "spans", spans_table(first), "a")
    early = convert_store(parse_store(store), config, now_ns=110 * S)
    assert (early.rollouts_pending, early.transitions_written) == (1, 0)
    second = [
        replace(s, attributes={**s.attributes, "gen_ai.conversation.id": "c-9"})
        if s.parent_span_id is None
        else s
        for s in turn(2, None, 150, question="more")
    ]
    put(store, "spans", spans_table(second), "b")
    put(store, "rewards", side_reward("fb-1", 0.75, trace_id=f"{2:032x}"), "fb")
    stats = convert_store(parse_store(store), config, now_ns=LATER)
    assert stats.rollouts_converted == 1
    [(rid, rows)] = by_rollout(store).items()
    assert rid == "gen_ai.conversation.id=c-9" and [r["step"] for r in rows] == [0, 1]
    assert {(r["rollout_reward"], r["reward_source"]) for r in rows} == {(0.75, "side_channel")}


def test_key_rollouts_leave_named_and_known_traces_alone() -> None:
    spans = spans_table(
        turn(1, "s", 1, question="a")
        + turn(2, "s", 1, question="b", rollout_id="run-2")
        + turn(3, "s", 1, question="c")
        + turn(4, "", 1, question="d")
    )
    known = {f"{3:032x}": "earlier"}
    table, pairs = assign_rollouts(spans, known, rollout_key="session.id")
    got = dict(zip(table.column("trace_id").to_pylist(), table.column("rollout_id").to_pylist()))
    assert got == {
        f"{1:032x}": "session.id=s",
        f"{2:032x}": "run-2",
        f"{3:032x}": "earlier",
        f"{4:032x}": f"{4:032x}",
    }  # an empty value names no conversation
    assert pairs[f"{1:032x}"] == "session.id=s"
    unkeyed, _ = assign_rollouts(spans, {})
    assert pa.compute.count_distinct(unkeyed.column("rollout_id")).as_py() == 4
