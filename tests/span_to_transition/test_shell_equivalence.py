"""The store shell's shortcuts (vectorised dedupe, pruning, worker processes) change nothing."""

from __future__ import annotations

import operator
import random
import threading

import pytest

from span_to_transition import workers
from span_to_transition.columnar import materialize
from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.records import Span
from span_to_transition.workers import convert_parallel

from .factory import TraceBuilder, spans_table, user
from .test_agents import writer_checker_rewriter
from .test_tokens import gateway_attrs


def gateway_behind_a_client_span() -> TraceBuilder:
    """agent -> call -> (irrelevant) http client span -> gateway span: the join crosses a pruned span."""
    t = TraceBuilder("b" * 32)
    root = t.span("invoke_agent solver", agent="solver")
    call = t.chat(root, [user("hi")], "hello", response_id="r1", model="policy@7")
    http = t.span("POST", call, {"http.method": "POST"})
    t.span("gateway", http, gateway_attrs("r1-other", [1, 2], [3]))
    tool = t.span("execute_tool calc", root, {"gen_ai.operation.name": "execute_tool"})
    t.chat(t.span("inner", tool), [user("nested")], "deep", response_id="r2")
    t.reward(root, 0.5)
    return t


def reference(spans: list[Span], config: ConvertConfig) -> list[tuple]:
    by_rollout: dict[str, list[Span]] = {}
    for s in spans:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    rows = []
    for rid in sorted(by_rollout):
        rows += convert_rollout(RolloutInput(rid, by_rollout[rid]), config).transitions
    return sorted((t.transition_id, t.step, t.agent_name, t.trainable, t.token_source, t.prompt_token_ids,
                   t.prompt_messages, t.response_message, t.reward, t.task_id) for t in rows)


def shell_rows(spans: list[Span], config: ConvertConfig) -> list[tuple]:
    table = spans_table(spans).sort_by([("rollout_id", "ascending")])
    out = []
    keep = operator.methodcaller("slice")  # the sink: the chunk's table itself (picklable for forkserver)
    for tt, _ in convert_parallel(table, [], {}, config, len({s.rollout_id for s in spans}), keep):
        out += [(d["transition_id"], d["step"], d["agent_name"], d["trainable"], d["token_source"],
                 d["prompt_token_ids"], d["prompt_messages"], d["response_message"], d["reward"], d["task_id"])
                for d in tt.drop_columns(["started_at", "ended_at"]).to_pylist()]
    return sorted(out)


def scenario() -> list[Span]:
    spans = writer_checker_rewriter().spans + gateway_behind_a_client_span().spans
    dup = spans[:3]
    spans = spans + dup
    random.Random(11).shuffle(spans)
    return spans


def test_pruned_vectorised_shell_equals_the_pure_reference() -> None:
    config = ConvertConfig(agents="writer|solver")
    got = shell_rows(scenario(), config)
    assert got == reference(scenario(), config)
    assert [r[4] for r in got].count("gateway") == 1


def test_materialize_drops_duplicates_and_prunes_irrelevant_spans() -> None:
    spans = gateway_behind_a_client_span().spans
    records, dropped = materialize(spans_table(spans + spans[:2]))
    assert dropped == 2
    names = {r.name for r in records}
    assert "POST" not in names and "inner" not in names  # pruned
    gateway = next(r for r in records if r.name == "gateway")
    call = next(r for r in records if r.attributes.get("gen_ai.response.id") == "r1")
    assert gateway.parent_span_id == call.span_id  # re-parented across the pruned http span


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_worker_processes_give_the_same_rows(monkeypatch: pytest.MonkeyPatch, start: str) -> None:
    monkeypatch.setattr(workers, "PARALLEL_MIN_ROLLOUTS", 1)
    if start == "forkserver":  # what a caller with threads (collect --convert) gets
        monkeypatch.setattr(threading, "active_count", lambda: 2)
    spans: list[Span] = []
    for i in range(8):
        t = TraceBuilder(f"{i:032x}")
        root = t.span("invoke_agent a", agent="a")
        t.chat(root, [user(f"q{i}")], f"a{i}", response_id=f"r{i}")
        t.reward(root, float(i))
        spans += t.spans
    assert shell_rows(spans, ConvertConfig(workers=2)) == reference(spans, ConvertConfig())
