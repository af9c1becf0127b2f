"""Exact tokens: join each LLM call to the gateway span that saw its token ids, or say it has none.

The serving gateway records the exact prompt/response token ids and logprobs of every call it
proxies (``tracerl.gateway = true``). Its span is a child of the agent's call span when the
agent's client propagated ``traceparent``; otherwise it shares the call's ``gen_ai.response.id``.
A gateway span is never a call of its own when an agent call span claims it (that would count
the call twice); unclaimed gateway spans (an uninstrumented agent) become calls themselves.

Token sources: ``gateway`` (joined gateway span), ``span`` (the call span, or another record of
the same call, carries token ids in one of the ``PROMPT_ID_KEYS`` / ``RESPONSE_ID_KEYS`` spellings:
ours, Agent Lightning's, LiteLLM's vLLM passthrough), else ``retokenized``: the id lists are empty
and the trainer renders the messages with the model's chat template. Nothing is guessed: malformed
ids are a reported problem and the call falls back to ``retokenized``.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.attributes import GATEWAY_FLAG, POLICY_VERSION, parse_policy_version
from schemas.attributes import POLICY_VERSION_CANDIDATES as POLICY_CANDIDATES
from schemas.attributes import PROMPT_TOKEN_IDS as PROMPT_IDS
from schemas.attributes import RESPONSE_LOGPROBS as LOGPROBS
from schemas.attributes import RESPONSE_TOKEN_IDS as RESPONSE_IDS
from span_to_transition.records import LLMCall, Span, Tokens, as_bool, as_int, load_json

PROMPT_ID_KEYS = (
    PROMPT_IDS,
    "prompt_token_ids",  # Agent Lightning (its vLLM client patch puts the ids on the LLM span)
    "agentlightning.operation.output.prompt_token_ids",  # Agent Lightning's Weave tracer
    "llm.hosted_vllm.prompt_token_ids",  # LiteLLM raw_gen_ai_request span (str() of the list)
)
RESPONSE_ID_KEYS = (  # (key, where the ids sit in its value)
    (RESPONSE_IDS, "list"),
    ("response_token_ids", "list"),
    ("agentlightning.operation.output.response_token_ids.0", "list"),
    ("agentlightning.operation.output.choices.0.token_ids", "list"),
    ("agentlightning.operation.output.choices.0.provider_specific_fields.token_ids", "list"),
    ("llm.hosted_vllm.response_token_ids", "first"),  # [[ids]]: one list per choice
    ("llm.hosted_vllm.choices", "choice0"),  # [{"token_ids": ids}, ...]
)
"""Where each producer records exact token ids on a span (first valid spelling wins). Agent Lightning
v0.3.0 ``adapter/triplet.py`` (``span_to_triplet``, ``LlmProxyTraceToTriplet._extract_tokens_from_raw``)
reads the same spellings."""
TOKEN_KEYS = frozenset(PROMPT_ID_KEYS) | frozenset(k for k, _ in RESPONSE_ID_KEYS)
RESPONSE_ID_ATTRS = ("gen_ai.response.id", "agentlightning.operation.output.id", "llm.hosted_vllm.id")


def response_id_of(attrs: Mapping[str, str]) -> str | None:
    """The provider's response id under any of its spellings (dedupes two records of one call)."""
    for key in RESPONSE_ID_ATTRS:
        if attrs.get(key):
            return attrs[key]
    return None


def is_gateway(span: Span) -> bool:
    return as_bool(span.attributes.get(GATEWAY_FLAG))


def _decode(text: str) -> Any:
    """JSON text, or the ``str()`` of a Python value (LiteLLM stringifies what it records)."""
    value = load_json(text)
    if isinstance(value, str):
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            value = ast.literal_eval(value)
    return value


def _int_list(text: str | None, what: str, span: Span, problems: list[str], shape: str = "list") -> list[int] | None:
    if text is None:
        return None
    value = _decode(text)
    if shape == "first":
        value = value[0] if isinstance(value, list) and value else None
    elif shape == "choice0":  # (a response recorded without ids, vLLM not asked for them: no ids, no problem)
        value = value[0].get("token_ids") if isinstance(value, list) and value and isinstance(value[0], dict) else None
        if value is None:
            return None
    if isinstance(value, list) and all(type(v) is int for v in value):  # (bool is not: a subclass)
        return value
    problems.append(f"span {span.span_id} in trace {span.trace_id}: {what} is not a JSON list of ints "
                    f"({text[:40]!r}); its call is marked retokenized; fix the producer of {what}")
    return None


def _first_ids(a: Mapping[str, str], keys: Iterable[tuple[str, str]], span: Span,
               problems: list[str]) -> list[int] | None:
    for key, shape in keys:
        if key in a:
            ids = _int_list(a[key], key, span, problems, shape)
            if ids:  # an empty list records nothing (Agent Lightning writes [] when vLLM returned no ids)
                return ids
    return None


