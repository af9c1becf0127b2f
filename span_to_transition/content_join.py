"""The content join: a gateway span and an agent's call span are the same call when the request messages and
the response are equal, within the call's time window, and no other candidate is (pure).

Exact token ids come from the gateway. Its span joins the agent's call span by parent (``traceparent``) or by
``gen_ai.response.id`` (``tokens.match_gateways``); an agent whose client sends no ``traceparent`` and whose
spans record no response id (DSPy through LiteLLM, Strands, streamed smolagents and LlamaIndex) still records
the messages it sent and the text it got back, and the gateway records the request it forwarded and the
response it returned (``tracerl.request.messages``, ``tracerl.response.message``: the OpenAI JSON as it went
over the wire). Both sides are brought to one canonical form (``content_key``: roles, text, tool calls by name
and parsed arguments, tool-call ids of tool results) and compared.

Never a guess: only a match that is unique on both sides joins. A gateway span whose content matches two calls
(two concurrent rollouts asking the same question and getting the same answer), or a call matched by two
gateway spans, is a **tie**; a gateway span whose request equals a call's but whose response differs (or the
reverse) is a **near-miss**. Both stay ``retokenized`` and are counted (``ContentJoin``), and ``tracerl
doctor`` shows them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.attributes import REQUEST_MESSAGES, RESPONSE_MESSAGE
from span_to_transition.chat_messages import _openai_message
from span_to_transition.records import LLMCall, Span, load_json

WINDOW_SLACK_NS = 2_000_000_000
"""A gateway span joins a call span only when it lies within the call's [start, end], give or take this much
(the two are recorded by different processes, whose clocks may differ slightly)."""


def _text(content: Any) -> Any:
    """Content as one comparable value: text parts joined (a one-part list reads as its text), "" as None."""
    if isinstance(content, list):
        texts = [p.get("text", p.get("content")) for p in content if isinstance(p, dict)
                 and p.get("type", "text") in ("text", "input_text", "output_text")]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            content = "".join(texts)
        else:
            return json.dumps(content, sort_keys=True, ensure_ascii=False)
    return None if content == "" else content


def _arguments(arguments: Any) -> Any:
    value = load_json(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(value, sort_keys=True, ensure_ascii=False) if value not in (None, "") else None


def _canonical(m: dict[str, Any]) -> list[Any]:
    calls = [[(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
             for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    return [m.get("role"), _text(m.get("content")), calls, m.get("tool_call_id") or None]


def content_key(messages: Sequence[dict[str, Any]], response: dict[str, Any] | None) -> tuple[str, str] | None:
    """(request digest, response digest) of a call in canonical form; None when either side is missing."""
    if not messages or response is None:
        return None
    request = json.dumps([_canonical(m) for m in messages], ensure_ascii=False)
    answer = json.dumps(_canonical({**response, "role": "assistant"}), ensure_ascii=False)
    return (hashlib.sha256(request.encode()).hexdigest(), hashlib.sha256(answer.encode()).hexdigest())


def gateway_chat(span: Span) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """The request messages and the response a gateway span recorded, as canonical chat; None when it records
    neither (a gateway older than these attributes, or a completions call)."""
    sent, got = load_json(span.attributes.get(REQUEST_MESSAGES)), load_json(span.attributes.get(RESPONSE_MESSAGE))
    if not isinstance(sent, list) or not isinstance(got, dict):
        return None
    return [_openai_message(m) for m in sent if isinstance(m, dict)], _openai_message({**got, "role": "assistant"})


def gateway_key(span: Span) -> tuple[str, str] | None:
    """The content key of what a gateway span forwarded and returned, or None when it records neither."""
    chat = gateway_chat(span)
    return content_key(*chat) if chat is not None else None


@dataclass
class ContentJoin:
    """What a content join decided: pairs (call -> gateway span), and what it refused to guess."""

    pairs: dict[tuple[str, str], Span] = field(default_factory=dict)  # (trace id, span id) of the call -> gateway
    ties: list[str] = field(default_factory=list)  # gateway spans ("trace/span") matching several calls, or sharing one
    near_misses: list[str] = field(default_factory=list)  # gateway spans ("trace/span") equal on one side only


def _within(g: Span, c: LLMCall, slack_ns: int) -> bool:
    return c.start_time_ns - slack_ns <= g.start_time_ns and g.end_time_ns <= c.end_time_ns + slack_ns


def _silent(call: LLMCall) -> bool:
    r = call.response or {}
    return not r.get("tool_calls") and r.get("content") in (None, "", [])


def match_by_content(calls: Iterable[LLMCall], gateways: Iterable[Span], slack_ns: int = WINDOW_SLACK_NS, *,
                     silent_matches_request: bool = False) -> ContentJoin:
    """Pair gateway spans with calls whose content key equals theirs, within the call's time window; only pairs
    unique on both sides join (see the module docstring for ties and near-misses).

    ``silent_matches_request``: a call whose recorded response says nothing (no text, no tool calls) matches on
    its request alone. The rollout assignment uses it before the converter adds a tool-call turn's calls from
    child spans (AgentOps records them only there); the converter's own join then compares the whole call."""
    keyed = [(c, content_key(c.messages, c.response or {"content": None})) for c in calls if c.messages]
    loose = {id(c) for c, _ in keyed if silent_matches_request and _silent(c)}
    out = ContentJoin()
    matches: dict[str, list[LLMCall]] = {}  # gateway "trace/span" -> calls it matches
    gw_by_id: dict[str, Span] = {}
    for g in sorted(gateways, key=lambda s: (s.start_time_ns, s.span_id)):
        key = gateway_key(g)
        if key is None:
            continue
        found = [c for c, k in keyed if k[0] == key[0] and (k[1] == key[1] or id(c) in loose)
                 and _within(g, c, slack_ns)]
        near = [c for c, k in keyed if (k[0] == key[0]) != (k[1] == key[1]) and _within(g, c, slack_ns)]
        gid = f"{g.trace_id}/{g.span_id}"
        gw_by_id[gid] = g
        matches[gid] = found
        if not found and near:
            out.near_misses.append(gid)
    claims: dict[tuple[str, str], list[str]] = {}
    for gid, found in matches.items():
        for c in found:
            claims.setdefault((c.trace_id, c.span_id), []).append(gid)
    for gid, found in matches.items():
        key = (found[0].trace_id, found[0].span_id) if found else None
        if key is not None and len(found) == 1 and len(claims[key]) == 1:
            out.pairs[key] = gw_by_id[gid]
        elif found:
            out.ties.append(gid)
    return out
