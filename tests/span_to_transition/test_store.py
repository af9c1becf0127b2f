"""The store shell on real Parquet: completion, idempotency, streaming == batch, late spans, views, CLI."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from tracerl_testing import tracerl

from schemas.tables import REWARDS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.identity import link_rollouts
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic
from store.views import connect_readonly

from .factory import DIALECT_FIXTURES, TraceBuilder, fixture_tables, spans_table, user

S = 1_000_000_000
LATER = 2_000_000_000 * S  # far after every fixture's receive time


def put(store: Path, table: str, data: pa.Table, name: str) -> None:
    write_table_atomic(data, StoreLayout.at(store).partition(table, "2026-11-21") / f"{name}.parquet", table)


def transitions(store: Path) -> list[dict]:
    """The rows the ``transitions`` view shows (each rollout's latest conversion), without the pass number."""
    con = connect_readonly(parse_store(store))
    table = con.sql("SELECT * EXCLUDE (conversion, date) FROM transitions").to_arrow_table()
    con.close()
    for col in ("started_at", "ended_at"):  # ns timestamps: compare as ints (no pandas needed)
        table = table.set_column(table.schema.get_field_index(col), col, table.column(col).cast(pa.int64()))
    rows = table.to_pylist()
    return sorted(rows, key=lambda r: r["transition_id"])


def load_fixtures(store: Path) -> None:
    for name in DIALECT_FIXTURES:
        traces, logs = fixture_tables(name)
        put(store, "spans", traces, name)
        if logs is not None:
            put(store, "logs", logs, name)


def test_fixture_store_converts_every_dialect_and_rerunning_writes_nothing(store: Path) -> None:
    load_fixtures(store)
    stats = convert_store(parse_store(store), ConvertConfig(), now_ns=LATER)
    assert (stats.rollouts_converted, stats.transitions_written, stats.problems) == (6, 12, [])
    rows = transitions(store)
    assert {r["token_source"] for r in rows} == {"retokenized"}
    assert len({(r["prompt_messages"], r["response_message"]) for r in rows}) == 2  # six dialects, two calls
    files = sorted(StoreLayout.at(store).table("transitions").rglob("*.parquet"))

    again = convert_store(parse_store(store), ConvertConfig(), now_ns=LATER)
    assert (again.transitions_written, again.span_files_read) == (0, 0)
    assert sorted(StoreLayout.at(store).table("transitions").rglob("*.parquet")) == files
    assert transitions(store) == rows


def test_rollouts_view_and_readme_queries(store: Path) -> None:
    load_fixtures(store)
    convert_store(parse_store(store), ConvertConfig(), now_ns=LATER)
    con = connect_readonly(parse_store(store))
    got = con.execute("SELECT reward, n_calls, agents, policy_version, token_coverage FROM rollouts").fetchall()
    assert got == [(1.0, 2, ["weather"], 3, 0.0)] * 6
    readme = (Path(__file__).parents[2] / "span_to_transition" / "README.md").read_text()
    queries = re.findall(r"```sql\n(.*?)```", readme, re.S)
    assert len(queries) >= 3
    for q in queries:
        con.execute(q).fetchall()  # every documented query runs against the real views


def rollout(trace_id: str, received_at_ns: int, *, reward: bool = True) -> list:
    t = TraceBuilder(trace_id, received_at_ns=received_at_ns)
    root = t.span("invoke_agent a", agent="a")
    t.chat(root, [user(f"task {trace_id[:4]}")], "ok", response_id=f"r-{trace_id[:4]}")
    if reward:
        t.reward(root, 1.0)
    return t.spans


def test_streaming_in_pieces_equals_one_batch(tmp_path: Path) -> None:
    batch = tmp_path / "batch"
    put(batch, "spans", spans_table([s for i in range(6) for s in rollout(f"{i:032x}", 1_000)]), "all")
    convert_store(parse_store(batch), ConvertConfig(quiet_s=5), now_ns=LATER)

    # The collector's view: rollout i arrives in two pieces at 10i s and 10i+1 s, children before
    # parents and one span delivered twice; conversion runs after every piece.
    stream = tmp_path / "stream"
    rng = random.Random(3)
    written = 0
    for i in range(6):
        spans = rollout(f"{i:032x}", 0)
        rng.shuffle(spans)
        for k, piece in enumerate([spans[: len(spans) // 2] + spans[:1], spans[len(spans) // 2:]]):
            at = (10 * i + k) * S
            put(stream, "spans", spans_table([replace(s, received_at_ns=at) for s in piece]), f"r{i}-{k}")
            written += convert_store(parse_store(stream), ConvertConfig(quiet_s=5), now_ns=at + S // 2).transitions_written
        assert written == i  # rollout i is still in its quiet period; rollout i-1 is done
    written += convert_store(parse_store(stream), ConvertConfig(quiet_s=5), now_ns=LATER).transitions_written
    assert written == 6
    assert transitions(stream) == transitions(batch)


def test_pending_until_quiet_then_late_spans_are_counted_not_converted(store: Path) -> None:
    spans = rollout("f" * 32, received_at_ns=100 * S)
    put(store, "spans", spans_table(spans), "a")
    early = convert_store(parse_store(store), ConvertConfig(quiet_s=30), now_ns=110 * S)
    assert (early.rollouts_pending, early.transitions_written) == (1, 0)
    done = convert_store(parse_store(store), ConvertConfig(quiet_s=30), now_ns=131 * S)
    assert done.transitions_written == 1

    t = TraceBuilder("f" * 32, received_at_ns=140 * S)
    t._n = 50
    late = t.span("late tool", None)
    put(store, "spans", spans_table([late]), "late")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=30), now_ns=200 * S)
    assert (stats.late_spans, stats.late_spans_total, stats.transitions_written) == (1, 1, 0)
    assert "late spans" in stats.summary()
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=30), now_ns=300 * S)
    assert (again.late_spans, again.late_spans_total) == (0, 1)


def test_excluded_rollout_is_converted_once_its_side_channel_reward_arrives(store: Path) -> None:
    put(store, "spans", spans_table(rollout("e" * 32, 100 * S, reward=False)), "a")
    first = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (first.rollouts_excluded_no_reward, first.transitions_written) == (1, 0)
    assert "--missing-reward fill" in first.summary()
    assert convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER).rollouts_excluded_no_reward == 0

    put(store, "rewards", side_reward("x1", 0.25, trace_id="e" * 32), "r1")
    later = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert later.transitions_written == 1
    [row] = transitions(store)
    assert (row["reward"], row["reward_source"]) == (0.25, "side_channel")


