"""OpenLLMetry's flattened messages: ``gen_ai.prompt.{i}.*`` / ``gen_ai.completion.{i}.*``.

Both usage spellings are read (``prompt_tokens`` / ``completion_tokens`` and ``input_tokens`` /
``output_tokens``). AgentOps 0.4.x and LiteLLM's OTel callback write the same keys; AgentOps stores a list
content as its JSON text (decoded back to parts), tools as ``gen_ai.request.functions.{i}.*`` and a
response's tool calls only as child ``tool_call.<name>`` spans (``tool_calls_from_spans``, which the
converter joins; hence ``keeps``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from span_to_transition.chat_messages import _common, message, tool_call
from span_to_transition.dialects.dialect import ANY, Dialect
from span_to_transition.flat_attributes import flat_tools, unflatten
from span_to_transition.records import LLMCall, LogEvent, Span, as_int, load_json
from span_to_transition.responses_api import text_of_parts

TOOL_CALL_SPAN = {"id": "tool.call.id", "name": "tool.name", "arguments": "tool.parameters"}
"""AgentOps (0.4.x ``instrumentation/providers/openai/wrappers/chat.py``) records a response's tool calls only
as child spans ``tool_call.<name>`` of the LLM span, with these attributes; read by ``tool_calls_from_spans``."""


def _content_parts(content: Any) -> Any:
    """Flattened dialects store a list content (text + image parts) as its JSON text (AgentOps:
    ``json.dumps(content)``): decoded back to the OpenAI parts list, so images are kept. A string that is
    not a JSON list of typed parts stays the text it is."""
    if isinstance(content, str) and content.startswith("[{"):
        parts = load_json(content)
        if isinstance(parts, list) and parts and all(isinstance(p, dict) and "type" in p for p in parts):
            return text_of_parts(parts)  # (the Responses API's input_text / output_text parts: plain text)
    return content


def openllmetry_message(m: dict[str, Any]) -> dict[str, Any]:
    """One unflattened ``gen_ai.prompt.{i}`` / ``gen_ai.completion.{i}`` entry as an OpenAI message."""
    calls = [tool_call(c.get("id"), c.get("name"), c.get("arguments")) for c in m.get("tool_calls") or []]
    fc = m.get("function_call")
    if isinstance(fc, dict) and not calls:
        calls.append(tool_call(fc.get("id"), fc.get("name"), fc.get("arguments")))
    return message(m.get("role") or "user", _content_parts(m.get("content")), tool_calls=calls or None,
                   tool_call_id=m.get("tool_call_id"), name=m.get("name"))


def parse_openllmetry(span: Span, events: Iterable[LogEvent] = ()) -> LLMCall:
    attrs = span.attributes
    messages = [openllmetry_message(m) for m in unflatten(attrs, "gen_ai.prompt.")]
    completions = unflatten(attrs, "gen_ai.completion.")
    response = openllmetry_message({"role": "assistant", **completions[0]}) if completions else None
    finish = completions[0].get("finish_reason") if completions else None
    call = _common(span, attrs, "openllmetry", messages, response, finish, flat_tools(attrs))
    if call.input_tokens is None:
        call.input_tokens = as_int(attrs.get("llm.usage.prompt_tokens"))
    if call.output_tokens is None:
        call.output_tokens = as_int(attrs.get("llm.usage.completion_tokens"))
    return call


def tool_calls_from_spans(spans: Iterable[Span]) -> list[dict[str, Any]]:
    """The OpenAI tool calls recorded as spans of their own (``TOOL_CALL_SPAN`` attributes), in start order."""
    key_id, key_name, key_args = TOOL_CALL_SPAN["id"], TOOL_CALL_SPAN["name"], TOOL_CALL_SPAN["arguments"]
    return [tool_call(s.attributes[key_id], s.attributes.get(key_name), s.attributes.get(key_args))
            for s in sorted(spans, key=lambda s: (s.start_time_ns, s.span_id)) if key_id in s.attributes]


DIALECT = Dialect(
    "openllmetry",
    parse_openllmetry,
    marks=dict.fromkeys(
        ("gen_ai.prompt.0.role", "gen_ai.prompt.0.content", "gen_ai.completion.0.role", "gen_ai.completion.0.content"),
        ANY,
    ),
    keeps=(TOOL_CALL_SPAN["id"],),
)
