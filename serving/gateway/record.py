"""One proxied call as the gateway's span records it: the record (``CallRecord``), built from a whole response
(``record_from_response``) or folded from a stream chunk by chunk (``StreamAccumulator``), and the span attributes
written from it (``span_attributes``: the contract ``span_to_transition`` reads, serving/README.md).

Pure functions, no I/O, so what a span says about a call is tested without a server. Split from ``protocol.py``
(the wire format: what the gateway adds to a request and strips from the answer), which this module reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.attributes import (
    CONTENT_RECORDED,
    GATEWAY_FLAG,
    POLICY_VERSION,
    PROMPT_TOKEN_IDS,
    REQUEST_MESSAGES,
    RESPONSE_MESSAGE,
    UPSTREAM,
    choice_prefix,
    parse_policy_version,
)
from schemas.compact_json import compact_json
from serving.protocol import CHAT


@dataclass
class ChoiceRecord:
    """Exact tokens of one choice: ids and the engine's logprob of each sampled id."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # as returned (streamed deltas merged)


@dataclass
class CallRecord:
    """Everything the gateway span needs about one proxied call."""

    operation: str
    request_model: str | None
    response_model: str | None = None
    response_id: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    choices: list[ChoiceRecord] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    request_messages: list[Any] | None = None  # chat: the request's messages exactly as the client sent them


def _choice_logprobs(choice: Mapping[str, Any], operation: str) -> list[float]:
    lp = choice.get("logprobs")
    if not lp:
        return []
    if operation == CHAT:
        return [float(e["logprob"]) for e in lp.get("content") or []]
    return [float(x) for x in lp.get("token_logprobs") or [] if x is not None]


def _choice_text(choice: Mapping[str, Any], operation: str) -> str:
    if operation == CHAT:
        msg = choice.get("message") or choice.get("delta") or {}
        return msg.get("content") or ""
    return choice.get("text") or ""


def record_from_response(request: Mapping[str, Any], resp: Mapping[str, Any], operation: str) -> CallRecord:
    """Build the call record from a non-streaming upstream response (before stripping)."""
    rec = CallRecord(
        operation=operation,
        request_model=request.get("model"),
        response_model=resp.get("model"),
        response_id=resp.get("id"),
        prompt_token_ids=list(resp.get("prompt_token_ids") or []),
        request_messages=_messages(request, operation),
    )
    for i, ch in enumerate(resp.get("choices") or []):
        if ch.get("prompt_token_ids") and not rec.prompt_token_ids:  # completions: per choice
            rec.prompt_token_ids = list(ch["prompt_token_ids"])
        rec.choices.append(
            ChoiceRecord(
                index=int(ch.get("index", i)),
                token_ids=list(ch.get("token_ids") or []),
                logprobs=_choice_logprobs(ch, operation),
                text=_choice_text(ch, operation),
                finish_reason=ch.get("finish_reason"),
                tool_calls=list((ch.get("message") or {}).get("tool_calls") or [])
                if operation == CHAT
                else [],
            )
        )
    rec.choices.sort(key=lambda c: c.index)
    _set_usage(rec, resp.get("usage"))
    return rec


def _messages(request: Mapping[str, Any], operation: str) -> list[Any] | None:
    messages = request.get("messages") if operation == CHAT else None
    return messages if isinstance(messages, list) else None