@pytest.mark.slow
def test_cli_convert_and_usage_errors(store: Path) -> None:
    put(store, "spans", spans_table(rollout("c" * 32, 100 * S)), "a")
    bad = tracerl("convert", "--store", str(store), "--agents", "writer(", check=False)
    assert bad.returncode == 2 and "--agents" in bad.stderr
    missing = tracerl("convert", "--store", str(store / "nope"), check=False)
    assert missing.returncode == 2 and "has no spans/ directory" in missing.stderr
    ok = tracerl("convert", "--store", str(store), "--quiet-s", "0", "--json")
    assert json.loads(ok.stdout)["transitions_written"] == 1
    out = tracerl("sql", "--store", str(store), "--format", "json", "SELECT agent_name, reward FROM transitions")
    assert json.loads(out.stdout) == [{"agent_name": "a", "reward": 1.0}]


def test_explicit_end_marker_completes_a_rollout_without_waiting(store: Path) -> None:
    t = TraceBuilder("d" * 32, received_at_ns=100 * S)
    root = t.span("invoke_agent a", agent="a")
    t.chat(root, [user("q")], "a")
    t.span("done", root, {"tracerl.rollout.end": True, "tracerl.reward": 1.0})
    put(store, "spans", spans_table([s for s in t.spans if s is not root]), "a")  # root not even here yet
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=3600), now_ns=100 * S)
    assert stats.transitions_written == 1


