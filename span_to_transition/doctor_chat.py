"""Findings about the shape of what was converted: transitions that are not well-formed chat (pure).

The converter marks a call whose messages a chat template cannot render faithfully (an assistant turn with
neither content nor tool calls, a tool result with no content or no ``tool_call_id`` an earlier call issued)
untrainable with its reason (``convert.malformed_reason``); ``survey`` groups those rows by reason, with a
sample span and its instrumentation scope. Here each group becomes a finding that names the dialect, the
attribute that should have held the data, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from span_to_transition.chat_messages import (
    ASSISTANT_EMPTY,
    CALL_NO_NAME,
    RESPONSE_EMPTY,
    TOOL_NO_CONTENT,
    TOOL_NO_ID,
    TOOL_UNKNOWN_ID,
)
from span_to_transition.content_join import ContentJoin
from span_to_transition.doctor_finding import Finding, plural
from span_to_transition.records import LLMCall, Span


@dataclass(frozen=True)
class Untrainable:
    """Transitions sharing one ``untrainable_reason``, with one sample call span and its scope."""

    reason: str  # "malformed chat (<dialect>): <problem>"
    count: int
    span_id: str | None = None
    scope: str | None = None


FIELDS: dict[str, dict[str, str]] = {
    "openinference": {
        "calls": "llm.input_messages.{i}.message.tool_calls.{j}.tool_call.{id,function.name,function.arguments}",
        "result": "llm.input_messages.{i}.message.content and message.tool_call_id",
        "response": "llm.output_messages.0.message.content / message.tool_calls",
    },
    "semconv": {
        "calls": "gen_ai.input.messages[i].parts[{type: tool_call, id, name, arguments}]",
        "result": "gen_ai.input.messages[i].parts[{type: tool_call_response, id, response}]",
        "response": "gen_ai.output.messages[0].parts",
    },
    "openllmetry": {
        "calls": "gen_ai.prompt.{i}.tool_calls.{j}.{id,name,arguments}",
        "result": "gen_ai.prompt.{i}.content and gen_ai.prompt.{i}.tool_call_id",
        "response": "gen_ai.completion.0.content / gen_ai.completion.0.tool_calls.{j}.*",
    },
    "vercel_ai": {
        "calls": "ai.prompt.messages[i].content[{type: tool-call, toolCallId, toolName, input}]",
        "result": "ai.prompt.messages[i].content[{type: tool-result, toolCallId, output}]",
        "response": "ai.response.text / ai.response.toolCalls",
    },
    "attributes_only": {
        "calls": "the gen_ai.assistant.message event's tool_calls[{id, function}]",
        "result": "the gen_ai.tool.message event's content and id",
        "response": "the gen_ai.choice event's message",
    },
}
"""Where each dialect records the parts a malformed call lacks (the attribute the fix is about)."""

_WHICH = {
    ASSISTANT_EMPTY: "calls",
    CALL_NO_NAME: "calls",
    TOOL_NO_CONTENT: "result",
    TOOL_NO_ID: "result",
    TOOL_UNKNOWN_ID: "calls",
    RESPONSE_EMPTY: "response",
}

CLIENT_FIX = (
    "instrument the LLM client library under the framework instead of (or beside) the framework's instrumentor: "
    "pip install opentelemetry-instrumentation-openai (OpenLLMetry) or openinference-instrumentation-openai, "
    "which record every message's tool calls and tool_call_id as the request sent them; a framework span that "
    "wraps the client's is then dropped as the same call recorded twice; or report the attribute keys of the "
    "sample span so the dialect can read where the framework keeps them"
)


def _dialect_and_problem(reason: str) -> tuple[str, str]:
    head, _, problem = reason.partition("): ")
    return head.removeprefix("malformed chat (") or "?", problem or reason


def chat_findings(groups: list[Untrainable]) -> list[Finding]:
    """One finding per reason: which dialect, which field, and the fix."""
    out = []
    for g in groups:
        dialect, problem = _dialect_and_problem(g.reason)
        field = FIELDS.get(dialect, {}).get(_WHICH.get(problem, "calls"), "the message attributes")
        sample = f" (e.g. span {g.span_id}" + (f", scope {g.scope})" if g.scope else ")") if g.span_id else ""
        out.append(
            Finding(
                f"malformed chat ({dialect}): {problem}",
                f"{plural(g.count, 'transition')}{sample} whose messages, as the {dialect} dialect recorded them, "
                f"lack {field}",
                "a chat template would render a turn the model never saw (an empty assistant turn, a tool result "
                "answering no call), so these calls are written with trainable=false and untrainable_reason, and "
                "never trained on; the rest of each rollout still trains",
                f"record {field}: {CLIENT_FIX}; the converter recovers the messages itself where the span holds "
                "the request as JSON (OpenInference input.value with input.mime_type application/json), never from "
                "a Python repr",
            )
        )
    return out


def content_join_findings(joins: ContentJoin | None) -> list[Finding]:
    """Gateway spans the content join refused to guess about: their calls stay retokenized."""
    if joins is None or not (joins.ties or joins.near_misses):
        return []
    samples = ", ".join([*joins.ties, *joins.near_misses][:3])
    return [
        Finding(
            "gateway spans not joined to a call by content (ties or near-misses)",
            f"{plural(len(joins.ties), 'gateway span')} in a trace of their own match several agent calls with the "
            "same request and response in their time window, or share one with another gateway span (a tie: e.g. "
            f"concurrent rollouts asking the same question); {plural(len(joins.near_misses), 'gateway span')} "
            "equal a call on the request or on the response only (a near-miss); joined by content: "
            f"{len(joins.pairs)}; e.g. {samples}",
            "a content join never guesses, so these calls stay retokenized (no exact token ids or sampling "
            "logprobs); a near-miss also means the agent's span records messages that differ from what went over "
            "the wire",
            "let the agent's client send traceparent to the gateway (instrument the OpenAI client with "
            "opentelemetry-instrumentation-openai, which also records gen_ai.response.id), or use an instrumentation "
            "that records the response id; for a near-miss, compare the sample gateway span's "
            "tracerl.request.messages / tracerl.response.message with its call span's messages",
        )
    ]


RESPONSES_MARKS = ('"output_text"', '"input_text"', '"function_call_output"', '"type": "function_call"',
                   '"type":"function_call"')
"""Text that only the OpenAI Responses API's items put in an attribute value."""


