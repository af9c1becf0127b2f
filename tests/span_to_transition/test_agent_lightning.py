"""Agent Lightning parity: the kinds of spans its v0.3.0 adapter tests build convert, with default settings,
to what its adapters produce (calls, order, agents, token ids, tool calls; per-call rewards under
``--credit matched``, Agent Lightning's reward matching).

The fixtures are our own, built from the same kinds of spans as microsoft/agent-lightning v0.3.0
``tests/adapter/test_triplet_trace_tree.py`` (token ids on ``openai.chat.completion`` spans with or
without messages, AgentOps ``agentops.task.output`` reward spans, ``agent.name`` agent spans, JSON-string
multimodal content), ``test_llm_proxy.py`` (LiteLLM ``raw_gen_ai_request`` spans with stringified
``llm.hosted_vllm.*`` token ids) and ``test_messages_adapter.py`` (AgentOps ``gen_ai.request.functions.*``
tool definitions and ``tool_call.<name>`` child spans). They are made with the real OpenTelemetry SDK and
go through the collector's OTLP decode and the store's column pruning, as exported spans would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context

from collector_exporter.otlp_arrow import trace_request_to_table
from span_to_transition.columnar import spans_from_table
from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.records import Transition

T0 = 1_700_000_000_000_000_000
SEC = 1_000_000_000


class Trace:
    """Spans of one trace with explicit times (seconds from T0), exported by the real SDK."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("agent-lightning-parity")

    @contextmanager
    def span(self, name: str, start: float, end: float, attrs: dict[str, Any] | None = None,
             parent: Any = None) -> Iterator[Any]:
        ctx = set_span_in_context(parent) if parent is not None else None
        s = self.tracer.start_span(name, context=ctx, start_time=T0 + int(start * SEC), attributes=attrs or {})
        yield s
        s.end(end_time=T0 + int(end * SEC))

    def leaf(self, name: str, start: float, end: float, attrs: dict[str, Any] | None = None, parent: Any = None) -> Any:
        with self.span(name, start, end, attrs, parent) as s:
            return s

    def convert(self, **config: Any) -> list[Transition]:
        request = encode_spans(self.exporter.get_finished_spans())
        spans = spans_from_table(trace_request_to_table(request, T0))
        out = convert_rollout(RolloutInput(spans[0].rollout_id, spans), ConvertConfig(**config))
        assert out.status == "converted", (out.status, out.problems)
        return out.transitions


def llm(prompt_ids: list[int], response_ids: list[int], response_id: str, **extra: Any) -> dict[str, Any]:
    """An Agent Lightning LLM span: token ids on the span (tuples: OTLP int arrays), no messages."""
    return {"prompt_token_ids": tuple(prompt_ids), "response_token_ids": tuple(response_ids),
            "gen_ai.response.id": response_id, **extra}


def agentops_reward(value: float) -> dict[str, Any]:
    """What Agent Lightning's ``@reward`` records through AgentOps' ``@operation``."""
    return {"agentops.task.output": json.dumps({"type": "reward", "value": value}),
            "agentops.span.kind": "task", "operation.name": "agentops_reward_operation"}


def rows(transitions: list[Transition]) -> list[tuple]:
    return [(t.agent_name, t.prompt_token_ids, t.response_token_ids, t.token_source) for t in transitions]


def test_token_ids_on_spans_without_messages_are_calls_deduped_by_response_id() -> None:
    t = Trace()
    with t.span("session", 0, 10) as root, t.span("agent.node", 1, 9, {"agent.name": "primary-agent"}, root) as agent:
        t.leaf("openai.chat.completion", 2, 3, llm([1, 2], [3, 4], "resp-1"), agent)
        t.leaf("openai.chat.completion", 3.2, 3.8, llm([9], [8], "resp-1"), agent)  # the same response again
        t.leaf("agent.reward", 6, 6.1, agentops_reward(0.5), agent)
    [row] = t.convert()
    assert rows([row]) == [("primary-agent", [1, 2], [3, 4], "span")]
    assert json.loads(row.prompt_messages) == [] and json.loads(row.response_message) is None
    assert (row.reward, row.rollout_reward, row.reward_source) == (0.5, 0.5, "span")


