"""Lay out a rollout's spans as a timeline: one row per span in tree order, bars on a shared clock.

Pure (spans in, rows out) so the layout is tested without a store or a browser. A span whose
parent is not among the spans (a repaired tree, a gateway span of another trace) is drawn as a
root; children are ordered by start time, so the rows read top to bottom as the run happened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.attributes import GATEWAY_FLAG

TOOL_OPERATIONS = frozenset({"execute_tool"})
CALL_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})


@dataclass(frozen=True)
class TimelineRow:
    """One span as drawn: ``x`` and ``width`` are fractions of the rollout's duration (0..1)."""

    span_id: str
    name: str
    depth: int
    x: float
    width: float
    duration_ms: float
    start_ms: float  # from the rollout's first span start
    kind: str  # llm | tool | agent | gateway | span
    error: str | None  # the status message (or "error") of a failed span
    transition_id: str | None  # the call this span became, when it is one


def span_kind(name: str, attributes: Mapping[str, str]) -> str:
    """What a span is, for colouring: an LLM call, a tool, an agent, the gateway, or another span."""
    op = attributes.get("gen_ai.operation.name")
    if attributes.get(GATEWAY_FLAG) == "true":
        return "gateway"
    if op in TOOL_OPERATIONS or "gen_ai.tool.name" in attributes or name.startswith("execute_tool"):
        return "tool"
    if op == "invoke_agent" or "gen_ai.agent.name" in attributes or name.startswith("invoke_agent"):
        return "agent"
    if op in CALL_OPERATIONS:
        return "llm"
    return "span"


def layout(spans: Sequence[Mapping[str, Any]], calls: Mapping[str, str] | None = None) -> list[TimelineRow]:
    """Rows for ``spans`` (dicts with span_id, parent_span_id, name, start_time_ns, end_time_ns,
    status_code, status_message, attributes); ``calls`` maps a span id to its transition id."""
    calls = calls or {}
    if not spans:
        return []
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    for s in spans:
        parent = s.get("parent_span_id")
        children.setdefault(parent if parent in ids else None, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: (s.get("start_time_ns") or 0, s["span_id"]))
    t0 = min(s.get("start_time_ns") or 0 for s in spans)
    t1 = max(s.get("end_time_ns") or s.get("start_time_ns") or 0 for s in spans)
    total = max(t1 - t0, 1)
    rows: list[TimelineRow] = []
    seen: set[str] = set()

    def visit(s: Mapping[str, Any], depth: int) -> None:
        if s["span_id"] in seen:  # a cycle in bad data must not loop forever
            return
        seen.add(s["span_id"])
        start = s.get("start_time_ns") or t0
        end = max(s.get("end_time_ns") or start, start)
        attrs = s.get("attributes") or {}
        failed = s.get("status_code") == "error"
        kind = "llm" if s["span_id"] in calls else span_kind(s.get("name") or "", attrs)
        rows.append(
            TimelineRow(
                span_id=s["span_id"],
                name=s.get("name") or "(unnamed)",
                depth=depth,
                x=(start - t0) / total,
                width=max((end - start) / total, 0.002),
                duration_ms=(end - start) / 1e6,
                start_ms=(start - t0) / 1e6,
                kind=kind,
                error=(s.get("status_message") or "error") if failed else None,
                transition_id=calls.get(s["span_id"]),
            )
        )
        for child in children.get(s["span_id"], []):
            visit(child, depth + 1)

    for root in children.get(None, []):
        visit(root, 0)
    return rows


def ticks(total_ms: float, n: int = 5) -> list[tuple[float, str]]:
    """Axis ticks (fraction, label) at round intervals across ``total_ms``."""
    if total_ms <= 0:
        return [(0.0, "0 ms")]
    raw = total_ms / n
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    out, v = [], 0.0
    while v <= total_ms + 1e-9:
        label = f"{v / 1000:g} s" if total_ms >= 2000 else f"{v:g} ms"
        out.append((v / total_ms, label))
        v += step
    return out
