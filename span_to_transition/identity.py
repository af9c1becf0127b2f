"""Which rollout each span belongs to: ``tracerl.rollout_id`` spread over its whole trace, traces
sharing the ``--rollout-key`` attribute (a conversation), traces joined by span links (AutoGen starts
a trace per message, linked to the sender's), and gateway traces joined to the call with the same
``gen_ai.response.id`` (an agent that sends no ``traceparent``)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from schemas.attributes import GATEWAY_FLAG
from span_to_transition.columnar import spans_from_table
from span_to_transition.content_join import REQUEST_MESSAGES, WINDOW_SLACK_NS, ContentJoin, match_by_content
from span_to_transition.dialects.registry import classify, parse_call


def assign_rollouts(
    spans: pa.Table, known: dict[str, str], follow_links: bool = True, rollout_key: str | None = None,
    joins: ContentJoin | None = None,
) -> tuple[pa.Table, dict[str, str]]:
    """Every span's rollout: its ``rollout_id`` (the trace id where the collector derived none), then
    unified per trace, by ``rollout_key`` and across links (``unify_rollouts``). Returns the relabelled
    table and pairs."""
    spans = spans.set_column(
        spans.schema.get_field_index("rollout_id"),
        "rollout_id",
        pc.coalesce(spans.column("rollout_id"), spans.column("trace_id")),
    )
    return unify_rollouts(spans, known, follow_links=follow_links, rollout_key=rollout_key, joins=joins)


def unify_rollouts(
    spans: pa.Table, known: dict[str, str], *, follow_links: bool = True, rollout_key: str | None = None,
    joins: ContentJoin | None = None,
) -> tuple[pa.Table, dict[str, str]]:
    """A trace belongs wholly to the rollout any of its spans names (``tracerl.rollout_id``).

    The collector derives ``rollout_id`` per span (span attribute, resource attribute, else trace
    id), so spans from a process that does not set the id (the serving gateway, a downstream
    service) would form a rollout of their own, keyed by the trace id. They join the rollout
    their trace belongs to; a gateway span whose trace names no rollout joins the rollout of the call span
    with its ``gen_ai.response.id`` (``gateway_rollouts``). With ``rollout_key``, traces that name no rollout
    and carry that attribute join one rollout per value (``key_rollouts``: a chat session's requests). With
    ``follow_links``, a trace that names no rollout and links to a
    span of another trace joins that trace's rollout (``link_rollouts``). ``known`` holds the
    trace -> rollout pairs of earlier passes, so late spans still find their rollout. Returns the
    relabelled table and the updated pairs.
    """
    rid, tid = spans.column("rollout_id"), spans.column("trace_id")
    explicit = pc.not_equal(rid, tid)
    pairs = (
        spans.filter(explicit)
        .select(["trace_id", "rollout_id"])
        .group_by("trace_id")
        .aggregate([("rollout_id", "min")])
    )
    mapping = dict(known)
    mapping.update(zip(pairs.column("trace_id").to_pylist(), pairs.column("rollout_id_min").to_pylist()))
    if rollout_key:
        mapping.update(key_rollouts(spans, explicit, rollout_key, mapping))
    if follow_links:
        mapping.update(link_rollouts(_link_edges(spans, explicit), mapping))
    mapping.update(gateway_rollouts(spans, explicit, mapping, joins))
    if not mapping:
        return spans, mapping
    keys, values = pa.array(list(mapping), pa.string()), pa.array(list(mapping.values()), pa.string())
    mapped = pc.take(values, pc.index_in(tid, value_set=keys))
    relabelled = pc.if_else(explicit, rid, pc.coalesce(mapped, rid))
    return spans.set_column(spans.schema.get_field_index("rollout_id"), "rollout_id", relabelled), mapping


def key_rollouts(spans: pa.Table, explicit: pa.ChunkedArray, key: str, known: dict[str, str]) -> dict[str, str]:
    """trace -> rollout ``<key>=<value>`` for traces that carry attribute ``key`` (on any span: a span
    attribute, else the span's resource attribute) and that ``known`` has no rollout for yet.

    A deployed chat service starts a trace per request; ``gen_ai.conversation.id`` or OpenInference's
    ``session.id`` says which requests are one conversation, so its traces form one rollout (the reward
    at its end, the credit rule spreading it over every call). The rollout id is derived from the value
    alone, so a conversation's later traces, in a later pass, land in the same rollout; the key's name in
    it keeps it apart from trace ids and ``tracerl.rollout_id`` values. A trace that names its rollout
    (``tracerl.rollout_id``) keeps it; a trace whose spans disagree takes the smallest value.
    """
    value = pc.coalesce(
        pc.map_lookup(spans.column("attributes"), key, "first"),
        pc.map_lookup(spans.column("resource_attributes"), key, "first"),
    )
    keep = pc.and_(pc.invert(explicit), pc.fill_null(pc.greater(pc.utf8_length(value), 0), False))
    pairs = (
        pa.table({"trace_id": spans.column("trace_id"), "value": value})
        .filter(keep)
        .group_by("trace_id")
        .aggregate([("value", "min")])
    )
    return {
        t: f"{key}={v}"
        for t, v in zip(pairs.column("trace_id").to_pylist(), pairs.column("value_min").to_pylist())
        if t not in known
    }


def _link_edges(spans: pa.Table, explicit: pa.ChunkedArray) -> list[tuple[str, str]]:
    """(trace, linked trace) for every span link from a trace that names no rollout to another trace."""
    links = spans.column("links").combine_chunks()
    if pc.sum(pc.list_value_length(links)).as_py() in (None, 0):
        return []
    parents = pc.list_parent_indices(links)
    src = pc.take(spans.column("trace_id"), parents)
    dst = pc.struct_field(pc.list_flatten(links), "trace_id")
    keep = pc.and_(pc.invert(pc.take(explicit, parents)), pc.not_equal(src, dst))
    edges = (
        pa.table({"src": src, "dst": dst})
        .filter(pc.fill_null(keep, False))
        .group_by(["src", "dst"])
        .aggregate([])
    )
    return list(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist()))


def link_rollouts(edges: Iterable[tuple[str, str]], known: dict[str, str]) -> dict[str, str]:
    """trace -> rollout for traces joined by span links (AutoGen starts a trace per message and links
    it to the sender's span), for the traces ``known`` has no rollout for yet.

    Traces connected by links form one rollout: the one a member already belongs to (``known``: an
    explicit ``tracerl.rollout_id`` or an earlier pass; the smallest if several), else the trace id
    of the origin, the trace that links to no other (the smallest if several). Link targets count
    even before their spans arrive, so the origin, and with it the rollout id, never changes as
    the component grows.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    linking = set()
    for a, b in edges:
        linking.add(a)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[str, list[str]] = {}
    for t in list(parent):
        members.setdefault(find(t), []).append(t)
    out = {}
    for group in members.values():
        named = [known[t] for t in group if t in known]
        rollout = min(named) if named else min((t for t in group if t not in linking), default=min(group))
        out.update({t: rollout for t in group if t not in known and t != rollout})
    return out


_OUTPUT_ID = r"""(?:^\{"id": ?"|"raw": ?\{"id": ?"|"raw": ?"ChatCompletion(?:Chunk)?\(id=')(?P<id>[^"']+)"""
"""Where an OpenInference LLM span keeps the response id inside ``output.value`` (``wire_roles.openinference_response_id``
reads the same three places): the OpenAI response itself, LlamaIndex's ``raw`` dict, smolagents' ``raw`` repr."""


def gateway_rollouts(spans: pa.Table, explicit: pa.ChunkedArray, known: dict[str, str],
                     joins: ContentJoin | None = None) -> dict[str, str]:
    """trace -> rollout for gateway traces that name no rollout: the rollout of the call span (in another trace)
    that carries the same response id, in ``gen_ai.response.id`` or inside OpenInference's ``output.value``.

    An agent whose instrumentation sends no ``traceparent`` (Strands, smolagents, LlamaIndex, contrib
    openai-v2; the openai 3.x client is not on ``httpx``, so the httpx instrumentation cannot add it) leaves
    every gateway span at the root of a trace of its own; the gateway and the agent's call span still record
    the provider's response id. What no response id joins is joined by content (``content_rollouts``). Only root
    gateway spans of traces no rollout claims are looked at, so a store without them pays for one lookup over its
    root spans. ``joins`` collects what the content join refused (ties, near-misses) and joined."""
    roots = spans.filter(pc.and_(pc.is_null(spans.column("parent_span_id")), pc.invert(explicit)))
    if known and len(roots):
        roots = roots.filter(pc.invert(pc.is_in(roots.column("trace_id"), value_set=pa.array(list(known), pa.string()))))
    if not len(roots):
        return {}
    flag = pc.map_lookup(roots.column("attributes"), GATEWAY_FLAG, "first")
    gw = roots.filter(pc.fill_null(pc.equal(flag, "true"), False))
    gw_ids = pc.map_lookup(gw.column("attributes"), "gen_ai.response.id", "first")
    wanted = {rid: t for rid, t in zip(gw_ids.to_pylist(), gw.column("trace_id").to_pylist()) if rid}
    out = _response_id_rollouts(spans, wanted, known) if wanted else {}
    rest = gw.filter(pc.invert(pc.is_in(gw.column("trace_id"), value_set=pa.array(list(out), pa.string()))))
    if len(rest) and "start_time_ns" in spans.schema.names:
        out.update(content_rollouts(spans, rest, known, joins))
    return out


def _response_id_rollouts(spans: pa.Table, wanted: dict[str, str], known: dict[str, str]) -> dict[str, str]:
    """trace -> rollout for gateway traces (``wanted``: response id -> gateway trace) by the call span, in another
    trace, that records the same response id."""
    attrs = spans.column("attributes")
    ids = pc.coalesce(
        pc.map_lookup(attrs, "gen_ai.response.id", "first"),
        pc.struct_field(pc.extract_regex(pc.map_lookup(attrs, "output.value", "first"), _OUTPUT_ID), "id"),
    )
    hit = spans.select(["trace_id", "rollout_id"]).append_column("rid", ids)
    hit = hit.filter(pc.fill_null(pc.is_in(hit.column("rid"), value_set=pa.array(list(wanted), pa.string())), False))
    out: dict[str, str] = {}
    for rid, trace, rollout in zip(hit.column("rid").to_pylist(), hit.column("trace_id").to_pylist(),
                                   hit.column("rollout_id").to_pylist()):
        gw_trace = wanted[rid]
        if trace != gw_trace and gw_trace not in out:
            out[gw_trace] = known.get(trace) or rollout
    return out


def content_rollouts(spans: pa.Table, gateways: pa.Table, known: dict[str, str],
                     joins: ContentJoin | None = None) -> dict[str, str]:
    """trace -> rollout for gateway traces whose root span records the request and response
    (``content_join.REQUEST_MESSAGES``) and whose content equals exactly one agent call's, in another trace, within
    that call's time window (``content_join.match_by_content``: a tie or near-miss joins nothing).

    Only the call spans that overlap the gateway spans' time range are parsed (by the converter's own dialects),
    so a pass pays for this only when such gateway traces exist."""
    has_content = pc.is_valid(pc.map_lookup(gateways.column("attributes"), REQUEST_MESSAGES, "first"))
    gateways = gateways.filter(has_content)
    if not len(gateways):
        return {}
    slack = WINDOW_SLACK_NS
    lo = pc.min(gateways.column("start_time_ns").cast(pa.int64())).as_py() - slack
    hi = pc.max(gateways.column("end_time_ns").cast(pa.int64())).as_py() + slack
    gw_traces = pa.array(sorted(set(gateways.column("trace_id").to_pylist())), pa.string())
    near = spans.filter(pc.and_(
        pc.and_(pc.less_equal(spans.column("start_time_ns").cast(pa.int64()), hi),
                pc.greater_equal(spans.column("end_time_ns").cast(pa.int64()), lo)),
        pc.invert(pc.is_in(spans.column("trace_id"), value_set=gw_traces))))
    calls = []
    rollout_of: dict[tuple[str, str], str] = {}
    for span in spans_from_table(near):
        if span.attributes and classify(span.attributes) is not None:
            call = parse_call(span)
            if call is not None:
                calls.append(call)
                rollout_of[span.key] = span.rollout_id or span.trace_id
    joined = match_by_content(calls, spans_from_table(gateways, all_attributes=True), silent_matches_request=True)
    if joins is not None:
        joins.pairs.update(joined.pairs)
        joins.ties.extend(joined.ties)
        joins.near_misses.extend(joined.near_misses)
    out: dict[str, str] = {}
    for (trace, span_id), g in joined.pairs.items():
        out[g.trace_id] = known.get(trace) or rollout_of[(trace, span_id)]
    return out
