"""Reward extraction from the three channels of DESIGN.md, and the rollout reward.

1. In-band: a span with ``tracerl.reward`` (optional ``tracerl.reward.name``);
   ``agentlightning.reward`` spans (``agentlightning.reward.{i}.value`` / ``.name``,
   ``agentlightning.reward.primary``, or a legacy ``reward`` attribute on an
   ``agentlightning.reward`` / ``agentlightning.annotation`` span); AgentOps operation outputs
   ``{"type": "reward", "value": v}`` in ``agentops.task.output`` / ``agentops.entity.output`` (what
   Agent Lightning's ``@reward`` decorator records through AgentOps); and
   ``gen_ai.evaluation.result`` events (span events or log records) with
   ``gen_ai.evaluation.score.value``.
2. Side channel: rows the collector's ``POST /v1/rewards`` wrote into the rewards table.
3. Offline: rows a user wrote into the rewards table (``source = offline``).

The rollout reward is the sum of the rewards the reward rule selects (``--reward-from``,
``select_rewards``), so a task reward plus shaping terms add up, and ``matched`` credit can hand each
term to the call it belongs to. The rule:

* ``auto`` (default): every reward that is not the judge's (``source = judge``, ``tracerl judge``);
  only a rollout with none of those takes the judge's rewards. A graded rollout trains on its grader,
  and a judge that scores it beside the grader (to measure agreement) never adds to that reward; a
  rollout nobody graded is trained on the judge's score.
* ``NAME[,NAME...]``: only the rewards of these names, whatever their source (``judge`` trains on the
  judge alone; ``reward`` is the name of an unnamed in-band reward, and the side channel's default).

The transition records the names that were summed (``reward_names``) beside their channels
(``reward_source``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from schemas.attributes import REWARD, REWARD_NAME
from span_to_transition.records import LogEvent, Reward, Span, as_float, load_json

EVALUATION_EVENT = "gen_ai.evaluation.result"
AGL_PREFIX = "agentlightning.reward"
AGL_PRIMARY = "agentlightning.reward.primary"
AGL_FIRST = "agentlightning.reward.0.value"
AGL_LEGACY_NAMES = frozenset({AGL_PREFIX, "agentlightning.annotation"})  # span names whose ``reward`` attribute counts
AGENTOPS_OUTPUTS = ("agentops.task.output", "agentops.entity.output")
REWARD_KEYS = frozenset({REWARD, AGL_PRIMARY, AGL_FIRST, *AGENTOPS_OUTPUTS})
"""A span with any of these keys may carry a reward (the store materialises it; with any span event too)."""
_AGL_INDEXED = re.compile(r"^agentlightning\.reward\.(\d+)\.(value|name)$")


def _agentops(span: Span) -> list[Reward]:
    """``{"type": "reward", "value": v}`` as an AgentOps operation's recorded output (a null value: no reward)."""
    for key in AGENTOPS_OUTPUTS:
        out = load_json(span.attributes.get(key))
        if isinstance(out, dict) and out.get("type") == "reward":
            value = out.get("value")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return [Reward(float(value), "span", None, span.span_id, None, span.end_time_ns)]
    return []


def _agentlightning(span: Span) -> list[Reward]:
    a = span.attributes
    at = span.end_time_ns
    indexed: dict[int, dict[str, str]] = {}
    for k, v in a.items():
        m = _AGL_INDEXED.match(k)
        if m:
            indexed.setdefault(int(m.group(1)), {})[m.group(2)] = v
    out = []
    for i in sorted(indexed):
        value = as_float(indexed[i].get("value"))
        if value is not None:
            out.append(Reward(value, "span", indexed[i].get("name"), span.span_id, None, at))
    if out:
        return out
    primary = as_float(a.get("agentlightning.reward.primary"))
    if primary is not None:
        return [Reward(primary, "span", "primary", span.span_id, None, at)]
    if span.name in AGL_LEGACY_NAMES:
        legacy = as_float(a.get("reward"))
        if legacy is not None:
            return [Reward(legacy, "span", None, span.span_id, None, at)]
    return []


def _evaluation(attrs: dict[str, str], at: int, source: str, span_id: str | None) -> Reward | None:
    value = as_float(attrs.get("gen_ai.evaluation.score.value"))
    if value is None:
        return None
    return Reward(value, source, attrs.get("gen_ai.evaluation.name"), span_id, attrs.get("gen_ai.response.id"), at)


