"""The viewer's pure parts: filters → SQL parameters, colour scales, timeline layout, charts, messages."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import duckdb
import pytest

from ui.charts import Series, line_chart, nice_ticks
from ui.colors import (
    ADVANTAGE_SCALE,
    LOGPROB_SCALE,
    advantage_bucket,
    logprob_bucket,
    scale_css,
    token_classes,
)
from ui.filters import FilterError, RolloutQuery, parse_query, rollouts_sql
from ui.messages import messages, tool_names
from ui.timeline import layout, span_kind, ticks


def test_filters_parse_into_typed_values_and_round_trip_as_link_parameters():
    q = parse_query({"task": "t-1", "version": "3", "reward_min": "0.25", "reward_max": "1", "sort": "reward",
                     "order": "asc", "page": "2", "since": "2026-11-24T13:05", "token_source": "retokenized",
                     "agent": ""})
    assert q == RolloutQuery(task="t-1", version=3, reward_min=0.25, reward_max=1.0, sort="reward", desc=False,
                             page=2, since=datetime(2026, 11, 24, 13, 5, tzinfo=timezone.utc),
                             token_source="retokenized")
    assert parse_query(q.params()) == q
    assert q.params(page=1)["sort"] == "reward" and "page" not in q.params(page=1)


@pytest.mark.parametrize("params, field", [
    ({"reward_min": "abc"}, "reward_min"), ({"reward_max": "nan"}, "reward_max"), ({"version": "1.5"}, "version"),
    ({"version": "-1"}, "version"), ({"page": "0"}, "page"), ({"page_size": "10000"}, "page_size"),
    ({"sort": "reward; DROP TABLE x"}, "sort"), ({"order": "sideways"}, "order"), ({"since": "yesterday"}, "since"),
    ({"token_source": "guess"}, "token_source"), ({"reward_min": "2", "reward_max": "1"}, "reward_min"),
    ({"where": "1=1"}, "where"),
])
def test_a_bad_filter_value_names_the_field(params, field):
    with pytest.raises(FilterError, match=field):
        parse_query(params)


def test_filter_values_are_parameters_never_sql_text():
    evil = "x' OR '1'='1"
    sql, params = rollouts_sql(parse_query({"task": evil, "agent": evil}))
    assert evil not in sql and params["task"] == evil and params["agent"] == evil
    con = duckdb.connect()  # the statement runs as written against a table shaped like the reader's ui_rollouts
    con.execute("""CREATE TABLE ui_rollouts AS SELECT * FROM (VALUES
        ('r1', 'x'' OR ''1''=''1', 1.0, 2, 2, ['a'], 0, 1.0, TIMESTAMPTZ '2026-11-24 10:00:00+00', NULL::TIMESTAMPTZ,
         ['gateway']),
        ('r2', 'other', 0.0, 1, 1, ['b'], 0, 0.5, TIMESTAMPTZ '2026-11-24 11:00:00+00', NULL::TIMESTAMPTZ,
         ['gateway', 'retokenized']))
        t(rollout_id, task_id, reward, n_calls, n_trainable, agents, version, token_coverage, started_at,
          ended_at, token_sources)""")
    rows = con.execute(sql, params).fetchall()
    assert rows[0][0] == 0  # the task equals the literal text; no row's agent is the literal text
    sql, params = rollouts_sql(parse_query({"task": evil}))
    assert [r[5] for r in con.execute(sql, params).fetchall()] == ["r1"]
    sql, params = rollouts_sql(parse_query({"token_source": "retokenized", "sort": "reward", "order": "asc"}))
    first = con.execute(sql, params).fetchall()[0]
    assert first[:5] == (1, 0, 1, 0, 0) and first[5] == "r2"  # totals: 1 match, 1 with inexact tokens


def test_logprob_buckets_follow_the_probability_and_cover_the_range():
    assert logprob_bucket(0.0) == len(LOGPROB_SCALE) - 1
    assert logprob_bucket(math.log(0.6)) == 5 and logprob_bucket(math.log(0.04)) == 0
    assert logprob_bucket(-1e9) == 0 and logprob_bucket(None) is None and logprob_bucket(math.nan) is None
    assert logprob_bucket(0.3) == len(LOGPROB_SCALE) - 1  # a positive logprob (rounding) is p = 1
    values = [logprob_bucket(math.log(p)) for p in (0.01, 0.07, 0.15, 0.3, 0.4, 0.6, 0.8, 0.95)]
    assert values == list(range(len(LOGPROB_SCALE)))


def test_advantage_buckets_are_diverging_around_zero():
    assert advantage_bucket(0.0) == 3 and ADVANTAGE_SCALE[3].label == "≈ 0"
    assert advantage_bucket(-5) == 0 and advantage_bucket(5) == len(ADVANTAGE_SCALE) - 1
    assert advantage_bucket(0.7071) == 4 and advantage_bucket(-0.7071) == 2 and advantage_bucket(None) is None
    assert token_classes(-0.01, None) == "tok lp-7 adv-na"


def test_scale_css_colours_every_bucket_and_its_legend_swatch():
    css = scale_css()
    for i, b in enumerate(LOGPROB_SCALE):
        assert f".by-lp .tok.lp-{i},.sw-lp-{i}{{background:{b.background};color:{b.text}}}" in css
    for i, b in enumerate(ADVANTAGE_SCALE):
        assert f".by-adv .tok.adv-{i},.sw-adv-{i}{{background:{b.background};" in css
    assert ".by-lp .tok.lp-na" in css and ".by-adv .tok.adv-na" in css


def _span(sid, parent, start, end, name="s", status="unset", **attrs):
    return {"span_id": sid, "parent_span_id": parent, "name": name, "start_time_ns": start, "end_time_ns": end,
            "status_code": status, "status_message": "boom" if status == "error" else None, "attributes": attrs}


def test_timeline_rows_are_in_tree_order_on_a_shared_clock():
    spans = [
        _span("c2", "root", 600, 1000, "execute_tool lookup", "error", **{"gen_ai.tool.name": "lookup"}),
        _span("root", None, 0, 1000, "task"),
        _span("c1", "root", 100, 500, "chat policy", **{"gen_ai.operation.name": "chat"}),
        _span("g", "c1", 150, 450, "tracerl.gateway policy", **{"tracerl.gateway": "true"}),
        _span("orphan", "missing", 200, 300, "late"),
    ]
    rows = layout(spans, {"c1": "t-1"})
    assert [(r.span_id, r.depth) for r in rows] == [("root", 0), ("c1", 1), ("g", 2), ("c2", 1), ("orphan", 0)]
    c1 = rows[1]
    assert (c1.x, c1.width, c1.duration_ms, c1.kind, c1.transition_id) == (0.1, 0.4, 0.0004, "llm", "t-1")
    assert rows[2].kind == "gateway" and rows[3].kind == "tool" and rows[3].error == "boom"
    assert rows[0].error is None and layout([]) == []


def test_span_kinds_and_ticks():
    assert span_kind("invoke_agent writer", {}) == "agent"
    assert span_kind("x", {"gen_ai.operation.name": "chat"}) == "llm" and span_kind("x", {}) == "span"
    assert [label for _, label in ticks(268)] == ["0 ms", "100 ms", "200 ms"]
    assert ticks(4500)[1] == (1000 / 4500, "1 s") and ticks(0) == [(0.0, "0 ms")]


def test_line_chart_scales_points_into_the_plot_and_breaks_lines_at_gaps():
    c = line_chart("Loss", [Series("loss", [(0, 1.0), (1, None), (2, 3.0), (3, 2.0)])])
    left, top, right, bottom = c.plot
    assert not c.empty and c.keys == [("s0", "loss")]
    assert len(c.dots) == 3 and len(c.lines) == 1  # (0, 1) stands alone; (2, 3)-(3, 2) is one line
    xs = [d[1] for d in c.dots]
    assert xs[0] == left and xs[-1] == right
    ys = {d[3].split(": ")[1].split(" ")[0]: d[2] for d in c.dots}
    assert top <= ys["3"] < ys["2"] < ys["1"] <= bottom
    assert line_chart("KL", [Series("kl", [(0, None)])]).empty
    assert nice_ticks(0, 0) == [0.0, 0.25, 0.5, 0.75, 1.0] and nice_ticks(0.2, 0.8)[0] <= 0.2


def test_messages_read_strings_parts_tool_calls_and_tool_results():
    m = messages('[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},'
                 ' {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",'
                 ' "function": {"name": "lookup", "arguments": "{\\"q\\": 1}"}}]},'
                 ' {"role": "tool", "tool_call_id": "c1", "content": "<b>42</b>"}]')
    assert [x.role for x in m] == ["user", "assistant", "tool"]
    assert m[0].text == "hi\n[image_url part]" and m[1].tool_calls[0].name == "lookup"
    assert m[2].tool_call_id == "c1" and m[2].text == "<b>42</b>"  # raw: the template escapes
    assert messages("not json")[0].text == "not json" and messages(None) == []
    assert tool_names('[{"type": "function", "function": {"name": "lookup"}}]') == ["lookup"]


def test_a_group_free_rounds_advantage_comes_from_the_versions_whole_batch():
    """A task page holds one rollout of a task that never repeated: under grpo it has no advantage
    (a group of one); under REINFORCE++ it gets the advantage the trainer gave it, from the batch."""
    from trainer.advantages import RolloutReward, rollout_advantages
    from ui.pages import with_advantages

    batch = [{"rollout_id": f"r{i}", "task_id": f"t{i}", "version": 1, "reward_used": float(i % 2),
              "complete": True, "agents": ["sql"]} for i in range(6)]
    page = [dict(batch[3])]
    with_advantages(page, {1: "grpo"}, lambda v: batch)
    assert page[0]["advantage"] is None and page[0]["estimator"] == "grpo"
    with_advantages(page, {1: "reinforce_plus_plus"}, lambda v: batch)
    trainer = rollout_advantages([RolloutReward(r["rollout_id"], r["task_id"], r["reward_used"], "sql")
                                  for r in batch], "reinforce_plus_plus").advantages
    assert page[0]["advantage"] == pytest.approx(trainer["r3"]) == pytest.approx(1.0)
