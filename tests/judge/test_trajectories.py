"""A rollout's trajectory as the judge reads it: every call, each message once, in order."""

from __future__ import annotations

import json

from judge.trajectories import Call, render_message, rollouts_from_rows, shared_prefix, trajectory_lines

from .helpers import DRAFTS, rows_of, sql_rollout


def test_a_chat_agent_that_resends_its_history_shows_each_turn_once() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a city"}}]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Madrid"}'}}
    first = [{"role": "user", "content": "Population of Madrid?"}]
    reply1 = {"role": "assistant", "content": None, "tool_calls": [call]}
    second = [
        *first,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3.3 million"},
    ]
    reply2 = {"role": "assistant", "content": "About 3.3 million."}
    lines = trajectory_lines([Call(0, first, reply1, "a", tools), Call(1, second, reply2, "a", tools)])
    assert lines == [
        "[tools offered]\n- lookup: find a city",
        "[user] Population of Madrid?",
        '[assistant calls tool c1] lookup({"q": "Madrid"})',
        "[tool result c1] 3.3 million",
        "[assistant] About 3.3 million.",
    ]


def test_a_call_with_a_fresh_prompt_is_shown_whole_after_a_marker() -> None:
    """The demo's rewriter sees none of the writer's turn: the last call's prompt alone would lose it."""
    lines = trajectory_lines(sql_rollout(1).calls)
    assert lines.count("[system] You write SQLite queries. Reply with one SQL query and nothing else.") == 2
    assert "[a new LLM call by agent rewriter; its whole prompt follows]" in lines
    assert lines[4] == f"[assistant] {DRAFTS[1]}"  # the writer's answer is kept
    assert lines[-1] == f"[assistant] {DRAFTS[1]}"


def test_rows_become_rollouts_in_step_order_and_a_missing_task_is_its_own_group() -> None:
    ro = sql_rollout(2)
    rows = list(reversed(rows_of(ro)))
    rows.append(
        {
            "rollout_id": "lone",
            "task_id": None,
            "step": 0,
            "prompt_messages": "[]",
            "response_message": "null",
            "tools": None,
            "agent_name": None,
            "ended_at": 5,
        }
    )
    got = rollouts_from_rows(rows)
    assert [r.rollout_id for r in got] == ["lone", ro.rollout_id]
    assert [c.step for c in got[1].calls] == [0, 1] and got[1].calls == ro.calls
    assert got[0].task_id == "lone" and got[0].calls[0].response is None
    assert trajectory_lines(got[0].calls) == ["[assistant] (no reply recorded)"]


def test_shared_prefix_is_the_common_head_and_every_trajectory_keeps_its_answer() -> None:
    group = [trajectory_lines(sql_rollout(i).calls) for i in range(8)]
    k = shared_prefix(group)
    assert k == 4  # system, the two few-shot turns, the question
    assert shared_prefix([group[0], group[0]]) == len(group[0]) - 1
    assert shared_prefix([group[0]]) == 0


def test_long_messages_are_cut_with_the_cut_counted() -> None:
    text = render_message({"role": "tool", "tool_call_id": "x", "content": "a" * 10000})
    assert len(text) < 6200 and "characters cut" in text
    parts = render_message(
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url"}]}
    )
    assert parts == "[user] hi <image_url>"
    assert json.loads(json.dumps(parts))  # plain text, nothing unserialisable
