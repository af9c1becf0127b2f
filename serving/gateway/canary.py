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

The next round's canary needs no restart either: ``POST /v1/canary {"serving": "policy@6",
"candidate": "policy@7"}`` (what ``tracerl promote --once`` sends) makes the gateway ask each of its
canary servers what it serves (``/v1/models`` names for LoRA adapters, ``/weight_info`` for full
weights) and build the new route from the answers (``resolve_route``): the two servers trade places
round after round (the trainer reloads whichever one is not serving) and the gateway follows them.
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


def parse_canary_post(body: object) -> tuple[float | None, tuple[str, str] | None]:
    """A ``POST /v1/canary`` body -> (new share or None, new (serving, candidate) pair or None)."""
    usage = '{"fraction": 0..1} and/or {"serving": "NAME@k", "candidate": "NAME@k+1"}'
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object: {usage}")
    fraction, pair = body.get("fraction"), None
    if fraction is not None:
        try:
            fraction = check_fraction(float(fraction))
        except (TypeError, ValueError) as e:
            raise ValueError(f"fraction {fraction!r}: {e}; give {usage}") from None
    if "serving" in body or "candidate" in body:
        pair = (str(body.get("serving")), str(body.get("candidate")))
        if not all(parse_policy_version(v) is not None for v in pair):
            raise ValueError(f"versions {pair} must both be NAME@k; give {usage}")
    if fraction is None and pair is None:
        raise ValueError(f"nothing to change; give {usage}")
    return fraction, pair


def serves(version: str, names: list[str], weight_version: str | None) -> bool:
    """Whether a server with these ``/v1/models`` names and ``/weight_info`` version serves ``version``:
    by name (a LoRA adapter ``policy@7``), by its full-weight tag (``"7"``), or, with no numeric tag
    (none, or vLLM's ``"default"`` before any reload), the base model's ``NAME@0``."""
    if version in names:
        return True
    k = parse_policy_version(version)
    untouched = weight_version is None or not weight_version.isdigit()
    return k == 0 if untouched else weight_version == str(k)


ServerView = tuple[list[str], "str | None"]  # (served names, weight version) of one server


def resolve_route(
    servers: dict[str, ServerView], serving: str, candidate: str, fraction: float
) -> CanaryRoute:
    """The route for ``serving`` vs ``candidate`` over servers that say what they serve (in their
    order). The candidate takes the first server serving it; serving takes the first server serving
    it, preferring one apart from the candidate's (two full-weight servers) and sharing it only when
    that is the only one (both LoRA adapters in one server)."""

    def where(version: str) -> list[str]:
        return [u for u, (names, wv) in servers.items() if serves(version, names, wv)]

    if (parse_policy_version(candidate) or 0) <= (parse_policy_version(serving) or 0):
        raise ValueError(f"the candidate {candidate} must be a higher version than serving {serving}")
    have = "; ".join(f"{u}: names {names}, weight version {wv}" for u, (names, wv) in servers.items())
    cand, serv = where(candidate), where(serving)
    for version, found in ((candidate, cand), (serving, serv)):
        if not found:
            raise LookupError(
                f"no canary server serves {version} ({have or 'no servers'}); publish it first "
                "(`tracerl train --canary --server URL,URL`) or give the server with --upstream-for"
            )
    apart = [u for u in serv if u != cand[0]]
    return canary_route({serving: (apart or serv)[0], candidate: cand[0]}, fraction)


def canary_route(versions: dict[str, str], fraction: float) -> CanaryRoute:
    """The route from a two-entry version -> upstream map: the higher version is the candidate."""
    check_fraction(fraction)
    if len(versions) != 2:
        raise ValueError(
            f"a canary needs exactly two versions (serving and candidate), got {sorted(versions) or 'none'}; "
            "pass --upstream-for policy@k=URL policy@k+1=URL (one flag, both versions)"
        )
    (low, low_url), (high, high_url) = sorted(
        versions.items(), key=lambda kv: parse_policy_version(kv[0]) or 0
    )
    if low.rpartition("@")[0] != high.rpartition("@")[0] or low == high:
        raise ValueError(
            f"canary versions {low} and {high} must be two versions of one name (NAME@k, NAME@k+1)"
        )
    return CanaryRoute(Arm(SERVING, low, low_url), Arm(CANDIDATE, high, high_url), fraction)
