"""Transitions -> the trajectory a judge reads: every call of a rollout, in order, as the agent saw it.

A rollout's transitions are its LLM calls (``step`` 0, 1, ...), each with the full prompt it was sent and
the reply it got. Only the last call's prompt is *not* a faithful trajectory in general:

- a chat agent that resends its history: call k's prompt starts with call k-1's prompt and reply, so the
  last prompt holds the whole conversation, and walking the calls adds only each new tail (no repeats);
- a multi-agent or multi-stage rollout (the demo's SQL writer, then a rewriter with a fresh prompt): the
  last prompt holds none of the writer's turn. Here a call whose prompt does not continue the previous
  one is marked as a new call and shown whole, so nothing the agent saw is lost.

The tools offered to a call are shown once, where they first appear. Pure functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_MESSAGE_CHARS = 6000
"""A longer message is cut (head and tail kept, the cut counted): a judge prompt must fit its context."""


@dataclass(frozen=True)
class Call:
    """One transition row, as much of it as the judge needs."""

    step: int
    prompt: list[dict[str, Any]]
    response: dict[str, Any] | None
    agent: str | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class Rollout:
    """A converted rollout: its task (the group), its calls, and when its last call ended (ns)."""

    rollout_id: str
    task_id: str
    calls: list[Call] = field(default_factory=list)
    ended_ns: int = 0


def _load(text: str | None, default: Any) -> Any:
    if text is None:
        return default
    try:
        value = json.loads(text)
    except ValueError:
        return default
    return default if value is None else value


def rollouts_from_rows(rows: Iterable[dict[str, Any]]) -> list[Rollout]:
    """Transition rows (rollout_id, task_id, step, prompt_messages, response_message, tools, agent_name,
    ended_at as ns) -> rollouts with their calls in step order. A rollout without a task id is its own task."""
    by_id: dict[str, Rollout] = {}
    for r in rows:
        rid = r["rollout_id"]
        ro = by_id.setdefault(rid, Rollout(rid, r.get("task_id") or rid))
        prompt = _load(r.get("prompt_messages"), [])
        response = _load(r.get("response_message"), None)
        ro.calls.append(
            Call(
                int(r.get("step") or 0),
                prompt if isinstance(prompt, list) else [],
                response if isinstance(response, dict) else None,
                r.get("agent_name"),
                _load(r.get("tools"), None),
            )
        )
        ro.ended_ns = max(ro.ended_ns, int(r.get("ended_at") or 0))
    for ro in by_id.values():
        ro.calls.sort(key=lambda c: c.step)
    return sorted(by_id.values(), key=lambda r: r.rollout_id)


def text_of(content: Any) -> str:
    """A message's content as text: a string as is, text parts joined, other parts named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, dict):
                out.append(p.get("text") if isinstance(p.get("text"), str) else f"<{p.get('type', 'part')}>")
            else:
                out.append(str(p))
        return "".join(out)
    return json.dumps(content, ensure_ascii=False)


def _cut(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} …[{len(text) - 2 * half} characters cut]… {text[-half:]}"


def render_message(m: dict[str, Any]) -> str:
    """One message as the lines a judge reads: ``[role] text``, tool calls and tool results labelled."""
    role = str(m.get("role") or "unknown")
    body = _cut(text_of(m.get("content")))
    if role == "tool":
        return f"[tool result {m.get('tool_call_id') or ''}] {body}".rstrip()
    lines = [f"[{role}] {body}"] if body or not m.get("tool_calls") else []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        lines.append(f"[{role} calls tool {tc.get('id') or ''}] {fn.get('name')}({_cut(args or '')})")
    return "\n".join(lines)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools a call offered, one line each (name: description)."""
    out = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        out.append(f"- {fn.get('name')}: {_cut(str(fn.get('description') or ''), 400)}")
    return "[tools offered]\n" + "\n".join(out)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two messages say the same thing (spellings of empty content and tool-call framing aside)."""
    return render_message(a) == render_message(b)


def _continues(history: list[dict[str, Any]], prompt: list[dict[str, Any]]) -> bool:
    return len(prompt) >= len(history) and all(_same(h, p) for h, p in zip(history, prompt))


def trajectory_lines(calls: list[Call]) -> list[str]:
    """The rollout as rendered messages, each once, in the order the agent saw them (module docstring)."""
    lines: list[str] = []
    history: list[dict[str, Any]] | None = None
    tools_shown: set[str] = set()
    for c in calls:
        if c.tools:
            key = json.dumps(c.tools, sort_keys=True)
            if key not in tools_shown:
                tools_shown.add(key)
                lines.append(render_tools(c.tools))
        if history is not None and _continues(history, c.prompt):
            new = c.prompt[len(history) :]
        else:
            if history is not None:
                lines.append(
                    f"[a new LLM call{f' by agent {c.agent}' if c.agent else ''}; its whole prompt follows]"
                )
            new = c.prompt
        lines.extend(render_message(m) for m in new)
        reply = c.response or {"role": "assistant", "content": "(no reply recorded)"}
        lines.append(render_message(reply))
        history = [*c.prompt, reply]
    return lines


def shared_prefix(trajectories: list[list[str]]) -> int:
    """How many leading lines every trajectory shares (0 for fewer than two): the part sent once."""
    if len(trajectories) < 2:
        return 0
    n = min(len(t) for t in trajectories)
    k = 0
    while k < n and all(t[k] == trajectories[0][k] for t in trajectories):
        k += 1
    return min(k, n - 1)  # each trajectory keeps at least its last line (its final answer)
