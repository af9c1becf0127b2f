"""OpenAI chat messages, the one shape every dialect parses into: the helpers all parsers build with.

Every dialect (``dialects/``, and the span-event reader through it) builds its messages, tool calls, finish
reasons and the ``LLMCall`` itself with these functions, so the same call recorded by any instrumentation
compares equal field for field. Also the semconv parts format (``messages_from_parts``), which the semconv
attributes, the details log event and Strands' span events share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from span_to_transition.records import LLMCall, Span, as_int, load_json

FINISH_REASONS = {
    "tool_call": "tool_calls",
    "tool_use": "tool_calls",
    "function_call": "tool_calls",
    "max_tokens": "length",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool-calls": "tool_calls",
    "content-filter": "content_filter",
}
"""Semconv / provider spellings mapped to the OpenAI ``finish_reason`` values the trainer sees."""

# ---------------------------------------------------------------------------------------------
# OpenAI message helpers: every dialect builds messages with these, so outputs compare equal.


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def tool_call(call_id: str | None, name: str | None, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call. Structured arguments (semconv) are re-serialised with ``json.dumps``
    defaults, which is how OpenAI-compatible servers print them; strings are kept verbatim."""
    if arguments is None:
        args = ""
    elif isinstance(arguments, str):
        args = arguments
    else:
        args = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def message(
    role: str,
    content: Any = None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    tool_call_id: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A canonical OpenAI chat message: ``role`` and ``content`` always, the rest only when set."""
    out: dict[str, Any] = {"role": role, "content": content if content != "" or role != "assistant" else None}
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id:
        out["tool_call_id"] = tool_call_id
    if name:
        out["name"] = name
    return out


def normalise_finish_reason(value: str | None) -> str | None:
    if value is None:
        return None
    return FINISH_REASONS.get(value, value)


def normalise_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions in OpenAI form ``{"type": "function", "function": {name, description, parameters}}``."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        spec: dict[str, Any] = {"name": fn.get("name")}
        if fn.get("description") is not None:
            spec["description"] = fn["description"]
        params = fn.get("parameters", fn.get("inputSchema"))  # (the Vercel AI SDK: inputSchema)
        if isinstance(params, str):
            params = load_json(params)
        if params is not None:
            spec["parameters"] = params
        out.append({"type": "function", "function": spec})
    return out or None


def _openai_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """An already OpenAI-shaped message dict (events, ``input.value``), canonicalised."""
    calls = [
        tool_call(
            c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")
        )
        for c in (m.get("tool_calls") or [])
        if isinstance(c, dict)
    ]
    return message(
        m.get("role") or "user",
        m.get("content"),
        tool_calls=calls or None,
        tool_call_id=m.get("tool_call_id"),
        name=m.get("name"),
    )


# ---------------------------------------------------------------------------------------------
# semconv parts


def _join_text(texts: list[str]) -> str | list[dict[str, str]] | None:
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def messages_from_parts(items: Any) -> list[dict[str, Any]]:
    """Semconv messages (``{"role", "parts": [...]}``) to OpenAI messages.

    A ``tool_call_response`` part becomes its own ``tool`` message (OpenAI has one per result);
    ``reasoning`` parts are not part of the chat-template prompt and are dropped.
    """
    out: list[dict[str, Any]] = []
    if not isinstance(items, list):
        return out
    for m in items:
        if not isinstance(m, dict):
            continue
        if "parts" not in m:
            out.append(_openai_message(m))
            continue
        role = m.get("role") or "user"
        ps = m["parts"]
        if (
            isinstance(ps, list)
            and len(ps) == 1
            and isinstance(ps[0], dict)
            and ps[0].get("type") == "text"
            and not m.get("name")
            and "tool_call_id" not in m
        ):  # the common case: ``message(role, text)``
            text = ps[0].get("content") or ""
            out.append({"role": role, "content": text if text or role != "assistant" else None})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for p in m.get("parts") or []:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text":
                texts.append(p.get("content") or "")
            elif kind == "tool_call":
                calls.append(tool_call(p.get("id"), p.get("name"), p.get("arguments")))
            elif kind == "tool_call_response":
                results.append(
                    message("tool", _text(p.get("response", p.get("result"))), tool_call_id=p.get("id"))
                )
        if m.get("tool_calls"):  # LiteLLM's hybrid: OpenAI ``tool_calls`` / ``tool_call_id`` beside the parts
            calls += _openai_message({"role": role, "tool_calls": m["tool_calls"]}).get("tool_calls", [])
        if results:
            out.extend(results)
        if texts or calls or not results:
            out.append(
                message(
                    role,
                    _join_text(texts),
                    tool_calls=calls or None,
                    name=m.get("name"),
                    tool_call_id=m.get("tool_call_id"),
                )
            )
    return out


def _system_message(instructions: Any) -> dict[str, Any] | None:
    if isinstance(instructions, str):
        return message("system", instructions)
    if isinstance(instructions, list):
        texts = [
            p.get("content") or "" for p in instructions if isinstance(p, dict) and p.get("type") == "text"
        ]
        if texts:
            return message("system", _join_text(texts))
    return None


def _first_output(outputs: list[dict[str, Any]], raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    finish = None
    if isinstance(raw, list) and raw and isinstance(raw[0], dict):
        finish = raw[0].get("finish_reason")
    return (outputs[0] if outputs else None), finish


def _finish_from_attr(attrs: Mapping[str, str]) -> str | None:
    reasons = load_json(attrs.get("gen_ai.response.finish_reasons"))
    if isinstance(reasons, list) and reasons:
        return reasons[0]
    return reasons if isinstance(reasons, str) else None


def _usage(attrs: Mapping[str, str], key: str, old_key: str) -> int | None:
    v = as_int(attrs.get(key))
    return as_int(attrs.get(old_key)) if v is None else v


def _common(
    span: Span,
    attrs: Mapping[str, str],
    dialect: str,
    messages: list[dict[str, Any]],
    response: dict[str, Any] | None,
    finish: str | None,
    tools: Any,
) -> LLMCall:
    get = attrs.get
    return LLMCall(
        span.span_id,
        span.trace_id,
        dialect,
        messages,
        response,
        normalise_tools(tools) if tools else None,
        normalise_finish_reason(finish or _finish_from_attr(attrs)),
        get("gen_ai.request.model"),
        get("gen_ai.response.model"),
        get("gen_ai.response.id"),
        _usage(attrs, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
        _usage(attrs, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
        span.start_time_ns,
        span.end_time_ns,
    )


# ---------------------------------------------------------------------------------------------
# well-formed chat (DESIGN.md "Training"): what a transition must be to be trained on

ASSISTANT_EMPTY = "an assistant message in prompt_messages has neither content nor tool_calls"
RESPONSE_EMPTY = "response_message has neither content nor tool_calls"
TOOL_NO_CONTENT = "a tool message in prompt_messages has no content"
TOOL_NO_ID = "a tool message in prompt_messages has no tool_call_id"
TOOL_UNKNOWN_ID = "a tool message's tool_call_id was issued by no earlier assistant tool call"
CALL_NO_NAME = "a tool call has no function name"
CHAT_PROBLEMS = (ASSISTANT_EMPTY, RESPONSE_EMPTY, TOOL_NO_CONTENT, TOOL_NO_ID, TOOL_UNKNOWN_ID, CALL_NO_NAME)
"""Each way a transition can be malformed chat, in words that name the field; ``tracerl doctor`` keys its fix on them."""


@dataclass(frozen=True)
class ChatProblem:
    """Why a call's messages are not well-formed chat: one of ``CHAT_PROBLEMS`` and where (``prompt_messages[2]``)."""

    problem: str
    where: str


def _says_something(content: Any) -> bool:
    if isinstance(content, str):
        return content != ""
    if isinstance(content, list):
        return len(content) > 0
    return content is not None


def _calls_problem(calls: Any, where: str) -> ChatProblem | None:
    for c in calls or []:
        if not isinstance(c, dict) or not (c.get("function") or {}).get("name"):
            return ChatProblem(CALL_NO_NAME, where)
    return None


def chat_problem(messages: list[dict[str, Any]], response: dict[str, Any] | None) -> ChatProblem | None:
    """The first way ``messages`` + ``response`` fail to be well-formed chat, or None when they are.

    Well-formed: every assistant message (prompt or response) has content or tool calls, each tool call a
    function name; every tool message has content and the ``tool_call_id`` of a tool call an earlier assistant
    message issued. A chat template renders anything else as a turn the model never saw (an empty assistant
    turn, a tool result that answers nothing), so it is never trained on. A row of token ids only
    (``messages == []``, ``response is None``) has no chat to check: its ids are the truth."""
    issued: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            calls = m.get("tool_calls")
            if not calls and not _says_something(m.get("content")):
                return ChatProblem(ASSISTANT_EMPTY, f"prompt_messages[{i}]")
            found = _calls_problem(calls, f"prompt_messages[{i}]") if calls else None
            if found:
                return found
            issued.update(c.get("id") for c in calls or [] if c.get("id"))
        elif role == "tool":
            problem = (
                TOOL_NO_CONTENT
                if m.get("content") is None
                else TOOL_NO_ID
                if not m.get("tool_call_id")
                else TOOL_UNKNOWN_ID
                if m["tool_call_id"] not in issued
                else None
            )
            if problem:
                return ChatProblem(problem, f"prompt_messages[{i}]")  # (where: formatted only for a problem)
    if response is not None:
        calls = response.get("tool_calls")
        if not calls and not _says_something(response.get("content")):
            return ChatProblem(RESPONSE_EMPTY, "response_message")
        return _calls_problem(calls, "response_message")
    return None
