"""GenAI dialect parsers: recognise an LLM call by its attributes and normalise it to OpenAI chat.

These dialects are read (DESIGN.md "GenAI dialects"), each recorded by a real instrumentation
package in ``tests/span_to_transition/fixtures``:

- ``semconv``: OTel GenAI ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (parts format),
  ``gen_ai.system_instructions``, ``gen_ai.tool.definitions`` (OpenLLMetry >= 0.55, contrib
  openai-v2 with ``gen_ai_latest_experimental``, the Vercel AI SDK's ``OpenTelemetry`` integration,
  LiteLLM's OTel callback). JSON strings and structured values read alike, because the store keeps
  structured values as JSON text. LiteLLM's hybrid is read too: OpenAI ``tool_calls`` / ``tool_call_id``
  beside the parts, the response's tool calls only as flattened ``gen_ai.completion.0.function_call.*``,
  tools as ``llm.request.functions.*``.
- ``semconv_events``: the messages as log events joined to the span by span id, either one event
  per message (``gen_ai.{system,user,assistant,tool}.message``, ``gen_ai.choice``) or one
  ``gen_ai.client.inference.operation.details`` event carrying the semconv attributes; or the same
  events recorded on the span itself (Strands Agents, ``span_events.py``).
- ``openllmetry``: flattened ``gen_ai.prompt.{i}.*`` / ``gen_ai.completion.{i}.*`` with both usage
  spellings (``prompt_tokens``/``completion_tokens`` and ``input_tokens``/``output_tokens``). AgentOps
  0.4.x and LiteLLM's OTel callback write the same keys; AgentOps stores a list content as its JSON
  text (decoded back to parts), tools as ``gen_ai.request.functions.{i}.*`` and a response's tool calls
  only as child ``tool_call.<name>`` spans (``tool_calls_from_spans``, joined by the converter).
- ``vercel_ai``: the Vercel AI SDK's ``ai.prompt.messages`` / ``ai.response.text`` /
  ``ai.response.toolCalls`` / ``ai.prompt.tools`` on its ``ai.*.doGenerate`` / ``doStream`` spans.
- ``token_ids``: a span with token ids (``tokens.TOKEN_KEYS``: Agent Lightning, LiteLLM's vLLM passthrough)
  and no messages: a call whose row carries the ids only.
- ``openinference``: ``llm.input_messages.{i}.message.*`` with ``openinference.span.kind = LLM``; a
  framework's internal roles (smolagents' ``tool-call`` / ``tool-response``) become the roles it sends
  (``wire_roles.py``).

Spans are classified by attributes, never by span name. Every parser returns the same shape
(``LLMCall``), so the same call recorded by any instrumentation yields the same transition.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from span_to_transition.chat_messages import (
    _common,
    _first_output,
    _join_text,
    _openai_message,
    _system_message,
    _text,
    _usage,
    message,
    messages_from_parts,
    tool_call,
)
from span_to_transition.records import LLMCall, LogEvent, Span, as_int, load_json
from span_to_transition.span_events import DETAILS_EVENT, MESSAGE_EVENTS, has_genai_events, span_event_logs
from span_to_transition.tokens import TOKEN_KEYS, response_id_of
from span_to_transition.wire_roles import openinference_response_id, to_wire_roles

CALL_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})

VERCEL_MESSAGES = "ai.prompt.messages"
"""The Vercel AI SDK's provider-level prompt on each ``ai.*.doGenerate`` / ``ai.*.doStream`` span (``@ai-sdk/otel``
``LegacyOpenTelemetry``, and the SDK's built-in telemetry before v7)."""

TOOL_CALL_SPAN = {"id": "tool.call.id", "name": "tool.name", "arguments": "tool.parameters"}
"""AgentOps (0.4.x ``instrumentation/providers/openai/wrappers/chat.py``) records a response's tool calls only
as child spans ``tool_call.<name>`` of the LLM span, with these attributes; read by ``tool_calls_from_spans``."""

