"""The real-model demo's task (examples/demo/sql_*.py, tracerl/demo_tasks.py): pure parts, no model.

The split must keep every held-out question out of training while every query shape appears in
both; the reward must grade gold > runs > broken; the agent must pull the SQL out of what a small
chat model writes around it; the presets must give way to the flags a user passes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tracerl.demo_config import DemoConfig
from tracerl.demo_tasks import DEMO_DIR, held_out_summary, question_of, sql_task

sys.path.insert(0, str(DEMO_DIR))
import sql_agent  # examples/demo
import sql_reward
import sql_tasks


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return sql_tasks.build_db(tmp_path_factory.mktemp("sql") / "shop.db")


def test_held_out_questions_are_never_training_questions_and_every_template_is_in_both(db):
    split = sql_tasks.questions(db)
    train, heldout = split["train"], split["heldout"]
    assert not {t["question"] for t in train} & {t["question"] for t in heldout}
    template = lambda t: t["id"].split("-", 1)[1].rsplit("-", 1)[0]  # noqa: E731
    assert (
        {template(t) for t in heldout}
        == {template(t) for t in train}
        == {tid for tid, *_ in sql_tasks.TEMPLATES}
    )
    assert len(heldout) == 30 and len(train) == 83
    assert all(t["id"].startswith("train-") for t in train) and all(
        t["id"].startswith("heldout-") for t in heldout
    )


def test_every_gold_query_runs_and_seeded_copies_have_distinct_ids_and_seeds(db):
    split = sql_tasks.questions(db)
    for t in split["train"] + split["heldout"]:
        sql_reward.run_readonly(t["db"], t["gold_sql"])
    copies = sql_tasks.with_seeds(split["heldout"], 4)
    assert len(copies) == 120
    assert len({c["id"] for c in copies}) == len({c["seed"] for c in copies}) == 120
    assert {question_of(c["id"]) for c in copies} == {t["id"] for t in split["heldout"]}


def test_reward_is_graded_gold_then_on_topic_then_runs_then_broken(db):
    task = {"db": str(db), "gold_sql": "SELECT COUNT(*) FROM customers WHERE city = 'Berlin'", "value": "Berlin"}
    line = lambda sql: json.dumps({"sql": sql})  # noqa: E731
    assert sql_reward.score(task, line("SELECT COUNT(id) FROM customers WHERE city='Berlin'")) == 1.0
    assert sql_reward.score(task, line("SELECT name FROM customers WHERE city = 'berlin'")) == sql_reward.ON_TOPIC
    # the collapse of the second measured run: a constant valid query earns only RUNS
    assert sql_reward.score(task, line("SELECT name FROM products WHERE id = 3")) == sql_reward.RUNS
    assert sql_reward.score(task, line("SELECT 'Berlin'")) == sql_reward.RUNS  # names it, reads no table
    assert sql_reward.score(task, line("SELECT COUNT(*) FROM customer WHERE city = 'Berlin'")) == 0.0
    assert sql_reward.score(task, "no json") == 0.0
    assert 0 < sql_reward.RUNS < sql_reward.ON_TOPIC < 1


def test_numbers_count_as_named_only_as_whole_numbers():
    assert sql_reward.names_value("SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-03-%'", 3)
    assert sql_reward.names_value("SELECT COUNT(*) FROM products WHERE price > 40", 40)
    assert not sql_reward.names_value("SELECT COUNT(*) FROM products WHERE price > 400", 40)
    assert not sql_reward.names_value("SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-%'", 2)
    assert not sql_reward.names_value("SELECT COUNT(*) FROM products WHERE price > 4.0", 0)


def test_every_task_names_its_value_in_its_gold_query(db):
    split = sql_tasks.questions(db)
    for t in split["train"] + split["heldout"]:
        assert sql_reward.grade(t, t["gold_sql"]) == 1.0
        assert sql_reward.names_value(t["gold_sql"], t["value"]), t["id"]


def test_the_agent_takes_the_first_select_out_of_fences_and_prose():
    assert sql_agent.extract_sql("```sql\nSELECT name FROM products;\n```") == "SELECT name FROM products"
    assert (
        sql_agent.extract_sql("Sure! select city from customers where name = 'Ben'\n\nThis query")
        == "select city from customers where name = 'Ben'"
    )
    assert sql_agent.extract_sql("with products and their price, I would") == ""


def test_the_rewriter_sees_rows_or_the_error(db):
    assert sql_agent.execute(str(db), "SELECT COUNT(*) FROM customers") == "[(12,)]"
    assert sql_agent.execute(str(db), "SELECT nope FROM customers").startswith("error: no such column")
    assert sql_agent.execute(str(db), "").startswith("error")


def test_held_out_summary_counts_success_runs_and_in_group_variance():
    h = held_out_summary({"heldout-a-s0": 1.0, "heldout-a-s1": 0.2, "heldout-b-s0": 0.0, "heldout-b-s1": 0.0})
    assert (h.n, h.success, h.runs) == (4, 0.25, 0.5)
    assert h.mean_reward == pytest.approx(0.3)
    assert h.group_variance == pytest.approx((0.16 + 0.0) / 2)


def test_rounds_walk_the_training_split_and_flags_beat_the_real_preset(tmp_path):
    task = sql_task(tmp_path, rollouts_per_round=32, heldout_samples=4)
    assert task.per_round == 4 and task.group == 8 and len(task.heldout) == 120
    assert task.round_tasks(0) != task.round_tasks(1)
    assert all(t["id"].startswith("train-") for k in range(12) for t in task.round_tasks(k))
    cfg = DemoConfig(lr=1e-3).resolved()
    assert (cfg.lr, cfg.lora_rank, cfg.rounds, cfg.rollouts_per_round, cfg.estimator) == (1e-3, 16, 14, 32, "rloo")
    assert DemoConfig(tiny=True).resolved().lora_rank == 0
    assert (DemoConfig().resolved().engine, DemoConfig(tiny=True).resolved().engine) == ("vllm", "embedded")


def test_before_after_shows_the_largest_gains_one_sample_per_question():
    from tracerl.commands.demo import before_after

    before = {"heldout-a-s0": ("x", 0.0), "heldout-a-s1": ("x", 0.0), "heldout-b-s0": ("y", 0.05),
              "heldout-c-s0": ("z", 1.0)}
    after = {"heldout-a-s0": ("X", 1.0), "heldout-a-s1": ("X", 1.0), "heldout-b-s0": ("Y", 0.2),
             "heldout-c-s0": ("z", 0.0)}
    text = before_after(before, after, 0, 8, n=2)
    assert [ln.strip() for ln in text.splitlines() if ln.startswith("  heldout")] == ["heldout-a-s0", "heldout-b-s0"]
    assert "policy@0 (0.05): y" in text and "policy@8 (0.20): Y" in text