def test_multimodal_prompts_keep_their_image_parts_and_only_recorded_ids_are_used() -> None:
    content = [{"type": "text", "text": "Question: How many food items are shown in the bar graph?"},
               {"type": "image_url", "image_url": {"url": "file:///root/test.png"}}]

    def attrs(response_id: str, answer: str, **extra: Any) -> dict[str, Any]:
        return {"gen_ai.request.type": "chat", "gen_ai.system": "OpenAI", "gen_ai.request.model": "Qwen/Qwen2-VL",
                "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": json.dumps(content),
                "gen_ai.response.id": response_id, "gen_ai.response.model": "Qwen/Qwen2-VL",
                "gen_ai.usage.prompt_tokens": 10, "gen_ai.usage.completion_tokens": 2,
                "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": answer,
                "gen_ai.completion.0.finish_reason": "stop", **extra}

    t = Trace()
    with t.span("session", 0, 15) as root, t.span("agent.node", 0.5, 14.5, {"agent.name": "vision-agent"}, root) as a:
        t.leaf("openai.chat.completion", 1, 2, attrs("chatcmpl-qwen", "10 items.", prompt_token_ids=(151644, 8948),
                                                     response_token_ids=(785, 3619)), a)
        t.leaf("openai.chat.completion", 10, 11, attrs("chatcmpl-gpt", "13 items."), a)
        t.leaf("agent.reward", 12, 12.5, agentops_reward(0.7), a)
    first, second = t.convert()
    assert rows([first, second]) == [("vision-agent", [151644, 8948], [785, 3619], "span"),
                                     ("vision-agent", [], [], "retokenized")]
    assert json.loads(first.prompt_messages) == [{"role": "user", "content": content}]
    assert json.loads(first.response_message) == {"role": "assistant", "content": "10 items."}
    assert [first.reward, second.reward] == [0.7, 0.7]  # default credit: identical (LightningRL)
    # Agent Lightning's match: the reward goes to the latest call that ended before it.
    assert [r.reward for r in t.convert(credit="matched")] == [0.0, 0.7]


def test_one_response_id_under_two_agents_is_one_call_of_the_first() -> None:
    t = Trace()
    with t.span("session", 0, 10) as root:
        with t.span("agent.node", 0.5, 5, {"agent.name": "vision-a"}, root) as a:
            t.leaf("openai.chat.completion", 1, 2, llm([1], [2], "chatcmpl-shared"), a)
        with t.span("agent.node", 5.1, 9.5, {"agent.name": "vision-b"}, root) as b:
            t.leaf("openai.chat.completion", 6, 7, llm([1], [2], "chatcmpl-shared"), b)
        t.leaf("agent.reward", 9.6, 9.7, agentops_reward(1.0), root)
    assert rows(t.convert()) == [("vision-a", [1], [2], "span")]


def test_matched_reward_stays_with_its_agent_span_like_first_sibling() -> None:
    # Two spans of the same agent name: the reward under the first goes to its call, not to the
    # second's call that ended later but still before the reward.
    t = Trace()
    with t.span("session", 0, 10) as root:
        with t.span("agent.node", 1, 9, {"agent.name": "sibling-agent"}, root) as a1, \
                t.span("agent.node", 1, 9, {"agent.name": "sibling-agent"}, root) as a2:
            t.leaf("openai.chat.completion", 2, 3, llm([1], [2], "resp-1"), a1)
            t.leaf("openai.chat.completion", 3.1, 3.2, llm([3], [4], "resp-2"), a2)
            t.leaf("agent.reward", 3.5, 3.6, agentops_reward(0.8), a1)
    assert [(r.response_token_ids, r.reward) for r in t.convert(credit="matched")] == [([2], 0.8), ([4], 0.0)]


def raw_request(prompt_ids: list[int], response_ids: list[int], response_id: str) -> dict[str, Any]:
    """LiteLLM's ``raw_gen_ai_request`` span for a hosted vLLM model: ``llm.hosted_vllm.<field>`` = ``str(value)``
    (litellm 1.106 ``integrations/opentelemetry.py`` ``set_raw_request_attributes``)."""
    return {"llm.hosted_vllm.prompt_token_ids": str(prompt_ids),
            "llm.hosted_vllm.response_token_ids": str([response_ids]),
            "llm.hosted_vllm.choices": str([{"token_ids": response_ids}]),
            "llm.hosted_vllm.id": response_id, "llm.hosted_vllm.model": "my/own-model"}