def test_spans_without_the_rollout_id_join_the_rollout_their_trace_belongs_to(store: Path) -> None:
    """The gateway process does not know the agent's tracerl.rollout_id; its spans share the trace."""
    t = TraceBuilder("9" * 32, rollout_id="run-7", received_at_ns=100 * S)
    root = t.span("invoke_agent a", agent="a")
    call = t.chat(root, [user("q")], "a", response_id="r1")
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "agent")
    gw = TraceBuilder("9" * 32, rollout_id="9" * 32, received_at_ns=101 * S)  # collector default: trace id
    gw._n = 40
    gw_span = gw.span("gateway", call, {"tracerl.gateway": True, "gen_ai.response.id": "r1",
                                        "tracerl.prompt_token_ids": [5, 6], "tracerl.response_token_ids": [7]})
    put(store, "spans", spans_table([gw_span]), "gateway")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (stats.rollouts_seen, stats.transitions_written, stats.rollouts_pending) == (1, 1, 0)
    [row] = transitions(store)
    assert (row["rollout_id"], row["token_source"], row["prompt_token_ids"]) == ("run-7", "gateway", [5, 6])

    late = TraceBuilder("9" * 32, rollout_id="9" * 32, received_at_ns=500 * S)
    late._n = 60
    put(store, "spans", spans_table([late.span("late gateway", call, {"tracerl.gateway": True})]), "late")
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (again.late_spans, again.rollouts_pending, again.transitions_written) == (1, 0, 0)


def test_convert_loop_converts_in_the_background_and_on_stop(store: Path) -> None:
    import time as _time

    from span_to_transition.convert_loop import ConvertLoop

    put(store, "spans", spans_table(rollout("1" * 32, 1_000)), "a")
    seen = []
    loop = ConvertLoop(parse_store(store), ConvertConfig(quiet_s=0), every_s=60, on_stats=seen.append).start()
    loop.poke()
    deadline = _time.monotonic() + 30
    while not seen and _time.monotonic() < deadline:
        _time.sleep(0.05)
    assert seen and seen[0].transitions_written == 1
    put(store, "spans", spans_table(rollout("2" * 32, 2_000)), "b")
    loop.stop()  # the final pass picks up what arrived since
    assert loop.last_error is None and len(transitions(store)) == 2


def side_reward(reward_id: str, value: float, *, rollout_id: str | None = None, trace_id: str | None = None) -> pa.Table:
    return pa.Table.from_pylist([{"reward_id": reward_id, "rollout_id": rollout_id, "trace_id": trace_id,
                                  "span_id": None, "response_id": None, "name": "judge", "value": value,
                                  "source": "side_channel", "at": None}], schema=REWARDS_SCHEMA)


def raw_rows(store: Path) -> int:
    return sum(pa.parquet.read_metadata(f).num_rows
               for f in StoreLayout.at(store).table("transitions").rglob("*.parquet"))


def test_a_reward_after_conversion_converts_the_rollout_again(store: Path) -> None:
    put(store, "spans", spans_table(rollout("a" * 32, 100 * S) + rollout("b" * 32, 100 * S)), "a")
    first = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert first.transitions_written == 2
    before = {r["rollout_id"]: r for r in transitions(store)}

    put(store, "rewards", side_reward("j1", 0.5, trace_id="a" * 32), "late")  # the judge answers later
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (again.rollouts_reconverted, again.transitions_written, again.late_spans) == (1, 1, 0)
    assert "converted again" in again.summary()
    after = {r["rollout_id"]: r for r in transitions(store)}
    assert (after["a" * 32]["reward"], after["a" * 32]["reward_source"]) == (1.5, "side_channel,span")
    assert after["b" * 32] == before["b" * 32]  # untouched
    assert raw_rows(store) == 3  # the superseded row stays in its file; the view hides it
    con = connect_readonly(parse_store(store))
    assert con.execute("SELECT count(*), sum(reward) FROM transitions").fetchone() == (2, 2.5)
    assert con.execute("SELECT reward FROM rollouts WHERE rollout_id = ?", ["a" * 32]).fetchone() == (1.5,)

    settled = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)  # the reward file is applied once
    assert (settled.rollouts_reconverted, settled.transitions_written) == (0, 0)

    compacted = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER, rebuild=True)
    assert (compacted.rollouts_reconverted, compacted.files_removed, raw_rows(store)) == (2, 1, 2)
    assert {r["rollout_id"]: r["reward"] for r in transitions(store)} == {"a" * 32: 1.5, "b" * 32: 1.0}


