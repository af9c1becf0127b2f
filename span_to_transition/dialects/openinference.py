"""OpenInference: ``llm.input_messages.{i}.message.*`` on spans with ``openinference.span.kind = LLM``.

A framework's internal roles (smolagents' ``tool-call`` / ``tool-response``) become the roles it sends
(``wire_roles.py``). An LLM span with no messages, no token counts and no response is not a model call:
LlamaIndex tags helpers such as ``OpenAILike._prepare_chat_with_tools`` and the outer record of a call it also
records inside (``achat`` over ``achat``) as LLM spans. Hidden content (``OPENINFERENCE_HIDE_*``) keeps the
token counts, so such a call is still reported as a call without content.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from span_to_transition.chat_messages import (
    _common,
    _join_text,
    _openai_message,
    chat_problem,
    message,
    tool_call,
)
from span_to_transition.dialects.dialect import Dialect
from span_to_transition.flat_attributes import unflatten
from span_to_transition.records import LLMCall, LogEvent, Span, as_int, load_json
from span_to_transition.responses_api import messages_from_items, response_from_output
from span_to_transition.wire_roles import openinference_response_id, to_wire_roles


def _openinference_message(m: dict[str, Any]) -> dict[str, Any]:
    msg = m.get("message", {})
    content: Any = msg.get("content")
    if content is None and msg.get("contents"):
        texts = [c.get("message_content", {}).get("text") for c in msg["contents"]]
        content = _join_text([t for t in texts if t is not None])
    calls = []
    for c in msg.get("tool_calls") or []:
        tc = c.get("tool_call", {})
        fn = tc.get("function", {})
        calls.append(tool_call(tc.get("id"), fn.get("name"), fn.get("arguments")))
    return message(msg.get("role") or "user", content, tool_calls=calls or None,
                   tool_call_id=msg.get("tool_call_id"), name=msg.get("name"))


def _recovered(messages: list[dict[str, Any]], response: dict[str, Any] | None, input_value: Any,
               output_value: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The request and response as the JSON ``input.value`` / ``output.value`` hold them (the OpenAI request
    body and response), when the flattened messages are not well-formed chat (an instrumentation that records
    message text only) and the JSON ones are. Only JSON (``*.mime_type = application/json``) is read: a Python
    repr (``text/plain``, e.g. Haystack's ``ChatMessage(...)``) is never parsed, so such a call stays malformed."""
    if chat_problem(messages, response) is None:
        return messages, response
    if isinstance(input_value, dict) and isinstance(input_value.get("messages"), list):
        sent = [_openai_message(m) for m in input_value["messages"] if isinstance(m, dict)]
        if len(sent) == len(messages) and chat_problem(sent, None) is None:
            messages = sent
    choices = output_value.get("choices") if isinstance(output_value, dict) else None
    if choices and isinstance(choices[0], dict) and isinstance(choices[0].get("message"), dict):
        got = _openai_message({"role": "assistant", **choices[0]["message"]})
        if chat_problem([], response) is not None and chat_problem([], got) is None:
            response = got
    return messages, response


def parse_openinference(span: Span) -> LLMCall:
    attrs = span.attributes
    messages = [_openinference_message(m) for m in unflatten(attrs, "llm.input_messages.")]
    outputs = [_openinference_message(m) for m in unflatten(attrs, "llm.output_messages.")]
    tools = [load_json(t.get("tool", {}).get("json_schema")) for t in unflatten(attrs, "llm.tools.")]
    output_value = load_json(attrs.get("output.value")) if attrs.get("output.mime_type") == "application/json" else None
    input_value = load_json(attrs.get("input.value")) if attrs.get("input.mime_type") == "application/json" else None
    finish = attrs.get("llm.finish_reason")
    response_id = None
    if isinstance(output_value, dict):
        response_id = output_value.get("id")
        choices = output_value.get("choices") or []
        if finish is None and choices and isinstance(choices[0], dict):
            finish = choices[0].get("finish_reason")
    messages, response = _recovered(messages, outputs[0] if outputs else None, input_value, output_value)
    if not messages and isinstance(input_value, dict) and "input" in input_value:  # a Responses API request
        messages = messages_from_items(input_value["input"], input_value.get("instructions"))
    if response is None and messages:
        response = response_from_output(output_value)
    call = _common(span, attrs, "openinference", to_wire_roles(messages), response, finish, tools)
    call.response_id = attrs.get("gen_ai.response.id") or response_id or openinference_response_id(output_value)
    call.response_model = attrs.get("llm.model_name")
    if isinstance(input_value, dict):
        call.request_model = input_value.get("model")
    call.input_tokens = as_int(attrs.get("llm.token_count.prompt"))
    call.output_tokens = as_int(attrs.get("llm.token_count.completion"))
    if call.finish_reason is None and call.response is not None and call.response.get("tool_calls"):
        call.finish_reason = "tool_calls"  # (smolagents records no finish reason; a tool-call turn ends so)
    return call


def _model_call(span: Span, events: Iterable[LogEvent]) -> LLMCall | None:
    """The call, unless the span has no messages, no usage and no response: a framework's helper span."""
    call = parse_openinference(span)
    if call.messages or call.response is not None or call.input_tokens is not None \
            or call.output_tokens is not None or call.response_id:
        return call
    return None


DIALECT = Dialect(
    "openinference",
    _model_call,
    marks={"openinference.span.kind": lambda kind: kind.upper() == "LLM"},
    # (kept as before the registry: a span with OpenInference messages keeps its attributes, span kind or not)
    keeps=("llm.input_messages.",),
)
