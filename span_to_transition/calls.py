"""The LLM calls of one rollout tree, one record per request, each with its gateway span. Pure.

``parse_calls`` reads every call span in its dialect (a framework's record wrapping its client library's
record of the same request dropped, records without content reported and left out); ``one_per_response_id``
keeps one record per ``gen_ai.response.id``; ``claim_gateways`` gives each call its gateway span (by parent,
response id, then content) and turns a gateway span no call claims into a call of its own when it recorded
the chat. ``convert.convert_rollout`` calls them in that order.
"""

from __future__ import annotations

from schemas.attributes import CONTENT_RECORDED, REQUEST_MESSAGES
from span_to_transition.chat_messages import chat_problem, message
from span_to_transition.content_join import gateway_chat, match_by_content
from span_to_transition.dialects.openllmetry import tool_calls_from_spans
from span_to_transition.dialects.registry import classify, parse_call
from span_to_transition.dialects.semconv import parse_semconv
from span_to_transition.records import LLMCall, LogEvent, RolloutInput, RolloutOutput, Span
from span_to_transition.tokens import is_gateway, match_gateways, tokens_from
from span_to_transition.tree import Key, SpanTree


def wrapping_calls(tree: SpanTree, call_keys: list[Key]) -> dict[Key, Key]:
    """Call spans with another call span below them, each with the nearest such call below it: one request
    recorded twice, by a framework (OpenInference's Agents SDK ``generation`` span, a LangChain LLM span,
    LlamaIndex's ``achat`` over ``achat``) and by the client library under it. The inner record is the
    request as sent, and the gateway's span hangs below it; the outer one usually has no
    ``gen_ai.response.id`` to dedupe on, so nesting decides."""
    keys = set(call_keys)
    outer: dict[Key, Key] = {}
    for key in call_keys:
        for k in tree.path_up(key):
            # (a span on a corrupt parent cycle is not its own outer record)
            if k in keys and k != key and (k not in outer or tree.depth(key) < tree.depth(outer[k])):
                outer[k] = key
    return outer


def add_child_tool_calls(tree: SpanTree, span: Span, call: LLMCall) -> None:
    """A response whose tool calls were recorded as child spans (AgentOps ``tool_call.<name>``) gets them,
    so a tool-call turn never becomes a row with an empty response and no ``tool_calls``."""
    calls = tool_calls_from_spans(tree.spans[k] for k in tree.children[span.key])
    if calls:
        content = call.response.get("content") if call.response else None
        call.response = message("assistant", content, tool_calls=calls)
        call.finish_reason = call.finish_reason or "tool_calls"


def _without_content(span: Span, call: LLMCall, out: RolloutOutput) -> bool:
    """A call record with no messages or no response, and no token ids either: nothing to train on. Reported
    (content capture is off, or the call failed) and counted; the caller leaves it out."""
    if (call.messages and call.response is not None) or tokens_from(span, "span", []) is not None:
        return False
    out.calls_without_content += 1
    what = "messages" if not call.messages else "a response (did the call fail?)"
    out.problems.append(
        f"LLM call span {span.span_id} ({call.dialect}) in trace {span.trace_id} has no {what}; not "
        "converted. Turn on content capture (OpenLLMetry: TRACELOOP_TRACE_CONTENT=true; contrib: "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY with "
        "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental)"
    )
    return True


def unjoined_reason(call: LLMCall) -> str:
    """Why a call of a rollout that has gateway spans got no exact token ids (it stays ``retokenized``)."""
    where = f"LLM call span {call.span_id} ({call.dialect}) in trace {call.trace_id} has no exact token ids: "
    if call.response_id:
        return (
            where
            + f"no gateway span is below it and none records its gen_ai.response.id {call.response_id!r}; "
            "was this call sent through the gateway (OPENAI_BASE_URL)?"
        )
    return (
        where + "no gateway span is below it (its client sent no traceparent), it records no "
        "gen_ai.response.id to join by, and no gateway span of its rollout recorded the same request and "
        "response in its time window alone (a tie, a near-miss, or a gateway too old to record "
        "tracerl.request.messages); propagate traceparent (e.g. opentelemetry-instrumentation-openai, "
        "which records the response id too) or use an instrumentation that records the response id"
    )


def _join_by_content(
    calls: list[LLMCall], claimed: dict[str, Span], unclaimed: list[Span], out: RolloutOutput
) -> list[Span]:
    """Gateway spans left by the parent and response-id joins, joined to the calls still without one by equal
    request and response (``content_join``); ties and near-misses are counted and named, never joined. Returns
    the gateway spans still unclaimed."""
    joined = match_by_content([c for c in calls if c.span_id not in claimed], unclaimed)
    claimed.update({span_id: g for (_, span_id), g in joined.pairs.items()})
    out.content_joined += len(joined.pairs)
    out.content_ties += len(joined.ties)
    out.content_near_misses += len(joined.near_misses)
    for what, ids in (
        ("matches several calls (or shares one with another gateway span) by content: a tie", joined.ties),
        ("equals a call on the request or on the response only: a near-miss", joined.near_misses),
    ):
        out.problems.extend(
            f"gateway span {g} in rollout {out.rollout_id} {what}; not joined, the call stays retokenized"
            for g in ids
        )
    taken = {g.span_id for g in joined.pairs.values()}
    refused = {*joined.ties, *joined.near_misses}
    return [g for g in unclaimed if g.span_id not in taken and f"{g.trace_id}/{g.span_id}" not in refused]


