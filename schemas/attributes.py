"""The ``tracerl.*`` span attributes and the ``name@k`` version rule: the contract between writers and readers.

Writers: the gateway (``serving/protocol.py``, ``serving/gateway/``), the rollout driver's
``OTEL_RESOURCE_ATTRIBUTES`` (``rollout/agent_env.py``), the user's agent (``tracerl.reward``,
``tracerl.rollout.end``). Readers: the collector (rollout id at ingest), the converter
(``span_to_transition/``), ``tracerl doctor``, the viewer (``ui/``) and the demo's SQL. Each name is
declared once, here, so a rename cannot leave a reader behind. Standard library only: this module
imports no other package (DESIGN.md's package table).

A served model name carries the policy version it was trained to as ``name@k`` (``policy@3`` is
round 3's weights); ``version_name`` writes it and ``parse_policy_version`` reads it, everywhere.
"""

from __future__ import annotations

import functools
import re

# --- set by the agent (or the rollout driver, per process, in OTEL_RESOURCE_ATTRIBUTES) ---------------
ROLLOUT_ID = "tracerl.rollout_id"
"""Resource or span attribute (or W3C baggage entry) naming the rollout a span belongs to."""
TASK_ID = "tracerl.task_id"
"""Resource or span attribute naming the task: the group of group-relative advantages."""
REWARD = "tracerl.reward"
"""An in-band reward (float) on any span."""
REWARD_NAME = "tracerl.reward.name"
"""Optional name of an in-band reward."""
ROLLOUT_END = "tracerl.rollout.end"
"""True on a span that marks its rollout complete (no quiet period needed)."""

# --- set by the gateway on its span of each proxied call --------------------------------------------
GATEWAY_FLAG = "tracerl.gateway"
"""True on the gateway's span; its token ids are exact."""
UPSTREAM = "tracerl.upstream"
"""The upstream URL that served the call."""
POLICY_VERSION = "tracerl.policy_version"
"""The policy version (int) that served the call."""
POLICY_VERSION_AMBIGUOUS = "tracerl.policy_version_ambiguous"
"""True when the call straddled a full-weight swap: served by one of two versions, which is unknown."""
POLICY_VERSION_CANDIDATES = "tracerl.policy_version_candidates"
"""The versions an ambiguous call may have been served by (instead of ``POLICY_VERSION``)."""
PROMPT_TOKEN_IDS = "tracerl.prompt_token_ids"
"""The prompt's exact token ids, as compact JSON text (``[1,2,3]``: the text the store keeps for an int array
attribute, so an int array from an older gateway reads the same)."""
RESPONSE_TOKEN_IDS = "tracerl.response_token_ids"
"""Choice 0's exact response token ids, JSON text as ``PROMPT_TOKEN_IDS`` (choice i > 0: under ``choice_prefix(i)``)."""
RESPONSE_LOGPROBS = "tracerl.response_logprobs"
"""Choice 0's sampled-token logprobs from the serving engine, JSON text (choice i > 0: under ``choice_prefix(i)``)."""
CANARY_ARM = "tracerl.canary.arm"
"""Gateway call span: the canary arm (``serving`` or ``candidate``) the call's rollout was routed to."""
REQUEST_MESSAGES = "tracerl.request.messages"
"""Chat: the request's ``messages``, JSON, exactly as the client sent them (the converter's content join)."""
RESPONSE_MESSAGE = "tracerl.response.message"
"""Chat: choice 0's assistant message (content, tool calls; streamed deltas merged), JSON, as returned."""
CONTENT_RECORDED = "tracerl.gateway.content_recorded"
"""Gateway span: ``false`` when the gateway ran with ``--no-record-content`` (no ``REQUEST_MESSAGES`` /
``RESPONSE_MESSAGE``, so no content join); absent when it records them."""


def choice_prefix(index: int) -> str:
    """Where choice ``index``'s ``response_token_ids`` / ``response_logprobs`` go: choice 0 at the top level,
    so that a single-choice call (every agent's) reads as ``RESPONSE_TOKEN_IDS``."""
    return "tracerl." if index == 0 else f"tracerl.choices.{index}."


# --- the name@k version rule --------------------------------------------------------------------------
_VERSIONED = re.compile(r"@(\d+)$")


def version_name(base: str, version: int) -> str:
    """``policy``, 3 -> ``policy@3``: the name agents and the gateway see for round 3's weights."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{base}@{version}"


@functools.lru_cache(maxsize=4096)  # a handful of model names, each seen once per call
def parse_policy_version(model: str | None) -> int | None:
    """``policy@3`` -> 3; a name without ``@k`` (or no name) has no known version (None)."""
    if not model:
        return None
    m = _VERSIONED.search(model)
    return int(m.group(1)) if m else None


def base_name(model: str) -> str:
    """``policy@3`` -> ``policy``; a name without ``@k`` is its own base."""
    return model[: model.rindex("@")] if parse_policy_version(model) is not None else model