FLAT_TOOL_PREFIXES = ("llm.request.functions.", "gen_ai.request.functions.")
"""Flattened tool definitions: OpenLLMetry <= 0.47 and LiteLLM spell them ``llm.*``, AgentOps 0.4.x ``gen_ai.*``."""
FLAT_TOOL_KEYS = frozenset(p + "0.name" for p in FLAT_TOOL_PREFIXES)
FLAT_RESPONSE_CALLS = ("gen_ai.completion.0.function_call.name", "gen_ai.completion.0.tool_calls.0.name")

# Keys whose presence makes a span worth reading (used by the store shell to filter vectorised).
CALL_KEYS = frozenset(
    {
        "gen_ai.input.messages", "gen_ai.output.messages", "openinference.span.kind",
        "gen_ai.prompt.0.role", "gen_ai.prompt.0.content", "gen_ai.completion.0.role",
        "gen_ai.completion.0.content", "gen_ai.operation.name", "llm.request.type", VERCEL_MESSAGES,
        TOOL_CALL_SPAN["id"],
    }
    | TOKEN_KEYS
)


def parse_semconv(span: Span, attrs: Mapping[str, str] | None = None, dialect: str = "semconv") -> LLMCall:
    attrs = span.attributes if attrs is None else attrs
    get = attrs.get
    messages = messages_from_parts(load_json(get("gen_ai.input.messages")))
    instructions = get("gen_ai.system_instructions")
    if instructions is not None:
        system = _system_message(load_json(instructions))
        if system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, system)
    raw_out = load_json(get("gen_ai.output.messages"))
    response, finish = _first_output(messages_from_parts(raw_out), raw_out)
    if FLAT_RESPONSE_CALLS[0] in attrs or FLAT_RESPONSE_CALLS[1] in attrs:
        response = _with_flat_tool_calls(attrs, response)
    tools = get("gen_ai.tool.definitions")
    tools = load_json(tools) if tools is not None else None if FLAT_TOOL_KEYS.isdisjoint(attrs) else _flat_tools(attrs)
    return _common(span, attrs, dialect, messages, response, finish, tools)


def _flat_tools(attrs: Mapping[str, str]) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    for prefix in FLAT_TOOL_PREFIXES:
        tools = tools or unflatten(attrs, prefix)
    return tools


def _with_flat_tool_calls(attrs: Mapping[str, str], response: dict[str, Any] | None) -> dict[str, Any] | None:
    """LiteLLM's OTel callback writes semconv output messages without the tool calls, which it keeps only
    as flattened ``gen_ai.completion.0.function_call.*`` (no id) or ``.tool_calls.{j}.*``."""
    if response is not None and response.get("tool_calls"):
        return response
    completions = unflatten(attrs, "gen_ai.completion.")
    flat = _openllmetry_message({"role": "assistant", **completions[0]}) if completions else {}
    if not flat.get("tool_calls"):
        return response
    content = response.get("content") if response else None
    return message("assistant", content, tool_calls=flat["tool_calls"])


# ---------------------------------------------------------------------------------------------
# flattened (OpenLLMetry <= 0.47 and OpenInference): "prefix.{i}.rest" -> [{rest: value}]

_INDEXED = re.compile(r"^(\d+)\.(.+)$")


