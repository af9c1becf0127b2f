"""Canary routing: a share of new rollouts goes to the candidate ``policy@k+1``, the rest to ``policy@k``.

The gateway is told which upstream serves which version (``--upstream-for policy@5=URL``, twice) and
the candidate's share (``--canary 0.2``); the higher version is the candidate. A call that asks for
the versions' base name (``policy``) is routed by ``arm_for``: a hash of the call's rollout key, so
every call of one rollout lands on the same arm with no state kept (``tracerl promote`` compares
the arms per rollout, so a rollout that switched arms mid-way would be counted on neither).

The rollout key, broadest first: the rollout id (``X-Tracerl-Rollout-Id`` or ``tracerl.rollout_id``
in W3C ``baggage``), a conversation or session id in ``baggage`` (``gen_ai.conversation.id``,
``session.id``: a conversation whose turns are separate traces stays on one arm), the trace id of
``traceparent``; a call with none of these is assigned on its own.

A promote (share 1) or a rollback (share 0) replaces the gateway's ``CanaryRoute`` as a whole; a call
reads the route once, when it starts, and takes its arm, upstream and version from that one object,
so a call in flight during the switch ends where it began and its span says where that was.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from urllib.parse import unquote

from schemas.attributes import CANARY_ARM
from serving.protocol import parse_policy_version

ARM_ATTRIBUTE = CANARY_ARM  # the span attribute naming the call's arm (schemas/attributes.py)
SERVING = "serving"
CANDIDATE = "candidate"
SESSION_BAGGAGE = ("gen_ai.conversation.id", "session.id")
_SCALE = float(2**64)


@dataclass(frozen=True)
class Arm:
    """One arm: its name (``serving`` | ``candidate``), the version it serves and where."""

    name: str
    version: str  # "policy@5"
    upstream: str  # normalised URL


@dataclass(frozen=True)
class CanaryRoute:
    """Both arms and the candidate's share of new rollouts (0: rolled back, 1: promoted)."""

    serving: Arm
    candidate: Arm
    fraction: float

    @property
    def base(self) -> str:
        return self.serving.version.rpartition("@")[0]

    def arm(self, name: str) -> Arm:
        return self.candidate if name == CANDIDATE else self.serving

    def for_model(self, model: str | None) -> str | None:
        """Which arm a requested model name selects: None routes by key (the base name), an exact
        version its own arm, anything else is not the canary's (None too; see ``routes``)."""
        if model == self.candidate.version:
            return CANDIDATE
        if model == self.serving.version:
            return SERVING
        return None

    def routes(self, model: str | None) -> bool:
        return model in (self.base, self.serving.version, self.candidate.version)

    def with_fraction(self, fraction: float) -> CanaryRoute:
        check_fraction(fraction)
        return replace(self, fraction=fraction)


def check_fraction(fraction: float) -> float:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"canary fraction {fraction} must be in [0, 1], e.g. 0.2 for a fifth of rollouts")
    return fraction


def key_unit(key: str) -> float:
    """A uniform number in [0, 1) fixed by the key (BLAKE2b, so trace ids need not be random)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / _SCALE


def arm_for(key: str | None, fraction: float, rand: Callable[[], float] = random.random) -> str:
    """The arm of a call: ``candidate`` for a ``fraction`` share of keys, the same arm for the same key
    always (and for every smaller/larger fraction, nested: raising the share only moves keys to the
    candidate); a call without a key draws its own."""
    if fraction <= 0.0:
        return SERVING
    if fraction >= 1.0:
        return CANDIDATE
    u = key_unit(key) if key else rand()
    return CANDIDATE if u < fraction else SERVING


def session_from_baggage(value: str | None) -> str | None:
    """A conversation or session id from W3C ``baggage`` (``SESSION_BAGGAGE``), if any."""
    if not value:
        return None
    found: dict[str, str] = {}
    for item in value.split(","):
        key, _, rest = item.partition("=")
        if key.strip() in SESSION_BAGGAGE and rest:
            found[key.strip()] = unquote(rest.split(";")[0].strip())
    return next((found[k] for k in SESSION_BAGGAGE if found.get(k)), None)


def parse_upstream_for(items: list[str]) -> dict[str, str]:
    """``["policy@5=http://a:8000", ...]`` -> ``{"policy@5": "http://a:8000"}``; bad items name the fix."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not url or parse_policy_version(name) is None:
            raise ValueError(
                f"--upstream-for {item!r}: give VERSION=URL with VERSION named NAME@k, "
                "e.g. policy@5=http://127.0.0.1:8000"
            )
        if name in out:
            raise ValueError(f"--upstream-for names {name} twice; give each version one upstream")
        out[name] = url
    return out


def canary_route(versions: dict[str, str], fraction: float) -> CanaryRoute:
    """The route from a two-entry version -> upstream map: the higher version is the candidate."""
    check_fraction(fraction)
    if len(versions) != 2:
        raise ValueError(
            f"a canary needs exactly two versions (serving and candidate), got {sorted(versions) or 'none'}; "
            "pass --upstream-for policy@k=URL --upstream-for policy@k+1=URL"
        )
    (low, low_url), (high, high_url) = sorted(
        versions.items(), key=lambda kv: parse_policy_version(kv[0]) or 0
    )
    if low.rpartition("@")[0] != high.rpartition("@")[0] or low == high:
        raise ValueError(
            f"canary versions {low} and {high} must be two versions of one name (NAME@k, NAME@k+1)"
        )
    return CanaryRoute(Arm(SERVING, low, low_url), Arm(CANDIDATE, high, high_url), fraction)