def _wire_when_malformed(call: LLMCall, gateway: Span) -> None:
    """A call whose recorded messages are not well-formed chat takes the request and response its gateway span
    recorded as they went over the wire (JSON, ``tracerl.request.messages``), when those are well-formed: the
    instrumentation lost what the gateway saw (Haystack's records message text only)."""
    if chat_problem(call.messages, call.response) is None:
        return
    wire = gateway_chat(gateway)
    if wire is not None and chat_problem(*wire) is None:
        call.messages, call.response = wire


def _call_quality(call: LLMCall, depth: int) -> tuple:
    return (
        bool(call.messages),
        call.response is not None,
        call.tools is not None,
        -depth,
        -call.start_time_ns,
        call.span_id,
    )


def parse_calls(tree: SpanTree, inp: RolloutInput, out: RolloutOutput) -> tuple[list[LLMCall], list[Span]]:
    """Every LLM call the rollout's spans record (a framework's wrapper of its client library's call
    dropped), and the gateway spans beside them."""
    logs_by_span: dict[str, list[LogEvent]] = {}
    for e in inp.logs:
        if e.span_id:
            logs_by_span.setdefault(e.span_id, []).append(e)
    parsed: list[tuple[Span, LLMCall]] = []
    gateways: list[Span] = []
    for key, span in tree.spans.items():
        if not span.attributes:  # a skeleton span: structure only
            continue
        if is_gateway(span):
            gateways.append(span)
            continue
        call = parse_call(span, logs_by_span.get(key[1], ()))
        if call is not None:
            parsed.append((span, call))

    wrapping = wrapping_calls(tree, [span.key for span, _ in parsed]) if len(parsed) > 1 else {}
    by_key = {span.key: call for span, call in parsed} if wrapping else {}
    calls: list[LLMCall] = []
    for span, call in parsed:
        if span.key in wrapping and (not call.response_id or (not call.messages and call.response is None)):
            out.duplicate_calls += 1  # a framework's record of the request its client library recorded below
            inner = by_key[wrapping[span.key]]
            if inner.response_id is None:  # (LlamaIndex: only the outer record keeps the response id)
                inner.response_id = call.response_id
            continue
        if tree.children[span.key] and (call.response is None or not call.response.get("tool_calls")):
            add_child_tool_calls(tree, span, call)  # (most call spans are leaves: no call at all)
        if not call.response_id and _without_content(span, call, out):
            continue  # (with a response id, the check waits: another record of the call may hold the content)
        calls.append(call)
    return calls, gateways


def one_per_response_id(
    calls: list[LLMCall], tree: SpanTree, out: RolloutOutput
) -> tuple[list[LLMCall], dict[str, list[Span]]]:
    """One call per gen_ai.response.id: two instrumentations (or a framework and a client library)
    recording the same request must not train on it twice. Keep the most complete record; the records
    left out ("twins") may still hold the call's token ids (LiteLLM: on its raw_gen_ai_request span)."""
    best: dict[str, LLMCall] = {}
    records: dict[str, list[LLMCall]] = {}
    unique: list[LLMCall] = []
    for c in calls:
        if not c.response_id:
            unique.append(c)
            continue
        records.setdefault(c.response_id, []).append(c)
        cur = best.get(c.response_id)
        if cur is None:
            best[c.response_id] = c
        else:
            out.duplicate_calls += 1
            if _call_quality(c, tree.depth((c.trace_id, c.span_id))) > _call_quality(
                cur, tree.depth((cur.trace_id, cur.span_id))
            ):
                best[c.response_id] = c
    unique.extend(
        c for c in best.values() if not _without_content(tree.spans[(c.trace_id, c.span_id)], c, out)
    )
    twins = {
        b.span_id: [tree.spans[(c.trace_id, c.span_id)] for c in records[rid] if c is not b]
        for rid, b in best.items()
        if len(records[rid]) > 1
    }
    return unique, twins


def claim_gateways(
    unique: list[LLMCall], gateways: list[Span], tree: SpanTree, out: RolloutOutput
) -> dict[str, Span]:
    """Each call's gateway span (by parent, response id, then content); a gateway span no call claims
    becomes a call of its own when it recorded the chat (semconv), else a reported problem. ``unique``
    gains those calls, and a call whose record is malformed takes what its gateway saw on the wire."""
    claimed: dict[str, Span] = {}
    unclaimed: list[Span] = []
    if gateways:
        parent_of = {k[1]: p[1] if p else None for k, p in tree.parent.items()}
        claimed, unclaimed = match_gateways(unique, gateways, parent_of)
        if unclaimed:
            unclaimed = _join_by_content(unique, claimed, unclaimed, out)
    for g in unclaimed:
        if classify(g.attributes) == "semconv":
            gcall = parse_semconv(g)
            if gcall.messages and gcall.response is not None:
                unique.append(gcall)
                claimed[g.span_id] = g
                continue
        content = (
            "no call of its rollout has its request and response"
            if REQUEST_MESSAGES in g.attributes
            else "records no content (the gateway runs with --no-record-content)"
            if g.attributes.get(CONTENT_RECORDED) == "false"
            else "records no gen_ai.input.messages/gen_ai.output.messages"
        )
        out.problems.append(
            f"gateway span {g.span_id} in trace {g.trace_id} matches no LLM call span (no parent call span, "
            f"no call with its gen_ai.response.id) and {content}; "
            "not converted. Instrument the agent's OpenAI client, or propagate traceparent to the gateway"
        )
    for call in unique:
        if call.span_id in claimed:
            _wire_when_malformed(call, claimed[call.span_id])
    return claimed