def test_llm_proxy_spans_give_calls_and_rewards_backfill_like_first_occurrence() -> None:
    t = Trace()
    t.leaf("raw_gen_ai_request", 100, 110, raw_request([1, 1], [2, 2], "chatcmpl-A"))
    t.leaf("raw_gen_ai_request", 120, 130, raw_request([3, 3], [4, 4], "chatcmpl-B"))
    t.leaf("agentops_reward_operation.task", 135, 136, agentops_reward(0.1))
    t.leaf("raw_gen_ai_request", 140, 150, raw_request([5, 5], [6, 6], "chatcmpl-C"))
    t.leaf("raw_gen_ai_request", 152, 153, raw_request([5, 5], [6, 6], "chatcmpl-C"))  # a retried export
    t.leaf("agentops_reward_operation.task", 160, 161, agentops_reward(0.2))
    t.leaf("agentops_reward_operation.task", 170, 171, agentops_reward(0.3))
    transitions = t.convert(credit="matched")
    assert [(r.prompt_token_ids, r.response_token_ids) for r in transitions] == [
        ([1, 1], [2, 2]), ([3, 3], [4, 4]), ([5, 5], [6, 6])]
    assert [r.reward for r in transitions] == [0.3, 0.1, 0.2]
    assert transitions[0].rollout_reward == pytest.approx(0.6)


def test_litellm_request_span_with_messages_takes_the_ids_of_its_raw_request_span() -> None:
    t = Trace()
    with t.span("litellm_request", 1, 3, {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "2+2?",
                                          "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "4",
                                          "gen_ai.response.id": "chatcmpl-L", "llm.request.type": "chat"}) as req:
        t.leaf("raw_gen_ai_request", 1.1, 2.9, raw_request([7, 8], [9], "chatcmpl-L"), req)
    t.leaf("agentops_reward_operation.task", 4, 5, agentops_reward(1.0))
    [row] = t.convert()
    assert json.loads(row.prompt_messages) == [{"role": "user", "content": "2+2?"}]
    assert (row.prompt_token_ids, row.response_token_ids, row.token_source) == ([7, 8], [9], "span")


def test_a_litellm_request_without_ids_or_messages_is_no_call() -> None:
    t = Trace()
    t.leaf("litellm_request", 10, 20, {"gen_ai.response.id": "chatcmpl-XYZ"})
    t.leaf("agentops_reward_operation.task", 30, 31, agentops_reward(0.5))
    request = encode_spans(t.exporter.get_finished_spans())
    spans = spans_from_table(trace_request_to_table(request, T0))
    assert convert_rollout(RolloutInput(spans[0].rollout_id, spans), ConvertConfig()).status == "no_calls"


TOOL = "get_rooms_and_availability"
PARAMS = json.dumps({"date": "2025-10-13", "duration_min": 30, "time": "16:30"})
SCHEMA = {"type": "object", "properties": {"date": {"type": "string"}}, "required": ["date"]}


