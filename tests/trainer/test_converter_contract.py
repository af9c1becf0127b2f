"""The contract with span_to_transition: spans of an unmodified agent (OTel GenAI semconv, reward
spans, base model served as plain ``policy``) -> ``convert_store`` -> transitions -> a trained round.

No token ids were recorded (no gateway), so every call is retokenized with the chat template, and
the calls carry no policy version: the trainer counts them as policy@0, the base model.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from schemas.tables import SPANS_SCHEMA
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import read_table, write_table_atomic
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.manifest import read_rounds
from trainer.rounds import run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

T0 = 1_700_000_000_000_000_000


def agent_trace(i: int, task: int, reward: float) -> list[dict]:
    """One rollout: invoke_agent -> chat (semconv JSON parts) + a tracerl.reward span."""
    trace = f"{i + 1:032x}"
    t = T0 + i * 10_000_000
    prompt = [{"role": "user", "parts": [{"type": "text", "content": f"task {task}: say something nice"}]}]
    reply = [{"role": "assistant", "parts": [{"type": "text", "content": f"answer {i % 3}"}],
              "finish_reason": "stop"}]

    def span(n: int, parent: int | None, name: str, attrs: dict, start: int, end: int) -> dict:
        return {"trace_id": trace, "span_id": f"{n:016x}", "parent_span_id": f"{parent:016x}" if parent else None,
                "name": name, "kind": "internal", "start_time_ns": start, "end_time_ns": end, "status_code": "unset",
                "attributes": list(attrs.items()), "resource_attributes": [], "events": [], "links": [],
                "received_at": t, "rollout_id": trace}

    return [
        span(1, None, "invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
             t, t + 5_000_000),
        span(2, 1, "chat policy", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy",
                                   "gen_ai.response.model": "policy", "gen_ai.input.messages": json.dumps(prompt),
                                   "gen_ai.output.messages": json.dumps(reply)}, t + 1_000_000, t + 2_000_000),
        span(3, 1, "reward", {"tracerl.reward": json.dumps(reward)}, t + 3_000_000, t + 3_000_000),
    ]


def test_converted_agent_spans_train_a_round(tmp_path, train_settings):
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store

    store = tmp_path / "store"
    rows = [s for i in range(12) for s in agent_trace(i, task=i % 3, reward=float(i % 2))]
    cols = {f.name: [r.get(f.name) for r in rows] for f in SPANS_SCHEMA}
    table = pa.Table.from_arrays(
        [pa.array(cols[f.name], pa.int64()).cast(f.type) if pa.types.is_timestamp(f.type)
         else pa.array(cols[f.name], f.type) for f in SPANS_SCHEMA], schema=SPANS_SCHEMA)
    layout = StoreLayout.at(store)
    write_table_atomic(table, layout.partition("spans", "2023-11-14") / "part-0.parquet", "spans")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, workers=1), now_ns=T0 + 10**12)
    assert stats.transitions_written == 12

    transitions = read_table(layout.table("transitions"), "transitions").to_pylist()
    assert {(r["policy_version"], r["token_source"], r["is_last"]) for r in transitions} == {(None, "retokenized", True)}

    out = run_once(train_settings(store), log=lambda m: None)
    assert out.status == "trained" and out.round == 0
    man = read_manifest(checkpoint_dir(layout.checkpoints, 1))
    assert man["dataset"]["n_retokenized"] == 12 and man["dataset"]["n_groups"] == 3
    assert man["dataset"]["n_groups_zero_variance"] == 0
    row = read_rounds(layout.location)[0]
    assert row["n_rollouts"] == 12 and row["mean_reward"] == 0.5