def _merge_tool_call_deltas(calls: list[dict[str, Any]], deltas: Any) -> None:
    """Streamed tool calls arrive in pieces (``index``; ``id`` and name once; arguments in fragments): merged
    into the calls the client assembles."""
    for d in deltas if isinstance(deltas, list) else []:
        if not isinstance(d, dict):
            continue
        i = int(d.get("index", len(calls)))
        while len(calls) <= i:
            calls.append({"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        fn = d.get("function") or {}
        call = calls[i]
        call["id"] = call["id"] or d.get("id")
        call["function"]["name"] = call["function"]["name"] or fn.get("name")
        call["function"]["arguments"] += fn.get("arguments") or ""


def _set_usage(rec: CallRecord, usage: Any) -> None:
    if isinstance(usage, dict):
        rec.input_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens")


class StreamAccumulator:
    """Fold streamed chunks into one ``CallRecord`` (delta ids, logprobs and text per choice).

    ``add`` runs for every chunk of every relayed stream, so it does only what the chunk holds: the
    record's first id and model, each choice's ids, logprobs and text piece (joined once, in ``finish``,
    rather than copying the text so far per token), tool-call fragments and finish reason."""

    def __init__(self, request: Mapping[str, Any], operation: str) -> None:
        self.record = CallRecord(
            operation=operation,
            request_model=request.get("model"),
            request_messages=_messages(request, operation),
        )
        self._choices: dict[int, ChoiceRecord] = {}
        self._texts: dict[int, list[str]] = {}
        self._chat = operation == CHAT

    def add(self, chunk: Mapping[str, Any]) -> None:
        rec = self.record
        if not rec.response_id:
            rec.response_id = chunk.get("id")
        if not rec.response_model:
            rec.response_model = chunk.get("model")
        if not rec.prompt_token_ids and chunk.get("prompt_token_ids"):
            rec.prompt_token_ids = list(chunk["prompt_token_ids"])
        for ch in chunk.get("choices") or ():
            idx = int(ch.get("index", 0))
            c = self._choices.get(idx)
            if c is None:
                c = self._choices[idx] = ChoiceRecord(index=idx)
                self._texts[idx] = []
            # Completions put prompt_token_ids on the choice of the first chunk (chat: top level).
            if not rec.prompt_token_ids and ch.get("prompt_token_ids"):
                rec.prompt_token_ids = list(ch["prompt_token_ids"])
            ids = ch.get("token_ids")
            if ids:
                c.token_ids.extend(ids)
            if ch.get("logprobs"):
                c.logprobs.extend(_choice_logprobs(ch, rec.operation))
            if self._chat:
                _merge_tool_call_deltas(c.tool_calls, (ch.get("delta") or {}).get("tool_calls"))
            text = _choice_text(ch, rec.operation)
            if text:
                self._texts[c.index].append(text)
            if ch.get("finish_reason"):
                c.finish_reason = ch["finish_reason"]
        if chunk.get("usage"):
            _set_usage(rec, chunk["usage"])

    def finish(self) -> CallRecord:
        for i, c in self._choices.items():
            c.text = "".join(self._texts[i])
        self.record.choices = [self._choices[i] for i in sorted(self._choices)]
        return self.record


def span_attributes(
    rec: CallRecord, upstream: str, weight_version: str | None = None, record_content: bool = True
) -> dict[str, Any]:
    """The gateway span's attributes; names are the contract the converter reads.

    ``tracerl.policy_version`` comes from the served name (``policy@k``), else from the
    upstream's weight version (set by the publisher after a full-weight reload) when numeric.
    A chat call also records ``tracerl.request.messages`` (the request's messages as the client sent them) and
    ``tracerl.response.message`` (the first choice's assistant message as returned), JSON: the converter joins
    the span to the agent's call span by this content when no ``traceparent`` or response id does
    (``span_to_transition/content_join.py``). ``record_content=False`` (``--no-record-content``: the agent's own
    spans already hold the messages, and the user wants them stored once) leaves both out and says so
    (``tracerl.gateway.content_recorded=false``), so the doctor can tell why no content join applied.

    Token ids and logprobs are JSON text (``compact_json``), one string each, not int/float array attributes:
    the SDK checks an array attribute element by element on the serving thread, and its OTLP encoder builds one
    ``AnyValue`` per element on the exporter thread with the GIL held (0.9-1.6 µs each: 4.8 ms a span with
    1000-token prompts, measured with ``bench/gateway.py --prompt-tokens 1000``), where one string costs one copy.
    The store keeps a non-string attribute as exactly this text (``schemas/compact_json.py``), so the collector
    stores, and the converter reads, the same bytes either way.
    """
    attrs: dict[str, Any] = {
        GATEWAY_FLAG: True,
        "gen_ai.operation.name": rec.operation,
        UPSTREAM: upstream,
    }
    if rec.request_model:
        attrs["gen_ai.request.model"] = rec.request_model
    if rec.response_model:
        attrs["gen_ai.response.model"] = rec.response_model
    if rec.response_id:
        attrs["gen_ai.response.id"] = rec.response_id
    version = _call_version(rec, weight_version)
    if version is not None:
        attrs[POLICY_VERSION] = version
    reasons = [c.finish_reason for c in rec.choices if c.finish_reason]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    if rec.input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = int(rec.input_tokens)
    if rec.output_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = int(rec.output_tokens)
    attrs.update(_content_attributes(rec, record_content))
    attrs.update(_token_attributes(rec))
    return attrs


def _call_version(rec: CallRecord, weight_version: str | None) -> int | None:
    """The policy version that served the call: ``name@k`` as served, else as asked, else the upstream's
    numeric weight version (a full-weight reload keeps the name ``policy``); None when none says."""
    version = parse_policy_version(rec.response_model)
    if version is None:
        version = parse_policy_version(rec.request_model)
    if version is None and weight_version is not None and weight_version.isdigit():
        version = int(weight_version)
    return version


def _content_attributes(rec: CallRecord, record_content: bool) -> dict[str, Any]:
    """The chat content the converter's content join reads, or the flag that says it was left out."""
    if not record_content:
        return {CONTENT_RECORDED: False}
    if rec.request_messages is None or not rec.choices:
        return {}
    first = rec.choices[0]
    message = {
        "role": "assistant",
        "content": first.text or None,
        **({"tool_calls": first.tool_calls} if first.tool_calls else {}),
    }
    return {
        REQUEST_MESSAGES: json.dumps(rec.request_messages, ensure_ascii=False),
        RESPONSE_MESSAGE: json.dumps(message, ensure_ascii=False),
    }


def _token_attributes(rec: CallRecord) -> dict[str, Any]:
    """Prompt ids, and each choice's ids and logprobs, as compact JSON text (see ``span_attributes``)."""
    attrs: dict[str, Any] = {}
    if rec.prompt_token_ids:
        attrs[PROMPT_TOKEN_IDS] = compact_json([int(t) for t in rec.prompt_token_ids])
    for c in rec.choices:
        prefix = choice_prefix(c.index)
        if c.token_ids:
            attrs[prefix + "response_token_ids"] = compact_json([int(t) for t in c.token_ids])
        if c.logprobs:
            attrs[prefix + "response_logprobs"] = compact_json([float(x) for x in c.logprobs])
    return attrs