def test_agentops_tool_call_child_spans_and_function_definitions_reach_the_row() -> None:
    """AgentOps keeps a response's tool calls only as ``tool_call.<name>`` child spans: the tool-call turn
    must be a row with those tool calls (not an empty response), and its tools from ``gen_ai.request.functions``."""
    system, user = {"role": "system", "content": "You are a scheduling assistant."}, {"role": "user", "content": "Room?"}
    first_call = {"gen_ai.request.type": "chat", "gen_ai.request.model": "gpt-5-mini",
                  "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": system["content"],
                  "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": user["content"],
                  "gen_ai.request.functions.0.name": TOOL, "gen_ai.request.functions.0.description": "Rooms.",
                  "gen_ai.request.functions.0.parameters": json.dumps(SCHEMA),
                  "gen_ai.response.id": "chatcmpl-1", "gen_ai.completion.0.role": "assistant",
                  "gen_ai.completion.0.finish_reason": "tool_calls"}
    second_call = {"gen_ai.request.type": "chat",
                   "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": system["content"],
                   "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": user["content"],
                   "gen_ai.prompt.2.role": "assistant",
                   "gen_ai.prompt.2.tool_calls.0.id": "call_a", "gen_ai.prompt.2.tool_calls.0.name": TOOL,
                   "gen_ai.prompt.2.tool_calls.0.arguments": PARAMS,
                   "gen_ai.prompt.2.tool_calls.1.id": "call_b", "gen_ai.prompt.2.tool_calls.1.name": TOOL,
                   "gen_ai.prompt.2.tool_calls.1.arguments": PARAMS,
                   "gen_ai.prompt.3.role": "tool", "gen_ai.prompt.3.content": "{}", "gen_ai.prompt.3.tool_call_id": "call_a",
                   "gen_ai.prompt.4.role": "tool", "gen_ai.prompt.4.content": "{}", "gen_ai.prompt.4.tool_call_id": "call_b",
                   "gen_ai.response.id": "chatcmpl-2", "gen_ai.completion.0.role": "assistant",
                   "gen_ai.completion.0.content": "Nova.", "gen_ai.completion.0.finish_reason": "stop"}
    t = Trace()
    with t.span("agent", 0, 10, {"agentops.span.kind": "agent", "operation.name": "scheduler"}) as agent:
        with t.span("openai.chat.completion", 1, 2, first_call, agent) as llm1:
            for i, call_id in enumerate(("call_a", "call_b")):
                t.leaf(f"tool_call.{TOOL}", 1.5 + i / 10, 1.55 + i / 10,
                       {"agentops.span.kind": "tool", "tool.name": TOOL, "tool.parameters": PARAMS,
                        "tool.call.id": call_id, "tool.call.type": "function"}, llm1)
        t.leaf("openai.chat.completion", 3, 4, second_call, agent)
        t.leaf("agentops_reward_operation.task", 5, 6, agentops_reward(1.0), agent)
    first, second = t.convert()
    calls = [{"id": c, "type": "function", "function": {"name": TOOL, "arguments": PARAMS}} for c in ("call_a", "call_b")]
    assert json.loads(first.prompt_messages) == [system, user]
    assert json.loads(first.response_message) == {"role": "assistant", "content": None, "tool_calls": calls}
    assert first.finish_reason == "tool_calls"
    assert json.loads(first.tools) == [{"type": "function", "function": {
        "name": TOOL, "description": "Rooms.", "parameters": SCHEMA}}]
    assert json.loads(second.prompt_messages) == [
        system, user, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "{}", "tool_call_id": "call_a"}, {"role": "tool", "content": "{}", "tool_call_id": "call_b"}]
    assert json.loads(second.response_message) == {"role": "assistant", "content": "Nova."}
    assert second.tools is None
    assert [first.agent_name, second.agent_name] == ["scheduler", "scheduler"]


def test_a_call_floating_under_the_root_belongs_to_the_agent_span_enclosing_it_in_time() -> None:
    """Two tracing systems: the LLM span is the root's child, beside the agent span that encloses it in time
    (Agent Lightning repairs the tree for this, ``repair_hierarchy``): it is the planner's call, and the
    planner's reward is its reward."""
    t = Trace()
    with t.span("session", 0, 10) as root:
        with t.span("agent.node", 1, 9, {"agent.name": "planner"}, root) as agent:
            t.leaf("agent.reward", 4, 4.5, agentops_reward(0.3), agent)
        t.leaf("openai.chat.completion", 2, 3, llm([7], [8], "resp-planner"), root)
    [row] = t.convert(credit="matched")
    assert (row.agent_name, row.reward, row.prompt_token_ids) == ("planner", 0.3, [7])


def test_a_proxy_call_without_token_ids_is_one_retokenized_row_and_no_problem() -> None:
    """vLLM not asked for ids: the raw span's choices carry none. It is the request span's twin (same id), not
    a call whose content capture is off."""
    t = Trace()
    with t.span("litellm_request", 1, 3, {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "2+2?",
                                          "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "4",
                                          "gen_ai.response.id": "chatcmpl-L", "llm.request.type": "chat"}) as req:
        t.leaf("raw_gen_ai_request", 1.1, 2.9, {"llm.hosted_vllm.id": "chatcmpl-L", "llm.hosted_vllm.choices": str(
            [{"index": 0, "message": {"role": "assistant", "content": "4"}}])}, req)
    t.leaf("agentops_reward_operation.task", 4, 5, agentops_reward(1.0))
    request = encode_spans(t.exporter.get_finished_spans())
    spans = spans_from_table(trace_request_to_table(request, T0))
    out = convert_rollout(RolloutInput(spans[0].rollout_id, spans), ConvertConfig())
    assert (out.problems, out.calls_without_content, out.duplicate_calls) == ([], 0, 1)
    [row] = out.transitions
    assert (row.token_source, row.prompt_token_ids, json.loads(row.response_message)["content"]) == (
        "retokenized", [], "4")
