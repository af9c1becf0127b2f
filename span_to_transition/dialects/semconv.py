"""The OTel GenAI semantic conventions: ``gen_ai.input.messages`` / ``gen_ai.output.messages`` on the span.

Parts format, with ``gen_ai.system_instructions`` and ``gen_ai.tool.definitions`` (OpenLLMetry >= 0.55, contrib
openai-v2 with ``gen_ai_latest_experimental``, the Vercel AI SDK's ``OpenTelemetry`` integration, LiteLLM's OTel
callback). JSON strings and structured values read alike, because the store keeps structured values as JSON
text. LiteLLM's hybrid is read too: OpenAI ``tool_calls`` / ``tool_call_id`` beside the parts, the response's
tool calls only as flattened ``gen_ai.completion.0.function_call.*``, tools as ``llm.request.functions.*``.
The same attributes on a log event are ``semconv_events.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from span_to_transition.chat_messages import (
    _common,
    _first_output,
    _system_message,
    message,
    messages_from_parts,
)
from span_to_transition.dialects.dialect import ANY, Dialect
from span_to_transition.dialects.openllmetry import openllmetry_message
from span_to_transition.flat_attributes import FLAT_TOOL_KEYS, flat_tools, unflatten
from span_to_transition.records import LLMCall, LogEvent, Span, load_json
from span_to_transition.responses_api import is_items, messages_from_items, response_from_output

FLAT_RESPONSE_CALLS = ("gen_ai.completion.0.function_call.name", "gen_ai.completion.0.tool_calls.0.name")


def parse_semconv(span: Span, attrs: Mapping[str, str] | None = None, dialect: str = "semconv") -> LLMCall:
    attrs = span.attributes if attrs is None else attrs
    get = attrs.get
    raw_in = load_json(get("gen_ai.input.messages"))
    messages = messages_from_items(raw_in) if is_items(raw_in) else messages_from_parts(raw_in)
    instructions = get("gen_ai.system_instructions")
    if instructions is not None:
        system = _system_message(load_json(instructions))
        if system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, system)
    raw_out = load_json(get("gen_ai.output.messages"))
    if is_items(raw_out):  # the Responses API's output items (responses_api.py)
        response, finish = response_from_output({"output": raw_out}), None
    else:
        response, finish = _first_output(messages_from_parts(raw_out), raw_out)
    if FLAT_RESPONSE_CALLS[0] in attrs or FLAT_RESPONSE_CALLS[1] in attrs:
        response = _with_flat_tool_calls(attrs, response)
    tools = get("gen_ai.tool.definitions")
    tools = load_json(tools) if tools is not None else None if FLAT_TOOL_KEYS.isdisjoint(attrs) else flat_tools(attrs)
    return _common(span, attrs, dialect, messages, response, finish, tools)


def _with_flat_tool_calls(attrs: Mapping[str, str], response: dict[str, Any] | None) -> dict[str, Any] | None:
    """LiteLLM's OTel callback writes semconv output messages without the tool calls, which it keeps only
    as flattened ``gen_ai.completion.0.function_call.*`` (no id) or ``.tool_calls.{j}.*``."""
    if response is not None and response.get("tool_calls"):
        return response
    completions = unflatten(attrs, "gen_ai.completion.")
    flat = openllmetry_message({"role": "assistant", **completions[0]}) if completions else {}
    if not flat.get("tool_calls"):
        return response
    content = response.get("content") if response else None
    return message("assistant", content, tool_calls=flat["tool_calls"])


def _parse(span: Span, events: Iterable[LogEvent]) -> LLMCall:
    return parse_semconv(span)


DIALECT = Dialect("semconv", _parse, marks={"gen_ai.input.messages": ANY, "gen_ai.output.messages": ANY})
