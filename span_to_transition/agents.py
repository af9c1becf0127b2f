"""Agent attribution: which agent made each LLM call, and whether its calls are trained on.

An agent is whatever span says so, in any of the spellings frameworks use; a call belongs to
its nearest agent ancestor (the call span itself first, since some frameworks tag it).

The name of an agent span, one rule (``agent_of_span``): the framework's own agent identity first, the
span name only when there is none, so that ``--agents NAME`` selects the name the user gave the agent:

1. an identity attribute: ``gen_ai.agent.name``, ``agent.name``, ``agent_name``, ``crewai.agent.role``
   (then OpenLLMetry's ``traceloop.entity.name`` of an agent or LangGraph node, AgentOps' ``operation.name``);
2. ``invoke_agent NAME`` (the semconv span name);
3. an OpenInference ``AGENT`` span: ``graph.node.id``, else its span name without the method it names
   (smolagents ``calculator.run`` and CrewAI ``calculator._execute_core`` are ``calculator``);
4. an OpenInference ``CHAIN`` span of a LlamaIndex agent workflow step: the ``current_agent_name`` its
   input records (``FunctionAgent(name="weather")`` is ``weather``).

Where the framework names no agent (DSPy's ``ReAct.forward`` spans carry no name or type), two ways that need no
code (``name_without_agent``): the process's resource attribute ``gen_ai.agent.name`` (set per process with
``OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=NAME``), then, with ``--agent-from span-name``, the name of the
call's nearest chain span (OpenInference ``CHAIN``, OpenLLMetry ``workflow`` / ``task``), without the method it
names (``ReAct.forward`` is ``ReAct``).
"""

from __future__ import annotations

import functools
import re

from span_to_transition.records import Attrs, Span
from span_to_transition.tree import Key, SpanTree

_METHOD = re.compile(r"^(.+)\.([A-Za-z_][A-Za-z0-9_]*)$")
_LLAMA_AGENT = re.compile(r"current_agent_name='([^']+)'")

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
    kind = a.get("openinference.span.kind")
    if kind is None:
        return None
    kind = kind.upper()
    if kind == "AGENT":
        if a.get("graph.node.id"):
            return a["graph.node.id"]
        m = _METHOD.match(span.name)
        return (m.group(1) if m else span.name) or None
    if kind == "CHAIN" and "current_agent_name=" in a.get("input.value", ""):
        m = _LLAMA_AGENT.search(a["input.value"])
        return m.group(1) if m else None
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


def agent_spans(tree: SpanTree) -> list[tuple[Key, str]]:
    """Every agent span of the tree and its name (for ``enclosing_agent``; built once per rollout)."""
    return [(k, name) for k, s in tree.spans.items() if (name := agent_of_span(s))]


def enclosing_agent(tree: SpanTree, key: Key, agents: list[tuple[Key, str]]) -> AgentRef:
    """For a span with no agent above it: the innermost agent span of its trace that encloses it in time.

    When two tracing systems record one run (AgentOps' agent spans and a framework's LLM spans that float
    under the root), the LLM span is not below its agent at all. Agent Lightning repairs such trees by
    re-parenting a span under the tightest span that encloses it in time (``TraceTree.repair_hierarchy``);
    this is the same rule, applied to attribution only: the tree itself is left as recorded."""
    span = tree.spans[key]
    best: tuple[int, int, str] | None = None
    found: AgentRef = None
    for k, name in agents:
        s = tree.spans[k]
        if k[0] == key[0] and k != key and s.start_time_ns <= span.start_time_ns and span.end_time_ns <= s.end_time_ns:
            order = (s.end_time_ns - s.start_time_ns, -s.start_time_ns, s.span_id)  # tightest, then latest start
            if best is None or order < best:
                best, found = order, (name, k)
    return found


class CallAgents:
    """The agent of a call (or of a reward's span): the nearest agent above it, else (two tracing systems,
    the span floating under the root) the innermost agent span enclosing it in time. One per rollout: the
    walks share a memo, and the list of agent spans is built only if some span needs it."""

    def __init__(self, tree: SpanTree) -> None:
        self.tree = tree
        self.memo: dict[Key, AgentRef] = {}
        self.spans: list[tuple[Key, str]] | None = None

    def __call__(self, key: Key) -> AgentRef:
        found = nearest_agent(self.tree, key, self.memo)
        if found is None:
            if self.spans is None:
                self.spans = agent_spans(self.tree)
            found = enclosing_agent(self.tree, key, self.spans) if self.spans else None
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


AGENT_FROM = ("framework", "span-name")
"""``--agent-from``: the framework's agent spans only (then the resource attribute), or also the nearest chain
span's name for calls under no agent."""
RESOURCE_AGENT = "gen_ai.agent.name"
"""The resource attribute naming the agent of every call a process makes (``OTEL_RESOURCE_ATTRIBUTES``)."""
_CHAIN_KINDS = (("openinference.span.kind", frozenset({"CHAIN"})), ("traceloop.span.kind",
                                                                    frozenset({"workflow", "task"})))


def chain_name(span: Span) -> str | None:
    """A chain span's name without the method it names (``ReAct.forward`` -> ``ReAct``); None for other spans."""
    a = span.attributes
    if not any((a.get(key) or "").upper() in {k.upper() for k in kinds} for key, kinds in _CHAIN_KINDS):
        return None
    m = _METHOD.match(span.name)
    return (m.group(1) if m else span.name) or None


def name_without_agent(tree: SpanTree, key: Key, agent_from: str = "framework") -> str | None:
    """The agent name of a call no agent span names: its process's ``gen_ai.agent.name`` resource attribute, then
    (``agent_from == "span-name"``) the nearest chain span's name at or above it."""
    span = tree.spans[key]
    if span.resource_attributes.get(RESOURCE_AGENT):
        return span.resource_attributes[RESOURCE_AGENT]
    if agent_from != "span-name":
        return None
    for k in tree.path_up(key, include_self=True):
        name = chain_name(tree.spans[k])
        if name:
            return name
    return None


def is_trainable(agent: str | None, selector: re.Pattern[str] | None) -> bool:
    """Calls of agents the selector matches (fully) are trained on; others are kept, not trained.

    With a selector, a call with no agent is not trainable: nothing selected it.
    """
    if selector is None:
        return True
    return agent is not None and selector.fullmatch(agent) is not None