def _float_list(text: str | None, span: Span, problems: list[str]) -> list[float] | None:
    if text is None:
        return None
    value = load_json(text)
    if isinstance(value, list) and all(type(v) is float or type(v) is int for v in value):
        return [float(v) for v in value]
    problems.append(f"span {span.span_id} in trace {span.trace_id}: {LOGPROBS} is not a JSON list of numbers; "
                    "logprobs dropped")
    return None


def tokens_from(span: Span, source: str, problems: list[str]) -> Tokens | None:
    """Token ids recorded on ``span``, or None when it records none (or they are malformed)."""
    a = span.attributes
    if TOKEN_KEYS.isdisjoint(a):
        return None
    prompt = _first_ids(a, ((k, "list") for k in PROMPT_ID_KEYS), span, problems)
    response = _first_ids(a, RESPONSE_ID_KEYS, span, problems)
    if prompt is None or response is None:
        return None
    logprobs = _float_list(a.get(LOGPROBS), span, problems)
    if logprobs is not None and len(logprobs) != len(response):
        problems.append(f"span {span.span_id}: {len(logprobs)} logprobs for {len(response)} response tokens; "
                        "logprobs dropped")
        logprobs = None
    return Tokens(source, prompt, response, logprobs, as_int(a.get(POLICY_VERSION)))


def match_gateways(calls: Iterable[LLMCall], gateways: Iterable[Span],
                   parent_of: dict[str, str | None]) -> tuple[dict[str, Span], list[Span]]:
    """Pair call spans with gateway spans: parent/child first, then ``gen_ai.response.id``.

    Returns ({call span_id: gateway span}, unclaimed gateway spans). ``parent_of`` maps a span id
    to its parent span id within the rollout.
    """
    calls = list(calls)
    call_ids = {c.span_id for c in calls}
    by_response = {c.response_id: c.span_id for c in calls if c.response_id}
    matched: dict[str, Span] = {}
    unclaimed: list[Span] = []
    for g in sorted(gateways, key=lambda s: (s.start_time_ns, s.span_id)):
        # the nearest call span above the gateway span (a client-library span may sit between)
        target = None
        cur = parent_of.get(g.span_id)
        hops = 0
        while cur is not None and hops < 4:
            if cur in call_ids:
                target = cur
                break
            cur = parent_of.get(cur)
            hops += 1
        if target is None:
            target = by_response.get(g.attributes.get("gen_ai.response.id"))
        if target is None or target in matched:
            unclaimed.append(g)
        else:
            matched[target] = g
    return matched, unclaimed


def older_candidate(value: str | None) -> int | None:
    """The older of an ambiguous call's two candidate versions: a lower bound of the version that served
    it, never a fresher one. Its staleness is then counted at most one publish too high, and its
    importance weight is exact either way (it divides by the logprobs the engine really sampled with)."""
    raw = load_json(value) if value is not None else None
    versions = [v for v in (as_int(str(c)) if as_int(str(c)) is not None else parse_policy_version(str(c))
                            for c in (raw if isinstance(raw, list) else [])) if v is not None]
    return min(versions) if versions else None


def resolve_tokens(call_span: Span, gateway: Span | None, call: LLMCall, problems: list[str],
                   twins: Iterable[Span] = ()) -> Tokens:
    """Exact tokens for one call, with the policy version (attribute first, then ``name@k``).

    ``twins`` are other records of the same call that were deduplicated away (LiteLLM's
    ``raw_gen_ai_request`` span under its ``litellm_request`` span): their ids count as the call's own."""
    tokens = None
    if gateway is not None:
        tokens = tokens_from(gateway, "gateway", problems)
    for span in (call_span, *twins):
        if tokens is None:
            tokens = tokens_from(span, "span", problems)
    if tokens is None:
        tokens = Tokens("retokenized", [], [])  # empty lists, never null: "no ids" (README)
    if tokens.policy_version is None:
        for span in (gateway, call_span):
            if span is not None and as_int(span.attributes.get(POLICY_VERSION)) is not None:
                tokens.policy_version = as_int(span.attributes.get(POLICY_VERSION))
                break
    if tokens.policy_version is None and gateway is not None:
        tokens.policy_version = older_candidate(gateway.attributes.get(POLICY_CANDIDATES))
    if tokens.policy_version is None:
        gw_model = gateway.attributes.get("gen_ai.response.model") if gateway is not None else None
        for model in (gw_model, call.response_model, call.request_model):
            v = parse_policy_version(model)
            if v is not None:
                tokens.policy_version = v
                break
    return tokens
