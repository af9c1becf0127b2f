"""The canary arm the gateway recorded on a call's span is a transitions column, ``canary_arm``: null for a
call no canary routed and in files written before the column existed; ``tracerl sql`` shows it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.attributes import CANARY_ARM
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store

from .factory import TraceBuilder, spans_table, user
from .test_store import LATER, S, put, transitions

IDS = {
    "tracerl.prompt_token_ids": [5, 6],
    "tracerl.response_token_ids": [7],
    "tracerl.response_logprobs": [-0.5],
}


def rollout_through_gateway(store: Path, trace_hex: str, arm: str | None) -> None:
    """An agent's rollout of two calls, each with the gateway's span as its child (traceparent), as
    ``tracerl gateway --canary`` records them: the arm and the exact version on every call span."""
    t = TraceBuilder(trace_hex * 32, rollout_id=f"run-{trace_hex}", received_at_ns=100 * S)
    root = t.span("invoke_agent a", agent="a")
    for i in range(2):
        call = t.chat(root, [user(f"q{i}")], "x")
        canary = {} if arm is None else {CANARY_ARM: arm}
        t.span(
            "tracerl.gateway policy",
            call,
            {"tracerl.gateway": True, "tracerl.policy_version": 3, **IDS, **canary},
        )
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), f"agent-{trace_hex}")


def test_each_call_carries_the_arm_its_gateway_span_records(tmp_path: Path) -> None:
    rollout_through_gateway(tmp_path, "a", "candidate")
    rollout_through_gateway(tmp_path, "b", "serving")
    rollout_through_gateway(tmp_path, "c", None)  # a gateway without --canary
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.problems == []
    got = sorted(
        (r["rollout_id"], r["step"], r["token_source"], r["canary_arm"]) for r in transitions(tmp_path)
    )
    assert got == [
        ("run-a", 0, "gateway", "candidate"),
        ("run-a", 1, "gateway", "candidate"),
        ("run-b", 0, "gateway", "serving"),
        ("run-b", 1, "gateway", "serving"),
        ("run-c", 0, "gateway", None),
        ("run-c", 1, "gateway", None),
    ]


def test_files_written_before_the_column_read_it_as_null_and_tracerl_sql_shows_it(
    tmp_path: Path, capsys
) -> None:
    from tracerl.cli import main

    rollout_through_gateway(tmp_path, "a", "candidate")
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    # an older converter's file: the same rows without the column
    [path] = StoreLayout.at(tmp_path).table("transitions").rglob("*.parquet")
    old = pq.read_table(path).drop_columns(["canary_arm"])
    renamed = pa.array(["old-" + r for r in old.column("rollout_id").to_pylist()])
    pq.write_table(
        old.set_column(old.schema.get_field_index("rollout_id"), "rollout_id", renamed),
        path.with_name("old.parquet"),
    )
    rows = sorted((r["rollout_id"], r["canary_arm"]) for r in transitions(tmp_path))
    assert rows == [("old-run-a", None), ("old-run-a", None), ("run-a", "candidate"), ("run-a", "candidate")]
    query = "SELECT canary_arm, count(DISTINCT rollout_id) AS rollouts FROM transitions GROUP BY 1 ORDER BY 1"
    assert main(["sql", "--store", str(tmp_path), query]) == 0
    out = capsys.readouterr().out
    assert "candidate" in out and "canary_arm" in out
