"""One rollout's spans (+ log events + reward rows) -> its transitions. Pure: no I/O, no clock.

This is the whole method in one function, ``convert_rollout``: assemble and repair the tree,
find the LLM calls in any dialect and dedupe them (nested records of one request, then response
id; ``calls.py``), join exact tokens, attribute agents, collect rewards from every channel, assign credit, and emit one transition per call
in the order the calls started.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from options import opt
from schemas.attributes import CANARY_ARM, TASK_ID
from schemas.compact_json import compact_json
from span_to_transition.agents import (
    AGENT_FROM,
    RESOURCE_AGENT,
    CallAgents,
    compile_agents,
    is_trainable,
    name_without_agent,
)
from span_to_transition.calls import claim_gateways, one_per_response_id, parse_calls, unjoined_reason
from span_to_transition.chat_messages import chat_problem
from span_to_transition.credit import CREDIT, CallRef, CreditRollout, assign
from span_to_transition.records import (
    LLMCall,
    Reward,
    RolloutInput,
    RolloutOutput,
    Span,
    Tokens,
    Transition,
    as_int,
)
from span_to_transition.rewards import (
    AUTO,
    RewardFrom,
    in_band_rewards,
    parse_reward_from,
    rollout_reward,
    select_rewards,
)
from span_to_transition.tokens import resolve_tokens
from span_to_transition.tree import SpanTree, build_tree

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

    calls, gateways = parse_calls(tree, inp, out)
    unique, twins = one_per_response_id(calls, tree, out)
    claimed = claim_gateways(unique, gateways, tree, out)
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