def unflatten(attrs: Mapping[str, str], prefix: str) -> list[dict[str, Any]]:
    """``{prefix}{i}.a.{j}.b = v`` into ``[{"a": [{"b": v}]}]``, ordered by the integer indices."""
    root: dict[int, dict[str, Any]] = {}
    n = len(prefix)
    for key, value in attrs.items():
        if not key.startswith(prefix):
            continue
        m = _INDEXED.match(key[n:])
        if not m:
            continue
        node = root.setdefault(int(m.group(1)), {})
        parts = m.group(2).split(".")
        i = 0
        while i < len(parts) - 1:
            if i + 1 < len(parts) - 1 and parts[i + 1].isdigit():
                lst = node.setdefault(parts[i], {})
                node = lst.setdefault(int(parts[i + 1]), {})
                i += 2
            else:
                node = node.setdefault(parts[i], {})
                i += 1
        node[parts[-1]] = value

    def freeze(obj: Any) -> Any:
        if isinstance(obj, dict):
            if obj and all(isinstance(k, int) for k in obj):
                return [freeze(obj[k]) for k in sorted(obj)]
            return {k: freeze(v) for k, v in obj.items()}
        return obj

    return [freeze(root[i]) for i in sorted(root)]


def _content_parts(content: Any) -> Any:
    """Flattened dialects store a list content (text + image parts) as its JSON text (AgentOps:
    ``json.dumps(content)``): decoded back to the OpenAI parts list, so images are kept. A string that is
    not a JSON list of typed parts stays the text it is."""
    if isinstance(content, str) and content.startswith("[{"):
        parts = load_json(content)
        if isinstance(parts, list) and parts and all(isinstance(p, dict) and "type" in p for p in parts):
            return parts
    return content


def _openllmetry_message(m: dict[str, Any]) -> dict[str, Any]:
    calls = [tool_call(c.get("id"), c.get("name"), c.get("arguments")) for c in m.get("tool_calls") or []]
    fc = m.get("function_call")
    if isinstance(fc, dict) and not calls:
        calls.append(tool_call(fc.get("id"), fc.get("name"), fc.get("arguments")))
    return message(m.get("role") or "user", _content_parts(m.get("content")), tool_calls=calls or None,
                   tool_call_id=m.get("tool_call_id"), name=m.get("name"))


def parse_openllmetry(span: Span) -> LLMCall:
    attrs = span.attributes
    messages = [_openllmetry_message(m) for m in unflatten(attrs, "gen_ai.prompt.")]
    completions = unflatten(attrs, "gen_ai.completion.")
    response = _openllmetry_message({"role": "assistant", **completions[0]}) if completions else None
    finish = completions[0].get("finish_reason") if completions else None
    call = _common(span, attrs, "openllmetry", messages, response, finish, _flat_tools(attrs))
    if call.input_tokens is None:
        call.input_tokens = as_int(attrs.get("llm.usage.prompt_tokens"))
    if call.output_tokens is None:
        call.output_tokens = as_int(attrs.get("llm.usage.completion_tokens"))
    return call


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
    call = _common(span, attrs, "openinference", to_wire_roles(messages), outputs[0] if outputs else None, finish,
                   tools)
    call.response_id = attrs.get("gen_ai.response.id") or response_id or openinference_response_id(output_value)
    call.response_model = attrs.get("llm.model_name")
    if isinstance(input_value, dict):
        call.request_model = input_value.get("model")
    call.input_tokens = as_int(attrs.get("llm.token_count.prompt"))
    call.output_tokens = as_int(attrs.get("llm.token_count.completion"))
    if call.finish_reason is None and call.response is not None and call.response.get("tool_calls"):
        call.finish_reason = "tool_calls"  # (smolagents records no finish reason; a tool-call turn ends so)
    return call


# ---------------------------------------------------------------------------------------------
# semconv log events


def _event_name(e: LogEvent) -> str:
    return e.event_name or e.attributes.get("event.name", "")


