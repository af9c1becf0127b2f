"""One rollout's spans (+ log events + reward rows) -> its transitions. Pure: no I/O, no clock.

This is the whole method in one function, ``convert_rollout``: assemble and repair the tree,
find the LLM calls in any dialect, dedupe them (nested records of one request, then response
id), join exact tokens, attribute
agents, collect rewards from every channel, assign credit, and emit one transition per call
in the order the calls started.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from options import opt
from schemas.attributes import CANARY_ARM, CONTENT_RECORDED, REQUEST_MESSAGES, TASK_ID
from schemas.compact_json import compact_json
from span_to_transition.agents import (
    AGENT_FROM,
    RESOURCE_AGENT,
    CallAgents,
    compile_agents,
    is_trainable,
    name_without_agent,
)
from span_to_transition.chat_messages import chat_problem, message
from span_to_transition.content_join import gateway_chat, match_by_content
from span_to_transition.credit import CREDIT, CallRef, CreditRollout, assign
from span_to_transition.dialects.openllmetry import tool_calls_from_spans
from span_to_transition.dialects.registry import classify, parse_call
from span_to_transition.dialects.semconv import parse_semconv
from span_to_transition.records import LLMCall, LogEvent, Reward, Span, Tokens, Transition, as_int
from span_to_transition.rewards import (
    AUTO,
    RewardFrom,
    in_band_rewards,
    parse_reward_from,
    rollout_reward,
    select_rewards,
)
from span_to_transition.tokens import is_gateway, match_gateways, resolve_tokens, tokens_from
from span_to_transition.tree import Key, SpanTree, build_tree

MISSING_REWARD = ("exclude", "fill", "keep")
"""What a rollout with no reward becomes: excluded (the default), filled with --fill-reward, or kept with a
null reward (``keep``: the trainer skips it until a reward row converts it again; what ``tracerl judge`` reads)."""

# Why a rollout yields no transitions (``RolloutOutput.reason``); ``tracerl doctor`` says what to do about each.
NO_CALLS_NONE = "no span is an LLM call in a dialect this converter reads"
NO_CALLS_WITHOUT_CONTENT = "its LLM call spans carry no message content (content capture is off)"
NO_REWARD = "no reward on any channel (tracerl.reward / agentlightning.reward spans, gen_ai.evaluation.result events, rewards rows)"
NO_SELECTED_REWARD = "its rewards all have names --reward-from does not select"


@dataclass
class ConvertConfig:
    """How spans become transitions; the same settings for ``tracerl convert`` and ``collect --convert``."""

    agents: str | None = opt(None, "regex (full match) of agent names whose calls are trainable; others are "
                                   "kept with trainable=false; default: every call", metavar="REGEX")
    credit: str = opt("identical", "credit assignment strategy", choices=list(CREDIT))
    gamma: float = opt(0.9, "discount for --credit discounted")
    quiet_s: float = opt(30.0, "a rollout whose root span ended is complete after this many seconds "
                               "without a new span")
    max_wait_s: float = opt(600.0, "a rollout whose root span never arrives is converted anyway (tree "
                                   "repaired) after this many quiet seconds")
    missing_reward: str = opt("exclude", "a rollout with no reward on any channel is excluded (and "
                                         "reconsidered when a reward row arrives), filled, or kept with a "
                                         "null reward (keep: the trainer skips it until a reward arrives; "
                                         "what `tracerl judge` needs to see unrewarded rollouts)",
                              choices=list(MISSING_REWARD))
    fill_reward: float = opt(0.0, "reward given to reward-less rollouts with --missing-reward fill")
    reward_from: str = opt(AUTO, "which rewards make a rollout's reward (their sum): auto = every reward but the "
                                 "judge's (source=judge) where the rollout has any, else the judge's, so a judge "
                                 "scoring graded rollouts never adds to their grader's reward; or NAME[,NAME] = only "
                                 "rewards of these names, whatever their source (judge: train on `tracerl judge` "
                                 "alone; an unnamed reward is named reward). A rollout with rewards of other names "
                                 "only counts as reward-less (--missing-reward decides)",
                           metavar="auto|NAME[,NAME]")
    follow_links: bool = opt(True, "a trace without tracerl.rollout_id that links to a span of another trace "
                                   "(AutoGen starts a trace per message, linked to the sender's) joins that "
                                   "trace's rollout")
    workers: int = opt(0, "worker processes for large batches (0: one per CPU, at most 16; 1: "
                          "in-process)")
    task_key: str | None = opt(None, "span or resource attribute whose value is the task (the group of "
                                     "group estimators), e.g. http.route or an app's request attribute; "
                                     "tracerl.task_id still wins; default: a hash of the first call's whole "
                                     "prompt (every message), so only the same request groups, "
                                     "never two questions behind one system prompt or few-shot preamble",
                               metavar="ATTR")
    rollout_key: str | None = opt(None, "span or resource attribute whose value makes one rollout of every "
                                        "trace that carries it: a conversation (gen_ai.conversation.id, "
                                        "OpenInference's session.id), its reward at its end; "
                                        "tracerl.rollout_id still wins; it is complete after --quiet-s "
                                        "without a new span, so set that to the conversation's idle time; "
                                        "default: one trace, one rollout",
                                  metavar="ATTR")

    agent_from: str = opt("framework", "where a call under no agent span gets its agent name: framework (only the "
                                       "framework's agent spans, then the process's resource attribute "
                                       "gen_ai.agent.name, set with OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=NAME) "
                                       "or span-name (also the name of the nearest chain span: OpenInference CHAIN, "
                                       "OpenLLMetry workflow/task, e.g. DSPy's ReAct.forward -> ReAct)",
                          choices=list(AGENT_FROM))

    def attribute_keys(self) -> tuple[str, ...]:
        """The attributes conversion reads besides the dialects': ``tracerl.task_id``, ``--task-key`` and the
        agent-naming resource attribute."""
        return (TASK_ID, RESOURCE_AGENT, *((self.task_key,) if self.task_key else ()))

    def reward_rule(self) -> RewardFrom:
        """``--reward-from`` parsed (once per distinct text: it is asked for every rollout)."""
        return _parse_rule(self.reward_from)

    def validate(self) -> None:
        """Raise ValueError naming the bad setting and the fix."""
        compile_agents(self.agents)
        if self.credit not in CREDIT:
            raise ValueError(f"--credit {self.credit!r} is unknown; choose one of {', '.join(CREDIT)}")
        parse_reward_from(self.reward_from)
        if self.missing_reward not in MISSING_REWARD:
            raise ValueError(f"--missing-reward {self.missing_reward!r} is unknown; choose exclude, fill or keep")
        if self.quiet_s < 0 or self.max_wait_s < 0:
            raise ValueError("--quiet-s and --max-wait-s must be >= 0")
        if self.agent_from not in AGENT_FROM:
            raise ValueError(f"--agent-from {self.agent_from!r} is unknown; choose framework or span-name")
        if self.workers < 0:
            raise ValueError(f"--workers {self.workers} must be >= 0 (0 picks one per CPU)")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--gamma {self.gamma} must be within [0, 1]")
        for flag, key in (("--task-key", self.task_key), ("--rollout-key", self.rollout_key)):
            if key is not None and (not key.strip() or key != key.strip()):
                raise ValueError(f"{flag} {key!r} must name an attribute (e.g. http.route, session.id), "
                                 "without spaces around it")


_parse_rule = functools.lru_cache(maxsize=8)(parse_reward_from)


@dataclass
class RolloutInput:
    rollout_id: str
    spans: list[Span]
    logs: list[LogEvent] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)  # side-channel / offline rows of this rollout
    timed_out: bool = False  # complete only because --max-wait-s passed without its root span


@dataclass
class RolloutOutput:
    rollout_id: str
    status: str  # converted|excluded_no_reward|no_calls
    reason: str | None = None  # why it is excluded_no_reward or no_calls, in words (summed in the stats)
    transitions: list[Transition] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duplicates: int = 0
    orphans: int = 0
    calls_without_content: int = 0
    duplicate_calls: int = 0
    filled_reward: bool = False
    untrainable_reasons: dict[str, int] = field(default_factory=dict)  # malformed chat: reason -> calls
    content_joined: int = 0  # calls joined to their gateway span by content (content_join.py)
    content_ties: int = 0  # gateway spans whose content matched several calls (or shared one): not joined
    content_near_misses: int = 0  # gateway spans equal to a call on the request or the response only


def transition_id(rollout_id: str, trace_id: str, span_id: str) -> str:
    """Stable across runs and delivery orders, so re-conversion never creates a second row."""
    return hashlib.sha256(f"{rollout_id}/{trace_id}/{span_id}".encode()).hexdigest()[:32]




def attribute_of(tree: SpanTree, key: str) -> str | None:
    """The value of attribute ``key`` in the rollout: span attribute before resource attribute, then roots
    first, then by start time and span id (a deterministic pick when spans disagree)."""
    best: tuple | None = None
    for s in tree.spans.values():
        for rank, attrs in ((0, s.attributes), (1, s.resource_attributes)):
            value = attrs.get(key) if attrs else None
            if value:
                order = (rank, s.parent_span_id is not None, s.start_time_ns, s.span_id)
                if best is None or order < best[0]:
                    best = (order, value)
    return None if best is None else str(best[1])


def task_id_of(tree: SpanTree, calls: list[LLMCall], task_key: str | None = None,
               prompts: list[str] | None = None) -> str | None:
    """The rollout's task, the group of group estimators: ``tracerl.task_id``, else the ``--task-key``
    attribute (each a span attribute, then a resource attribute; ``attribute_of``), else ``h:`` + a
    stable hash of the first call's whole prompt: every message (system prompt, few-shot turns, the
    question). Not its tools: some instrumentations record them and some do not (openai-v2 does not),
    and the same request must be the same task whichever recorded it. ``prompts``: each call's messages
    as the transition writes them (``prompt_messages``), when the caller has them already: the prompt is
    encoded once per call, not again for its hash.

    Two requests are one task only when the agent was asked the same thing: a deployed service sends
    one system prompt (schema, examples) before every question, or its examples as user/assistant
    turns before it, so hashing a part of the prompt (the first user message, say) groups different
    questions by accident; the whole prompt groups exactly the reruns of one request.
    """
    for key in (TASK_ID, *((task_key,) if task_key else ())):
        value = attribute_of(tree, key)
        if value is not None:
            return value
    for i, c in enumerate(calls):
        if c.messages:
            text = prompts[i] if prompts is not None else compact_json(c.messages)
            return "h:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return None


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
        return (where + f"no gateway span is below it and none records its gen_ai.response.id {call.response_id!r}; "
                "was this call sent through the gateway (OPENAI_BASE_URL)?")
    return (where + "no gateway span is below it (its client sent no traceparent), it records no "
            "gen_ai.response.id to join by, and no gateway span of its rollout recorded the same request and "
            "response in its time window alone (a tie, a near-miss, or a gateway too old to record "
            "tracerl.request.messages); propagate traceparent (e.g. opentelemetry-instrumentation-openai, "
            "which records the response id too) or use an instrumentation that records the response id")


def _join_by_content(calls: list[LLMCall], claimed: dict[str, Span], unclaimed: list[Span],
                     out: RolloutOutput) -> list[Span]:
    """Gateway spans left by the parent and response-id joins, joined to the calls still without one by equal
    request and response (``content_join``); ties and near-misses are counted and named, never joined. Returns
    the gateway spans still unclaimed."""
    joined = match_by_content([c for c in calls if c.span_id not in claimed], unclaimed)
    claimed.update({span_id: g for (_, span_id), g in joined.pairs.items()})
    out.content_joined += len(joined.pairs)
    out.content_ties += len(joined.ties)
    out.content_near_misses += len(joined.near_misses)
    for what, ids in (("matches several calls (or shares one with another gateway span) by content: a tie",
                       joined.ties), ("equals a call on the request or on the response only: a near-miss",
                                      joined.near_misses)):
        out.problems.extend(f"gateway span {g} in rollout {out.rollout_id} {what}; not joined, the call stays "
                            "retokenized" for g in ids)
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


def malformed_reason(call: LLMCall, out: RolloutOutput, exact_response: bool = False) -> str | None:
    """Why this call is not well-formed chat (``chat_messages.chat_problem``), as ``untrainable_reason`` says it:
    ``malformed chat (<dialect>): <problem>``; counted and reported with where, or None when it is well-formed.

    With ``exact_response`` (the engine's own response token ids, from the gateway or the span) the response is
    what the trainer trains on, whatever the recorded message says: an immediate end of text is a real sample
    (empty content, no tool calls), so only the prompt is checked then."""
    found = chat_problem(call.messages, None if exact_response else call.response)
    if found is None:
        return None
    reason = f"malformed chat ({call.dialect}): {found.problem}"
    out.untrainable_reasons[reason] = out.untrainable_reasons.get(reason, 0) + 1
    out.problems.append(f"LLM call span {call.span_id} ({call.dialect}) in trace {call.trace_id}: {found.problem} "
                        f"({found.where}); marked untrainable, never trained; run tracerl doctor for the fix")
    return reason


def _reward_scopes(tree: SpanTree, rewards: list[Reward], agent_of: CallAgents) -> list[object]:
    """Each reward's nearest agent span (the scope ``matched`` credit looks in); None for a reward
    recorded outside the tree (side channel, offline) or under no agent."""
    key_of = {k[1]: k for k in tree.spans}
    scopes: list[object] = []
    for r in rewards:
        key = key_of.get(r.span_id) if r.span_id and r.source in ("span", "event") else None
        found = agent_of(key) if key else None
        scopes.append(found[1] if found else None)
    return scopes


def _call_quality(call: LLMCall, depth: int) -> tuple:
    return (bool(call.messages), call.response is not None, call.tools is not None, -depth,
            -call.start_time_ns, call.span_id)


def _parse_calls(tree: SpanTree, inp: RolloutInput, out: RolloutOutput) -> tuple[list[LLMCall], list[Span]]:
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


def _one_per_response_id(calls: list[LLMCall], tree: SpanTree,
                         out: RolloutOutput) -> tuple[list[LLMCall], dict[str, list[Span]]]:
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
                    cur, tree.depth((cur.trace_id, cur.span_id))):
                best[c.response_id] = c
    unique.extend(c for c in best.values() if not _without_content(tree.spans[(c.trace_id, c.span_id)], c, out))
    twins = {b.span_id: [tree.spans[(c.trace_id, c.span_id)] for c in records[rid] if c is not b]
             for rid, b in best.items() if len(records[rid]) > 1}
    return unique, twins


def _claim_gateways(unique: list[LLMCall], gateways: list[Span], tree: SpanTree,
                    out: RolloutOutput) -> dict[str, Span]:
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
        content = ("no call of its rollout has its request and response" if REQUEST_MESSAGES in g.attributes
                   else "records no content (the gateway runs with --no-record-content)"
                   if g.attributes.get(CONTENT_RECORDED) == "false"
                   else "records no gen_ai.input.messages/gen_ai.output.messages")
        out.problems.append(
            f"gateway span {g.span_id} in trace {g.trace_id} matches no LLM call span (no parent call span, "
            f"no call with its gen_ai.response.id) and {content}; "
            "not converted. Instrument the agent's OpenAI client, or propagate traceparent to the gateway"
        )
    for call in unique:
        if call.span_id in claimed:
            _wire_when_malformed(call, claimed[call.span_id])
    return claimed


@dataclass
class _Reward:
    """The rollout's reward as the converter writes it: value (None: kept unrewarded), source, the rows
    summed, and their names (``reward_names``)."""

    value: float | None
    source: str | None
    rows: list[Reward]
    names: str | None = None


def _reward_of(tree: SpanTree, inp: RolloutInput, config: ConvertConfig, out: RolloutOutput) -> _Reward | None:
    """In-band and posted rewards, each ``reward_id`` once, those ``--reward-from`` selects summed; without
    any, ``--missing-reward`` decides (None: the rollout is excluded)."""
    seen_ids: set[str] = set()
    deduped: list[Reward] = []
    for r in in_band_rewards(tree.spans.values(), inp.logs) + list(inp.rewards):
        if r.reward_id is not None:
            if r.reward_id in seen_ids:
                continue
            seen_ids.add(r.reward_id)
        deduped.append(r)
    selected = select_rewards(deduped, config.reward_rule())
    total = rollout_reward(selected)
    if total.value is not None:
        return _Reward(total.value, total.source, selected, total.names)
    if config.missing_reward == "exclude":
        out.status, out.reason = "excluded_no_reward", NO_SELECTED_REWARD if deduped else NO_REWARD
        return None
    if config.missing_reward == "keep":  # written with a null reward, converted again when one arrives
        return _Reward(None, None, [])
    out.filled_reward = True
    return _Reward(config.fill_reward, "fill", [])


def _usage(call: LLMCall, gateway: Span | None) -> tuple[int | None, int | None]:
    """The call's token counts; where its span has none, the gateway's (e.g. a streamed call whose client
    asked for no usage: the gateway saw it)."""
    input_tokens, output_tokens = call.input_tokens, call.output_tokens
    if gateway is not None:
        if input_tokens is None:
            input_tokens = as_int(gateway.attributes.get("gen_ai.usage.input_tokens"))
        if output_tokens is None:
            output_tokens = as_int(gateway.attributes.get("gen_ai.usage.output_tokens"))
    return input_tokens, output_tokens


def canary_arm(gateway: Span) -> str | None:
    """The canary arm a gateway span records (``tracerl.canary.arm``), or None for a call no canary routed."""
    arm = gateway.attributes.get(CANARY_ARM)
    return arm if isinstance(arm, str) and arm else None


def _transition(rollout_id: str, task_id: str | None, call: LLMCall, step: int, is_last: bool, agent: str | None,
                tokens: Tokens, usage: tuple[int | None, int | None], reward: _Reward, credited: float | None, *,
                untrainable: str | None, trainable: bool, prompt: str, arm: str | None = None) -> Transition:
    """One call's row of the transitions table (schemas/tables.py); ``prompt``: ``compact_json(call.messages)``;
    ``arm``: the canary arm its gateway span records."""
    return Transition(
        transition_id=transition_id(rollout_id, call.trace_id, call.span_id),
        rollout_id=rollout_id,
        task_id=task_id,
        trace_id=call.trace_id,
        span_id=call.span_id,
        step=step,
        agent_name=agent,
        trainable=trainable,
        model=call.response_model or call.request_model,
        policy_version=tokens.policy_version,
        prompt_messages=prompt,
        tools=compact_json(call.tools) if call.tools else None,
        response_message=compact_json(call.response),  # "null": the span recorded token ids only
        finish_reason=call.finish_reason,
        prompt_token_ids=tokens.prompt_token_ids,
        response_token_ids=tokens.response_token_ids,
        response_logprobs=tokens.response_logprobs,
        token_source=tokens.source,
        reward=None if credited is None else float(credited),
        rollout_reward=None if reward.value is None else float(reward.value),
        reward_source=reward.source,
        reward_names=reward.names,
        is_last=is_last,
        started_at=call.start_time_ns,
        ended_at=call.end_time_ns,
        input_tokens=usage[0],
        output_tokens=usage[1],
        untrainable_reason=untrainable,
        canary_arm=arm,
    )


def convert_rollout(inp: RolloutInput, config: ConvertConfig) -> RolloutOutput:
    """The transitions of one complete rollout (see the module docstring for the steps)."""
    selector = compile_agents(config.agents)
    tree = build_tree(inp.rollout_id, inp.spans, quiet_flag="--max-wait-s" if inp.timed_out else "--quiet-s")
    out = RolloutOutput(inp.rollout_id, "no_calls", duplicates=tree.duplicates, orphans=len(tree.orphans))
    out.problems.extend(tree.problems)

    calls, gateways = _parse_calls(tree, inp, out)
    unique, twins = _one_per_response_id(calls, tree, out)
    claimed = _claim_gateways(unique, gateways, tree, out)
    unique.sort(key=lambda c: (c.start_time_ns, c.end_time_ns, c.span_id))
    if not unique:
        out.reason = NO_CALLS_WITHOUT_CONTENT if out.calls_without_content else NO_CALLS_NONE
        return out
    reward = _reward_of(tree, inp, config, out)
    if reward is None:
        return out

    agent_of = CallAgents(tree)
    call_agents = [agent_of((c.trace_id, c.span_id)) for c in unique]
    refs = [CallRef(c.span_id, c.response_id, c.end_time_ns, a[1] if a else None) for c, a in zip(unique, call_agents)]
    scopes = _reward_scopes(tree, reward.rows, agent_of) if config.credit == "matched" else None
    credit: list[float | None] = (
        [None] * len(refs) if reward.value is None
        else list(assign(config.credit, CreditRollout(refs, reward.value, reward.rows, config.gamma, scopes)))
    )
    prompts = [compact_json(c.messages) for c in unique]
    task_id = task_id_of(tree, unique, config.task_key, prompts)
    for step, (call, credited, found) in enumerate(zip(unique, credit, call_agents)):
        gateway = claimed.get(call.span_id)
        tokens = resolve_tokens(tree.spans[(call.trace_id, call.span_id)], gateway, call, out.problems,
                                twins.get(call.span_id, ()))
        if gateways and tokens.source == "retokenized":
            out.problems.append(unjoined_reason(call))
        agent = found[0] if found else name_without_agent(tree, (call.trace_id, call.span_id), config.agent_from)
        untrainable = malformed_reason(call, out, tokens.source != "retokenized" and bool(tokens.response_token_ids))
        out.transitions.append(_transition(
            inp.rollout_id, task_id, call, step, step == len(unique) - 1, agent, tokens, _usage(call, gateway),
            reward, credited, untrainable=untrainable, trainable=untrainable is None and is_trainable(agent, selector),
            prompt=prompts[step], arm=None if gateway is None else canary_arm(gateway)))
    out.status = "converted"
    return out