def test_rebuild_applies_changed_settings_to_converted_rows(store: Path) -> None:
    t = TraceBuilder("c" * 32, received_at_ns=100 * S)
    root = t.span("invoke_agent writer", agent="writer")
    t.chat(root, [user("draft")], "v1", response_id="w1")
    t.chat(t.span("invoke_agent checker", root, agent="checker"), [user("check")], "ok", response_id="c1")
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert [r["trainable"] for r in transitions(store)] == [True, True]

    narrowed = ConvertConfig(quiet_s=0, agents="writer", credit="last_call")
    kept = convert_store(parse_store(store), narrowed, now_ns=LATER)  # without --rebuild: says so, changes nothing
    assert kept.transitions_written == 0
    assert "--agents None -> 'writer'" in kept.settings_changed and "--credit 'identical' -> 'last_call'" in \
        kept.settings_changed and "--rebuild" in kept.summary()

    rebuilt = convert_store(parse_store(store), narrowed, now_ns=LATER, rebuild=True)
    assert (rebuilt.rollouts_reconverted, rebuilt.transitions_written) == (1, 2)
    rows = sorted(transitions(store), key=lambda r: r["step"])
    assert [(r["agent_name"], r["trainable"], r["reward"]) for r in rows] == [("writer", True, 0.0),
                                                                              ("checker", False, 1.0)]
    assert raw_rows(store) == 2  # the same rows' file (named by their ids) was replaced in place
    assert convert_store(parse_store(store), narrowed, now_ns=LATER).settings_changed is None  # the rows match again


@pytest.mark.slow
def test_cli_rebuild(store: Path) -> None:
    put(store, "spans", spans_table(rollout("d" * 32, 100 * S)), "a")
    tracerl("convert", "--store", str(store), "--quiet-s", "0")
    out = tracerl("convert", "--store", str(store), "--quiet-s", "0", "--rebuild", "--agents", "b").stdout
    assert "converted 1 rollouts" in out and "converted again" in out
    assert [r["trainable"] for r in transitions(store)] == [False]


def test_link_rollouts_joins_linked_traces_under_their_origin() -> None:
    assert link_rollouts([("b", "a"), ("c", "b")], {}) == {"b": "a", "c": "a"}
    assert link_rollouts([("b", "a"), ("c", "b")], {"c": "run-7"}) == {"a": "run-7", "b": "run-7"}
    assert link_rollouts([("x", "y"), ("x", "z")], {}) == {"x": "y", "z": "y"}  # two origins: the smaller
    # a later pass sees only the new trace's link; the earlier pass's pair keeps the rollout id
    first = link_rollouts([("b", "a")], {})
    assert link_rollouts([("c", "b")], first) == {"c": "a"}


def linked(trace_id: str, to: tuple[str, str] | None, *, call: str | None, reward: bool = False) -> pa.Table:
    """One AutoGen-style trace: a message-processing root span linked to its sender's span."""
    t = TraceBuilder(trace_id, received_at_ns=100 * S)
    root = t.span("autogen process", agent="solver" if call else None)
    if call:
        t.chat(root, [user("task q")], call, response_id=f"r-{call}")
    if reward:
        t.reward(root, 1.0)
    table = spans_table(t.spans)
    links = [[{"trace_id": to[0], "span_id": to[1], "trace_state": None, "attributes": []}]
             if to and s.span_id == root.span_id else [] for s in t.spans]
    return table.set_column(table.schema.get_field_index("links"), "links",
                            pa.array(links, table.schema.field("links").type))


def test_traces_joined_by_span_links_convert_as_one_rollout(store: Path) -> None:
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    put(store, "spans", linked(a, None, call=None), "a")
    put(store, "spans", linked(c, (b, "0" * 15 + "1"), call="second", reward=True), "c")  # arrives before b
    put(store, "spans", linked(b, (a, "0" * 15 + "1"), call="first"), "b")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (stats.rollouts_converted, stats.transitions_written) == (1, 2)
    rows = sorted(transitions(store), key=lambda r: r["step"])
    assert [(r["rollout_id"], r["trace_id"], r["reward"]) for r in rows] == [(a, b, 1.0), (a, c, 1.0)]

    apart = store.parent / "apart"
    for name, table in (("a", linked(a, None, call=None)), ("c", linked(c, (b, "1"), call="second", reward=True)),
                        ("b", linked(b, (a, "1"), call="first"))):
        put(apart, "spans", table, name)
    split = convert_store(parse_store(apart), ConvertConfig(quiet_s=0, follow_links=False), now_ns=LATER)
    assert (split.rollouts_converted, split.rollouts_excluded_no_reward) == (1, 1)  # b alone has no reward