def parse_events(span: Span, events: Iterable[LogEvent]) -> LLMCall | None:
    """Messages from the log events of one span (already joined by span id), in time order."""
    events = sorted(events, key=lambda e: e.time_ns)
    for e in events:
        if _event_name(e) == DETAILS_EVENT:
            return parse_semconv(span, {**span.attributes, **e.attributes}, dialect="semconv_events")
    messages: list[dict[str, Any]] = []
    response = None
    finish = None
    for e in events:
        name = _event_name(e)
        if name not in MESSAGE_EVENTS:
            continue
        body = load_json(e.body)
        body = body if isinstance(body, dict) else {"content": body}
        if name == "gen_ai.choice":
            if response is None and int(body.get("index") or 0) == 0:
                msg = body.get("message") or {}
                response = _openai_message({"role": "assistant", **msg})
                finish = body.get("finish_reason")
            continue
        role = name.split(".")[1]
        if role == "tool":
            messages.append(message("tool", _text(body.get("content")), tool_call_id=body.get("id")))
        else:
            messages.append(_openai_message({"role": role, **body}))
    if not messages and response is None:
        return None
    return _common(span, span.attributes, "semconv_events", messages, response, finish, None)


# ---------------------------------------------------------------------------------------------
# the Vercel AI SDK (``ai.*`` attributes; content parts of its LanguageModelV2 prompt)


def _vercel_part(p: dict[str, Any]) -> dict[str, Any] | None:
    """A user content part in OpenAI form (text, image as ``image_url``, file); None for parts the chat
    template does not see (reasoning)."""
    kind = p.get("type")
    if kind == "text":
        return {"type": "text", "text": p.get("text") or ""}
    if kind in ("image", "file"):
        data = p.get("image", p.get("data"))
        media = p.get("mediaType") or p.get("mimeType") or ("image/*" if kind == "image" else "")
        url = data if isinstance(data, str) and (":" in data[:12]) else f"data:{media};base64,{data}"
        if kind == "image" or media.startswith("image/"):
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "file", "file": {"file_data": url}}
    return None


def _vercel_output(output: Any) -> str | None:
    """A tool result: ``{"type": "text" | "json" | "error-text" | ..., "value"}`` (v5+) or the raw result (v4)."""
    if isinstance(output, dict) and "type" in output and "value" in output:
        output = output["value"]
    return _text(output)


def vercel_messages(items: Any) -> list[dict[str, Any]]:
    """``ai.prompt.messages`` (the SDK's provider-level prompt) to OpenAI messages."""
    out: list[dict[str, Any]] = []
    for m in items if isinstance(items, list) else ():
        if not isinstance(m, dict):
            continue
        role, content = m.get("role") or "user", m.get("content")
        if not isinstance(content, list):
            out.append(message(role, content))
            continue
        if role == "tool":
            out.extend(message("tool", _vercel_output(p.get("output", p.get("result"))), tool_call_id=p.get("toolCallId"))
                       for p in content if isinstance(p, dict) and p.get("type") == "tool-result")
            continue
        calls = [tool_call(p.get("toolCallId"), p.get("toolName"), p.get("input", p.get("args")))
                 for p in content if isinstance(p, dict) and p.get("type") == "tool-call"]
        parts = [q for q in (_vercel_part(p) for p in content if isinstance(p, dict)) if q is not None]
        if all(q["type"] == "text" for q in parts):
            body: Any = _join_text([q["text"] for q in parts])
        else:
            body = parts
        out.append(message(role, body, tool_calls=calls or None))
    return out


def parse_vercel(span: Span) -> LLMCall:
    attrs = span.attributes
    get = attrs.get
    messages = vercel_messages(load_json(get(VERCEL_MESSAGES)))
    raw_calls = load_json(get("ai.response.toolCalls"))
    calls = [tool_call(c.get("toolCallId"), c.get("toolName"), c.get("input", c.get("args")))
             for c in raw_calls if isinstance(c, dict)] if isinstance(raw_calls, list) else []
    text = get("ai.response.text")
    response = message("assistant", text, tool_calls=calls or None) if text is not None or calls else None
    tools = load_json(get("ai.prompt.tools"))
    if isinstance(tools, list):
        tools = [load_json(t) if isinstance(t, str) else t for t in tools]  # a string array of JSON tool specs
    call = _common(span, attrs, "vercel_ai", messages, response, get("ai.response.finishReason"), tools)
    call.request_model = call.request_model or get("ai.model.id")
    call.response_model = call.response_model or get("ai.response.model")
    call.response_id = call.response_id or get("ai.response.id")
    if call.input_tokens is None:
        call.input_tokens = _usage(attrs, "ai.usage.inputTokens", "ai.usage.promptTokens")
    if call.output_tokens is None:
        call.output_tokens = _usage(attrs, "ai.usage.outputTokens", "ai.usage.completionTokens")
    return call