def in_band_rewards(spans: Iterable[Span], logs: Iterable[LogEvent] = ()) -> list[Reward]:
    """Every reward recorded inside the trace, placed at the time it was emitted.

    A reward span is placed at its end time; it targets no call (``span_id`` is the reward
    span's own id, which no call has), so ``matched`` gives it to the latest call that ended
    before it under the same agent span (``credit.matched``).
    An evaluation event targets the call it was attached to (or its ``gen_ai.response.id``).
    """
    out: list[Reward] = []
    carriers = [s for s in spans if s.events or s.name in AGL_LEGACY_NAMES
                or not REWARD_KEYS.isdisjoint(s.attributes)]  # the spans that can hold a reward
    for s in sorted(carriers, key=lambda s: (s.start_time_ns, s.trace_id, s.span_id)):  # delivery order never matters
        value = as_float(s.attributes.get(REWARD))
        if value is not None:
            out.append(Reward(value, "span", s.attributes.get(REWARD_NAME), s.span_id, None, s.end_time_ns))
        if s.name in AGL_LEGACY_NAMES or AGL_PRIMARY in s.attributes or AGL_FIRST in s.attributes:
            out.extend(_agentlightning(s))
        if AGENTOPS_OUTPUTS[0] in s.attributes or AGENTOPS_OUTPUTS[1] in s.attributes:
            out.extend(_agentops(s))
        for e in s.events:
            if e.name == EVALUATION_EVENT:
                r = _evaluation(e.attributes, e.time_ns, "event", s.span_id)
                if r is not None:
                    out.append(r)
    for e in logs:
        if (e.event_name or e.attributes.get("event.name")) == EVALUATION_EVENT:
            r = _evaluation(e.attributes, e.time_ns, "event", e.span_id)
            if r is not None:
                out.append(r)
    out.sort(key=lambda r: r.at_ns or 0)  # stable: same-time rewards keep their recorded order
    return out


JUDGE_SOURCE = "judge"
"""``source`` of the rows ``tracerl judge`` writes (judge/rows.py)."""
UNNAMED = "reward"
"""The name a reward without one goes by in ``--reward-from`` and ``reward_names`` (the side channel's default)."""
AUTO = "auto"
_NAME = re.compile(r"^[^,\s]+$")


@dataclass(frozen=True)
class RewardFrom:
    """Which rewards make a rollout's reward: ``names`` None is ``auto`` (see the module docstring)."""

    names: frozenset[str] | None = None

    def __str__(self) -> str:
        return AUTO if self.names is None else ",".join(sorted(self.names))

    def may_count(self, r: Reward) -> bool:
        """Whether ``r`` can ever be part of a rollout's reward under this rule (``auto``: every reward)."""
        return self.names is None or name_of(r) in self.names


def parse_reward_from(text: str) -> RewardFrom:
    """``auto`` or a comma-separated list of reward names; ValueError naming the fix otherwise."""
    if text.strip() == AUTO:
        return RewardFrom()
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if not _NAME.match(n) or n == AUTO]
    if not names or bad:
        raise ValueError(
            f"--reward-from {text!r}: give auto, or reward names separated by commas without spaces inside a "
            f"name (e.g. judge, or grade,style); bad: {', '.join(repr(b) for b in bad) or 'empty'}"
        )
    return RewardFrom(frozenset(names))


def name_of(r: Reward) -> str:
    return r.name or UNNAMED


def select_rewards(rewards: list[Reward], rule: RewardFrom) -> list[Reward]:
    """The rewards ``rule`` counts for one rollout, in their order (``auto``: the non-judge ones where there
    are any, else the judge's; a name list: those names)."""
    if rule.names is not None:
        return [r for r in rewards if name_of(r) in rule.names]
    graded = [r for r in rewards if r.source != JUDGE_SOURCE]
    return graded or [r for r in rewards if r.source == JUDGE_SOURCE]


@dataclass(frozen=True)
class RolloutReward:
    value: float | None  # None: no reward anywhere
    source: str | None  # the channels that contributed, comma-joined, e.g. "side_channel,span"
    names: str | None = None  # the reward names summed, comma-joined (an unnamed one: ``reward``)


def rollout_reward(rewards: Iterable[Reward]) -> RolloutReward:
    """Sum of all rewards; rows with the same ``reward_id`` count once (retried side-channel posts)."""
    seen: set[str] = set()
    total = 0.0
    sources: set[str] = set()
    names: set[str] = set()
    found = False
    for r in rewards:
        if r.reward_id is not None:
            if r.reward_id in seen:
                continue
            seen.add(r.reward_id)
        total += r.value
        sources.add(r.source)
        names.add(name_of(r))
        found = True
    if not found:
        return RolloutReward(None, None)
    return RolloutReward(total, ",".join(sorted(sources)), ",".join(sorted(names)))
