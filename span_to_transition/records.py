"""The in-memory records the pure logic works on: spans, log events, rewards, LLM calls, transitions.

The store holds spans as Arrow rows (``schemas.tables.SPANS_SCHEMA``); the I/O shell
(``span_to_transition.store``) turns only the rows that matter into these records, and the
pure functions (tree assembly, dialects, agents, rewards, credit, tokens) never see Arrow.
Attribute maps keep the store's encoding: OTLP strings as-is, anything else as JSON text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Attrs = dict[str, str]


@dataclass(frozen=True, slots=True)
class SpanEvent:
    """One span event (e.g. ``gen_ai.evaluation.result``)."""

    name: str
    time_ns: int
    attributes: Attrs = field(default_factory=dict)


@dataclass(slots=True)
class Span:
    """One span row. ``received_at_ns`` is when the collector stored it (used for completion)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_time_ns: int
    end_time_ns: int
    attributes: Attrs = field(default_factory=dict)
    resource_attributes: Attrs = field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    received_at_ns: int = 0
    rollout_id: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.trace_id, self.span_id)


@dataclass(frozen=True, slots=True)
class LogEvent:
    """A log record that is a GenAI event (``gen_ai.user.message``, ``gen_ai.choice``, ...)."""

    trace_id: str | None
    span_id: str | None
    time_ns: int
    event_name: str
    body: str | None = None  # store encoding: a string body as-is, structured bodies as JSON text
    attributes: Attrs = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reward:
    """One reward observation from any channel.

    ``span_id`` / ``response_id`` target a specific call (used by the ``matched`` strategy);
    ``at_ns`` places an in-band reward in time (``matched``: the latest earlier call under its agent).
    """

    value: float
    source: str  # span|event|side_channel|offline
    name: str | None = None
    span_id: str | None = None
    response_id: str | None = None
    at_ns: int | None = None
    reward_id: str | None = None


@dataclass(slots=True)
class LLMCall:
    """One LLM call, normalised to OpenAI chat format, whatever dialect recorded it."""

    span_id: str
    trace_id: str
    dialect: str
    messages: list[dict[str, Any]]
    response: dict[str, Any] | None
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    request_model: str | None = None
    response_model: str | None = None
    response_id: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    start_time_ns: int = 0
    end_time_ns: int = 0


@dataclass(slots=True)
class Tokens:
    """Exact tokens of a call, and where they came from (``gateway`` | ``span`` | ``retokenized``)."""

    source: str
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    policy_version: int | None = None


@dataclass(slots=True)
class Transition:
    """One row of the transitions table (schemas.tables.TRANSITIONS_SCHEMA)."""

    transition_id: str
    rollout_id: str
    task_id: str | None
    trace_id: str
    span_id: str
    step: int
    agent_name: str | None
    trainable: bool
    model: str | None
    policy_version: int | None
    prompt_messages: str
    tools: str | None
    response_message: str
    finish_reason: str | None
    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None
    token_source: str
    reward: float | None
    rollout_reward: float | None
    reward_source: str | None
    is_last: bool
    started_at: int
    ended_at: int
    input_tokens: int | None
    output_tokens: int | None
    untrainable_reason: str | None = None  # malformed chat: never trained, whatever --agents selects
    reward_names: str | None = None  # names summed into rollout_reward (--reward-from), comma-joined
    # the gateway span's tracerl.canary.arm: serving | candidate (null: no canary routed the call)
    canary_arm: str | None = None


_SCAN = json.JSONDecoder().scan_once  # json.loads' own C scanner, without the whitespace handling around it


def load_json(text: str | None) -> Any:
    """Decode an attribute value stored as JSON text; a plain string that is not JSON stays a string.

    Same result as ``json.loads``. The store writes JSON without surrounding whitespace, so the
    scanner is tried first (half the cost of ``json.loads`` for a short message list); anything
    else (whitespace, trailing data, not JSON) takes the ``json.loads`` path."""
    if text is None:
        return None
    try:
        value, end = _SCAN(text, 0)
        if end == len(text):
            return value
    except (StopIteration, ValueError, TypeError):
        pass
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return text


def as_int(text: str | None) -> int | None:
    """An int attribute (stored as JSON text ``42``; tolerate ``"42"`` and ``42.0``)."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return int(float(text))
        except ValueError:
            return None


def as_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def as_bool(text: str | None) -> bool:
    return text is not None and text.strip().lower() in ("true", "1")


@dataclass
class RolloutInput:
    """What ``convert_rollout`` reads: one rollout's spans, its log events and its reward rows."""

    rollout_id: str
    spans: list[Span]
    logs: list[LogEvent] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)  # side-channel / offline rows of this rollout
    timed_out: bool = False  # complete only because --max-wait-s passed without its root span


@dataclass
class RolloutOutput:
    """What ``convert_rollout`` returns: the transitions, or why there are none, and what it found on the way."""

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