# ---------------------------------------------------------------------------------------------
# tool calls recorded outside the response (AgentOps: child spans of the LLM span)


def tool_calls_from_spans(spans: Iterable[Span]) -> list[dict[str, Any]]:
    """The OpenAI tool calls recorded as spans of their own (``TOOL_CALL_SPAN`` attributes), in start order."""
    key_id, key_name, key_args = TOOL_CALL_SPAN["id"], TOOL_CALL_SPAN["name"], TOOL_CALL_SPAN["arguments"]
    return [tool_call(s.attributes[key_id], s.attributes.get(key_name), s.attributes.get(key_args))
            for s in sorted(spans, key=lambda s: (s.start_time_ns, s.span_id)) if key_id in s.attributes]


# ---------------------------------------------------------------------------------------------


def classify(attrs: Mapping[str, str]) -> str | None:
    """Which dialect recorded this span as an LLM call, from attributes alone; None if not a call."""
    if "gen_ai.input.messages" in attrs or "gen_ai.output.messages" in attrs:
        return "semconv"
    if attrs.get("openinference.span.kind", "").upper() == "LLM":
        return "openinference"
    if any(k in attrs for k in ("gen_ai.prompt.0.role", "gen_ai.prompt.0.content", "gen_ai.completion.0.role",
                                "gen_ai.completion.0.content")):
        return "openllmetry"
    if VERCEL_MESSAGES in attrs:
        return "vercel_ai"
    if attrs.get("gen_ai.operation.name") in CALL_OPERATIONS or attrs.get("llm.request.type") in ("chat", "completion"):
        return "attributes_only"
    if not TOKEN_KEYS.isdisjoint(attrs):  # Agent Lightning / LiteLLM: token ids on a span without messages
        return "token_ids"
    return None


def parse_call(span: Span, events: Iterable[LogEvent] = ()) -> LLMCall | None:
    """The LLM call recorded by ``span`` (plus its joined log events), or None if it is not one.

    An OpenInference LLM span with no messages, no token counts and no response is not a model call: LlamaIndex
    tags helpers such as ``OpenAILike._prepare_chat_with_tools`` and the outer record of a call it also records
    inside (``achat`` over ``achat``) as LLM spans. Hidden content (``OPENINFERENCE_HIDE_*``) keeps the token
    counts, so such a call is still reported as a call without content.

    A call span whose content was not captured returns an ``LLMCall`` with no messages and no
    response: the caller reports it (content capture is off) instead of inventing a prompt.
    """
    kind = classify(span.attributes)
    if kind is None:
        return None
    if kind == "semconv":
        return parse_semconv(span)
    if kind == "openinference":
        call = parse_openinference(span)
        if call.messages or call.response is not None or call.input_tokens is not None \
                or call.output_tokens is not None or call.response_id:
            return call
        return None  # no messages, no usage, no response: a framework's helper span, not a model call (below)
    if kind == "openllmetry":
        return parse_openllmetry(span)
    if kind == "vercel_ai":
        return parse_vercel(span)
    from_events = parse_events(span, events) if events else None
    if from_events is None and span.events and has_genai_events(span):  # Strands: the events are on the span
        from_events = parse_events(span, span_event_logs(span))
    if from_events is not None:
        return from_events
    call = _common(span, span.attributes, kind, [], None, None, None)
    call.response_id = call.response_id or response_id_of(span.attributes)
    return call
