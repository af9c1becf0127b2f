"""The shortcuts taken for throughput (bench/convert.py) give exactly what the plain code gives."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from schemas.attributes import TASK_ID
from schemas.compact_json import compact_json
from span_to_transition import workers
from span_to_transition.agents import RESOURCE_AGENT, attribute_agent
from span_to_transition.columnar import _EMPTY, _placed, _resource_dicts, transitions_table
from span_to_transition.convert import NO_CALLS_NONE, NO_REWARD, RolloutOutput
from span_to_transition.records import Span, Transition, load_json
from span_to_transition.store import _files_of
from span_to_transition.tree import build_tree
from span_to_transition.workers import write_transitions
from store.layout import StoreLayout

from .test_agents import writer_checker_rewriter


def _reference_load(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return text


@pytest.mark.parametrize("text", [
    None, "", "plain text", '{"a":1}', ' {"a":1}', '{"a":1} ', '{"a":1}\n', "[1,2]x", "[1, 2]", "42", "4.5e3",
    "-0", "NaN", "Infinity", '"quoted"', "\ufeff[1]", "true", "null", '{"a":', "[", "{}", "[]", "0x10",
    '[{"role":"user","parts":[{"type":"text","content":"h\\u00e9 \\ud83d\\ude00"}]}]', "1 2",
])
def test_load_json_is_json_loads_or_the_text(text: str | None) -> None:
    got, want = load_json(text), _reference_load(text)
    assert json.dumps(got) == json.dumps(want) and type(got) is type(want)


@pytest.mark.parametrize("value", [
    "top", "h\u00e9\u2028 \x00\x1f \"q\" \\ \n\t", 1, -0.0, 1.5, 1e16, 1e-7, 2**70, True, None,
    [1, {"a": None, "b": [True, False]}], {"role": "user", "content": [{"type": "text", "text": "\U0001f600"}]},
    {"x": float("nan"), "y": float("inf")}, [], {},
])
def test_compact_json_is_compact_json_dumps(value: Any) -> None:
    assert compact_json(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def test_agent_memo_gives_the_same_answers_in_any_order() -> None:
    spans = writer_checker_rewriter().spans
    # a corrupt cycle (each names the other as parent) must stop the walk the same way with a memo
    spans += [Span("a" * 32, "c1", "c2", "loop one", 5, 6, {"gen_ai.operation.name": "chat"}),
              Span("a" * 32, "c2", "c1", "loop two", 5, 6)]
    tree = build_tree("r", spans)
    plain = {k: attribute_agent(tree, k) for k in tree.spans}
    assert plain[("a" * 32, "c1")] is None and "checker" in plain.values()
    for keys in (list(tree.spans), list(reversed(tree.spans))):
        memo: dict[tuple[str, str], str | None] = {}
        assert {k: attribute_agent(tree, k, memo) for k in keys} == plain


def _transition(rollout: str, step: int, started_at: int) -> Transition:
    return Transition(f"{rollout}-{step}", rollout, None, "t", f"s{step}", step, None, True, None, None, "[]", None,
                      "{}", None, None, None, None, "retokenized", 1.0, 1.0, "span", False, started_at,
                      started_at + 1, None, None)


def test_transitions_table_round_trips_the_records() -> None:
    rows = [_transition("r1", 0, 5), _transition("r0", 1, -3)]
    table = transitions_table(rows)
    got = table.drop_columns(["started_at", "ended_at", "conversion"]).to_pylist()
    assert got == [{k: getattr(r, k) for k in table.column_names if k not in ("started_at", "ended_at", "conversion")}
                   for r in rows]
    assert table.column("conversion").null_count == 2  # stamped where the rows are written
    assert pc.cast(table.column("started_at"), pa.int64()).to_pylist() == [5, -3]


def test_transitions_are_partitioned_by_utc_date_in_rollout_and_step_order(tmp_path: Path) -> None:
    day = 86_400 * 10**9
    times = [0, day - 1, day, -1, 1_763_700_000 * 10**9, 1_763_700_000 * 10**9 + 7]
    rows = [_transition(f"r{i % 3}", i, t) for i, t in enumerate(times)][::-1]
    layout = StoreLayout.at(tmp_path)
    files = write_transitions(layout.location, transitions_table(rows))
    # the reference: the UTC date as Arrow's strftime prints it
    ordered = sorted(rows, key=lambda r: (r.rollout_id, r.step))
    dates = pc.strftime(pa.array([r.started_at for r in ordered], pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
                        format="%Y-%m-%d").to_pylist()
    want: dict[str, list[tuple[str, int]]] = {}
    for r, date in zip(ordered, dates):
        want.setdefault(date, []).append((r.rollout_id, r.step))
    assert "1969-12-31" in want and "1970-01-02" in want
    got = {p.parent.name.removeprefix("date="): list(zip(*pq.read_table(p, columns=["rollout_id", "step"])
                                                          .to_pydict().values()))
           for p in files}
    assert got == want


def test_resource_dicts_hold_exactly_the_non_empty_keys_asked_for() -> None:
    keys = (TASK_ID, RESOURCE_AGENT)
    rows = [None, [], [(RESOURCE_AGENT, "")], [(TASK_ID, "t1"), ("service.name", "svc")],
            [("service.name", "svc")], [(RESOURCE_AGENT, "writer"), (TASK_ID, "t2")], None]
    got = _resource_dicts(pa.array(rows, pa.map_(pa.string(), pa.string())), keys)
    want = [{k: v for k, v in (r or []) if k in keys and v} for r in rows]
    assert got == want
    assert got[3] == {TASK_ID: "t1"} and got[5] == {RESOURCE_AGENT: "writer", TASK_ID: "t2"}
    chunked = pa.chunked_array([pa.array(rows[:3], pa.map_(pa.string(), pa.string())),
                                pa.array(rows[3:], pa.map_(pa.string(), pa.string()))])
    assert _resource_dicts(chunked, keys) == want


def test_worker_outputs_travel_packed_and_come_back_equal() -> None:
    outputs = [
        RolloutOutput("r0", "converted"),
        RolloutOutput("r1", "converted", problems=["span s has no parent"], orphans=1),
        RolloutOutput("r2", "excluded_no_reward", reason=NO_REWARD),
        RolloutOutput("r3", "no_calls", reason=NO_CALLS_NONE),
        RolloutOutput("r4", "converted", duplicates=2),
        RolloutOutput("r5", "converted", filled_reward=True),
        RolloutOutput("r6", "converted", untrainable_reasons={"malformed chat (semconv): x": 1}),
    ]
    packed = workers._pack(outputs)
    assert [p for p in packed if isinstance(p, str)] == ["r0"]  # only a rollout with nothing to report shrinks
    assert workers.unpack(pickle.loads(pickle.dumps(packed))) == outputs


def test_files_of_names_each_asked_rollouts_span_files() -> None:
    pairs = pa.table({"_file": pa.array([0, 0, 1, 2, 2], pa.int32()), "rollout_id": ["a", "b", "a", "c", None]})
    files = ["d/part-0.parquet", "d/part-1.parquet", "d/part-2.parquet"]
    assert _files_of(pairs, ["a", "c", "zz"], files) == {"a": {files[0], files[1]}, "c": {files[2]}}
    assert _files_of(pairs, [], files) == {}


def test_placed_puts_each_value_at_its_place_and_the_shared_empty_elsewhere() -> None:
    a, b = {"k": "1"}, {}
    got = _placed([a, b], np.array([3, 0]), 5)
    assert got == [b, {}, {}, a, {}]
    assert got[3] is a and got[0] is b and got[1] is _EMPTY and got[4] is _EMPTY
    assert _placed([], np.array([], dtype=np.int64), 2) == [{}, {}]
