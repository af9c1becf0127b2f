"""Agent attribution: which agent made each LLM call, and whether its calls are trained on.

An agent is whatever span says so, in any of the spellings frameworks use; a call belongs to
its nearest agent ancestor (the call span itself first, since some frameworks tag it).
"""

from __future__ import annotations

import functools
import re

from span_to_transition.records import Attrs, Span
from span_to_transition.tree import Key, SpanTree

AGENT_KEYS = frozenset(
    {
        "gen_ai.agent.name",  # OTel GenAI semconv
        "agent.name",  # OpenInference (OpenAI Agents, smolagents), Google ADK
        "agent_name",  # pydantic-ai / logfire
        "crewai.agent.role",  # CrewAI
        "traceloop.entity.name",  # OpenLLMetry frameworks: kind = agent, or a LangGraph node (below)
        "agentops.span.kind",  # AgentOps @agent: kind = agent, its name in operation.name
    }
)
LANGGRAPH_NODE = "traceloop.association.properties.langgraph_node"  # OpenLLMetry's copy of the run metadata
LANGGRAPH_INTEGRATION = "traceloop.association.properties.ls_integration"


def agent_of_span(span: Span) -> str | None:
    """The agent name a span declares, or None when it is not an agent span."""
    a = span.attributes
    if not AGENT_KEYS.isdisjoint(a):  # (C-speed test; most spans carry none of these keys)
        for key in ("gen_ai.agent.name", "agent.name", "agent_name", "crewai.agent.role"):
            if a.get(key):
                return a[key]
        if a.get("traceloop.span.kind") == "agent" and a.get("traceloop.entity.name"):
            return a["traceloop.entity.name"]
        if _is_langgraph_node(a):
            return a["traceloop.entity.name"]
        if a.get("agentops.span.kind") == "agent" and a.get("operation.name"):
            return a["operation.name"]
    if a.get("gen_ai.operation.name") == "invoke_agent" or span.name.startswith("invoke_agent"):
        rest = span.name[len("invoke_agent"):].strip()
        return rest or None
    if a.get("openinference.span.kind", "").upper() == "AGENT":
        return span.name or None
    return None


def _is_langgraph_node(a: Attrs) -> bool:
    """A LangGraph node's own span (OpenLLMetry: a task named like its ``langgraph_node``): the node is the
    agent of the calls made in it (a writer node, a checker node). Not the inner ``model``/``tools`` nodes
    of LangChain's ``create_agent``: its graph span (``gen_ai.agent.name``) names that agent."""
    node = a.get(LANGGRAPH_NODE)
    return (bool(node) and node == a.get("traceloop.entity.name") and a.get("traceloop.span.kind") == "task"
            and a.get(LANGGRAPH_INTEGRATION) != "langchain_create_agent")


AgentRef = tuple[str, Key] | None
"""The nearest agent of a span: (its name, the key of the agent span), or None."""


def nearest_agent(tree: SpanTree, key: Key, memo: dict[Key, AgentRef] | None = None) -> AgentRef:
    """The nearest agent at or above ``key``: nested agents (a checker inside a writer) win.

    The agent span's key scopes ``matched`` credit (two runs of one agent are two scopes).
    ``memo`` (one dict per tree) remembers the answer for every span walked, so calls under the
    same agent do not walk up to it again; the answers are the same with or without it.
    """
    walked: list[Key] = []
    found: AgentRef = None
    for k in tree.path_up(key, include_self=True):
        if memo is not None and k in memo:
            found = memo[k]
            break
        walked.append(k)
        name = agent_of_span(tree.spans[k])
        if name:
            found = (name, k)
            break
    if memo is not None:
        for k in walked:  # every span walked below the answer has the same nearest agent
            memo[k] = found
    return found


def attribute_agent(tree: SpanTree, key: Key, memo: dict[Key, AgentRef] | None = None) -> str | None:
    """The name of the nearest agent at or above ``key`` (see ``nearest_agent``)."""
    found = nearest_agent(tree, key, memo)
    return found[0] if found else None


@functools.lru_cache(maxsize=64)
def compile_agents(pattern: str | None) -> re.Pattern[str] | None:
    """``--agents REGEX``: None trains every call. The regex must match the whole agent name."""
    if pattern is None or pattern == "":
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--agents {pattern!r} is not a valid regular expression ({e}); "
                         "write e.g. --agents 'writer|rewriter'") from e


def is_trainable(agent: str | None, selector: re.Pattern[str] | None) -> bool:
    """Calls of agents the selector matches (fully) are trained on; others are kept, not trained.

    With a selector, a call with no agent is not trainable: nothing selected it.
    """
    if selector is None:
        return True
    return agent is not None and selector.fullmatch(agent) is not None