def responses_keys(span: Span) -> list[str]:
    """The attributes of a call span that hold Responses API items or ``output_text`` (empty: none)."""
    return sorted(k for k, v in span.attributes.items()
                  if "output_text" in k or (isinstance(v, str) and any(m in v for m in RESPONSES_MARKS)))


def responses_finding(span: Span, call: LLMCall | None, scope: str | None, count: int) -> Finding | None:
    """A call span in the Responses API shape that the converter read no prompt or no response from; None when it
    read both, or the span holds no Responses items."""
    if call is None or (call.messages and call.response is not None):
        return None
    keys = responses_keys(span)
    if not keys:
        return None
    lacks = "prompt" if not call.messages else "response"
    return Finding(
        f"LLM calls in the OpenAI Responses API shape the converter cannot read ({call.dialect}, scope "
        f"{scope or '(none)'})",
        f"{plural(count, 'LLM call span')} like {span.name!r} record Responses API items (input items, output items, "
        f"output_text) in {', '.join(keys[:6])}, and no {lacks} could be read from them",
        "these calls yield no transitions (a call without its prompt or its response is not converted)",
        "the converter reads Responses items in gen_ai.input.messages / gen_ai.output.messages, OpenInference's "
        "input.value / output.value (input.mime_type application/json: the request body and the Response, or the "
        "response.completed event when streamed) and OpenLLMetry's gen_ai.prompt.{i}.content parts; record the call "
        "in one of these (e.g. pip install opentelemetry-instrumentation-openai, which records responses.create as "
        "gen_ai.prompt.* / gen_ai.completion.*), or report these attribute keys so the shape can be read",
    )


def agent_findings(transitions: int, without_agent: int, agents: str | None) -> list[Finding]:
    """Calls without an agent name under ``--agents``: nothing selects them, so none is trained; the ways to name
    one. (Without ``--agents`` every call trains, named or not: no finding.)"""
    if not agents or not without_agent:
        return []
    return [
        Finding(
            "calls without an agent name",
            f"{without_agent} of {plural(transitions, 'transition')} have agent_name null: no span above those calls "
            "names an agent (gen_ai.agent.name, agent.name, invoke_agent, an OpenInference AGENT span, ...)",
            f"--agents {agents!r} can select none of these calls, so none of them is trained",
            "name the agent without code: run each agent process with OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=NAME, "
            "or convert with --agent-from span-name (the nearest chain span's name, e.g. DSPy's ReAct.forward -> "
            "ReAct); then tracerl convert --rebuild",
        )
    ]
