"""examples/sql_agent: a LangGraph writer/checker/rewriter, instrumented by OpenLLMetry only, through the real stack.

The scripted model answers per role (the role is in the system prompt) and per task (the question in
the user message), so each rollout takes a known path through the graph; the test then checks that
every LLM call became exactly one transition with its LangGraph node as the agent, the gateway's
exact token ids, the checker's tool call and result, and the reward ``reward.py`` gave. The paper
shape (``SQL_AGENT_SHAPE=paper``: writer, a plain execute node, rewriter) gets the same checks,
and that its execute node makes no LLM call.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest
from example_rig import EXAMPLES, example_venv, prompt_text, stored_spans, token_ids

pytestmark = [pytest.mark.slow, pytest.mark.prebuilt("sql_agent")]
EXAMPLE = EXAMPLES / "sql_agent"


def load(name: str):
    """A module of the example (stdlib only), imported by path: the example is not a package."""
    spec = importlib.util.spec_from_file_location(f"sql_agent_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sql_block(sql: str) -> dict:
    return {"content": f"```sql\n{sql}\n```"}


BERLIN_WRONG = "SELECT COUNT(*) FROM customers WHERE city = 'Paris'"
BERLIN_RIGHT = "SELECT COUNT(*) FROM customers WHERE city = 'Berlin'"
PRICIEST = "SELECT name FROM products ORDER BY price DESC LIMIT 1"
BOOKS_BROKEN = "SELEC name FROM products WHERE category = 'books'"
BOOKS_WRONG = "SELECT name FROM products WHERE category = 'toys' ORDER BY name"
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "run_query", "arguments": json.dumps({"query": BERLIN_WRONG})}}
FIX = "FIX: it counts Paris, not Berlin."

# task id -> role -> the role's answers in order (the checker answers twice when it uses its tool)
PLANS: dict[str, dict[str, list[dict]]] = {
    # the writer is wrong; the checker runs the query, says FIX; the rewriter fixes it: reward 1
    "customers-berlin": {"writer": [sql_block(BERLIN_WRONG)], "checker": [{"tool_calls": [TOOL_CALL]}, {"content": FIX}],
                         "rewriter": [sql_block(BERLIN_RIGHT)]},
    # the writer is right, the checker says OK: reward 1
    "priciest-product": {"writer": [sql_block(PRICIEST)], "checker": [{"content": "OK"}]},
    # the checker passes a broken query; it fails to execute; the rewriter's query runs but is wrong: reward 0
    "books-alpha": {"writer": [sql_block(BOOKS_BROKEN)], "checker": [{"content": "OK"}],
                    "rewriter": [sql_block(BOOKS_WRONG)]},
}
EXPECTED_AGENTS = {"customers-berlin": ["writer", "checker", "checker", "rewriter"],
                   "priciest-product": ["writer", "checker"],
                   "books-alpha": ["writer", "checker", "rewriter"]}
EXPECTED_REWARD = {"customers-berlin": 1.0, "priciest-product": 1.0, "books-alpha": 0.0}
ROLES = {"SQL writer": "writer", "SQL checker": "checker", "SQL rewriter": "rewriter"}


def role_of(body: dict) -> str:
    system = body["messages"][0]["content"]
    return next(role for marker, role in ROLES.items() if marker in system)


def make_script(tasks: list[dict]):
    by_question = {t["question"]: t["id"] for t in tasks}

    def script(body: dict) -> dict:
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        task_id = next(tid for q, tid in by_question.items() if f"Question: {q}" in user)
        role = role_of(body)
        turn = sum(m["role"] == "tool" for m in body["messages"]) if role == "checker" else 0
        return PLANS[task_id][role][turn]

    return script


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return load("make_db").build(tmp_path_factory.mktemp("sql") / "shop.db")


def test_make_db_is_deterministic_and_every_gold_query_scores_one(db: Path, tmp_path: Path) -> None:
    again = load("make_db").build(tmp_path / "again.db")
    dump = [list(sqlite3.connect(p).iterdump()) for p in (db, again)]
    assert dump[0] == dump[1]
    reward = load("reward")
    tasks = load("make_tasks").make_tasks(db)
    assert len({t["id"] for t in tasks}) == len(tasks) == 10
    for t in tasks:
        assert reward.score(t, json.dumps({"sql": t["gold_sql"]})) == 1.0, t["id"]
    by_id = {t["id"]: t for t in tasks}
    books = by_id["books-alpha"]
    assert reward.score(books, json.dumps({"sql": "SELECT name FROM products WHERE category = 'books' "
                                                  "ORDER BY name DESC"})) == 0.0  # gold has ORDER BY
    assert reward.score(by_id["never-ordered"], json.dumps({"sql": "SELECT 'Lea'"})) == 1.0  # results, not text
    assert reward.score(books, json.dumps({"sql": BOOKS_BROKEN})) == 0.0
    assert reward.score(books, "no json\n") == 0.0
    assert reward.score(books, json.dumps({"sql": "DELETE FROM products"})) == 0.0  # read-only
    assert reward.score(books, json.dumps({"sql": books["gold_sql"]})) == 1.0


def test_each_llm_call_is_one_transition_with_its_langgraph_node_tokens_tools_and_reward(stack_factory, db) -> None:
    bin_dir = example_venv("sql_agent")
    tasks = [t for t in load("make_tasks").make_tasks(db) if t["id"] in PLANS]
    stack = stack_factory(make_script(tasks))
    stack.rollout(bin_dir, ["python", str(EXAMPLE / "agent.py")], tasks,
                  rollout_args=("--reward", f"{EXAMPLE / 'reward.py'}:score"))
    rows = stack.transitions(agents="writer|rewriter")

    requests = {prompt_text(r): r for r in stack.engine.requests}
    assert len(rows) == len(stack.engine.requests) == sum(map(len, EXPECTED_AGENTS.values()))  # no duplicates
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    assert {tid: [r["agent_name"] for r in rs] for tid, rs in by_task.items()} == EXPECTED_AGENTS
    answers = {tid: [a for role in dict.fromkeys(EXPECTED_AGENTS[tid]) for a in PLANS[tid][role]]
               for tid in PLANS}  # each role's answers, in the order the roles first speak
    for tid, rs in by_task.items():
        assert [r["step"] for r in rs] == list(range(len(rs)))
        assert [r["is_last"] for r in rs] == [False] * (len(rs) - 1) + [True]
        for row, answer in zip(rs, answers[tid]):
            request = requests[bytes(row["prompt_token_ids"]).decode()]  # the gateway joined this very call
            assert role_of(request) == row["agent_name"]
            assert row["token_source"] == "gateway"
            text = (answer.get("content") or "") + (json.dumps(answer["tool_calls"], sort_keys=True)
                                                    if "tool_calls" in answer else "")
            assert row["response_token_ids"] == token_ids(text)
            assert json.loads(row["response_message"]) == {"role": "assistant", "content": None, **answer}
            assert row["finish_reason"] == ("tool_calls" if "tool_calls" in answer else "stop")
            assert row["trainable"] is (row["agent_name"] in ("writer", "rewriter"))
            assert row["reward"] == row["rollout_reward"] == EXPECTED_REWARD[tid]
            assert row["model"] == "policy"
            tools = json.loads(row["tools"]) if row["tools"] else []
            assert [t["function"]["name"] for t in tools] == (["run_query"] if row["agent_name"] == "checker" else [])

    # the checker's second turn sees its tool call and the query's real result on the database
    second = json.loads(by_task["customers-berlin"][2]["prompt_messages"])
    assert second[0]["role"] == "system" and "SQL checker" in second[0]["content"]
    assert second[-2:] == [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                           {"role": "tool", "content": json.dumps({"columns": ["COUNT(*)"], "rows": [[3]]}),
                            "tool_call_id": "call_1"}]
    # the rewriter gets the checker's verdict, or the execution error
    assert FIX in json.loads(by_task["customers-berlin"][3]["prompt_messages"])[-1]["content"]
    assert 'near "SELEC": syntax error' in json.loads(by_task["books-alpha"][2]["prompt_messages"])[-1]["content"]
    records = [json.loads(line) for f in (stack.store / "rollouts").glob("*.jsonl") for line in f.open()]
    assert {r["task_id"]: r["reward"] for r in records} == EXPECTED_REWARD


# -- the paper shape: writer -> execute (plain code) -> rewriter ------------------------------------

SCHEMA_LINE = ("Tables: customers(id, name, city, signup_date), products(id, name, category, price), "
               "orders(id, customer_id, product_id, quantity, order_date)")
# task id -> (the writer's reply, the rewriter's reply): the replies of a small model, prose around the SQL
PAPER_PLANS = {
    # the writer counts Paris and chats on; the rewriter sees the count and fixes it in a fence: reward 1
    "customers-berlin": (f"{BERLIN_WRONG};\n\nThis counts the customers.", f"Fixed:\n```sql\n{BERLIN_RIGHT}\n```"),
    # the writer is right; the rewriter repeats it as inline code inside prose: reward 1
    "priciest-product": (PRICIEST, f"You can use `{PRICIEST}` to get it."),
    # the writer's query fails; the rewriter answers prose with no query, so the draft stands: reward 0
    "books-alpha": (f"```sql\n{BOOKS_BROKEN}\n```", "I am not sure what the error means."),
}
REWRITE_ASK = "If the result answers the question, repeat the SQL; otherwise fix it."


def paper_script(tasks: list[dict]):
    by_question = {t["question"]: t["id"] for t in tasks}

    def script(body: dict) -> dict:
        user = body["messages"][-1]["content"]
        task_id = next(tid for q, tid in by_question.items() if f"Question: {q}" in user)
        return {"content": PAPER_PLANS[task_id][REWRITE_ASK in user]}

    return script


def test_paper_shape_makes_two_llm_calls_named_writer_and_rewriter_around_a_plain_execute_node(
        stack_factory, db) -> None:
    bin_dir = example_venv("sql_agent")
    tasks = [t for t in load("make_tasks").make_tasks(db) if t["id"] in PAPER_PLANS]
    stack = stack_factory(paper_script(tasks))
    stack.rollout(bin_dir, ["python", str(EXAMPLE / "agent.py")], tasks,
                  extra_env={"SQL_AGENT_SHAPE": "paper", "SQL_AGENT_TEMPERATURE": "0.7", "SQL_AGENT_MAX_TOKENS": "32"},
                  rollout_args=("--reward", f"{EXAMPLE / 'reward.py'}:score"))
    rows = stack.transitions(agents="writer|rewriter")

    assert len(rows) == len(stack.engine.requests) == 2 * len(PAPER_PLANS)  # two calls a rollout, no duplicates
    assert {(b.get("max_completion_tokens"), b["temperature"], "tools" in b) for b in stack.engine.requests} == {
        (32, 0.7, False)}  # langchain-openai sends max_tokens as max_completion_tokens
    requests = {prompt_text(r): r for r in stack.engine.requests}
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    assert {tid: [r["agent_name"] for r in rs] for tid, rs in by_task.items()} == {
        tid: ["writer", "rewriter"] for tid in PAPER_PLANS}
    expected_reward = {"customers-berlin": 1.0, "priciest-product": 1.0, "books-alpha": 0.0}
    for tid, (writer, rewriter) in by_task.items():
        question = next(t["question"] for t in tasks if t["id"] == tid)
        assert [r["step"] for r in (writer, rewriter)] == [0, 1] and rewriter["is_last"]
        for row, reply in zip((writer, rewriter), PAPER_PLANS[tid], strict=True):
            assert bytes(row["prompt_token_ids"]).decode() in requests  # the gateway joined this very call
            assert row["token_source"] == "gateway" and row["trainable"] is True
            assert row["response_token_ids"] == token_ids(reply)
            assert json.loads(row["response_message"]) == {"role": "assistant", "content": reply}
            assert row["finish_reason"] == "stop" and row["tools"] is None
            assert row["reward"] == row["rollout_reward"] == expected_reward[tid]
        # the writer: one-line system, one-line schema (from the database), one worked example, the question
        wprompt = json.loads(writer["prompt_messages"])
        assert [m["role"] for m in wprompt] == ["system", "user", "assistant", "user"]
        assert wprompt[1]["content"].startswith(SCHEMA_LINE + "\nQuestion: ")
        assert wprompt[3]["content"] == f"Question: {question}"
        # the rewriter sees the writer's extracted SQL and what executing it returned
        (rsys, ruser) = json.loads(rewriter["prompt_messages"])
        assert rsys["content"] == wprompt[0]["content"]
        assert ruser["content"].startswith(f"{SCHEMA_LINE}\nQuestion: {question}\nSQL: ")
    shown = {tid: json.loads(rs[1]["prompt_messages"])[1]["content"] for tid, rs in by_task.items()}
    assert f"SQL: {BERLIN_WRONG}\nResult: [[3]]\n" in shown["customers-berlin"]  # the real count of Paris
    assert f"SQL: {PRICIEST}\nResult: [[\"Drone\"]]\n" in shown["priciest-product"]
    assert f'SQL: {BOOKS_BROKEN}\nResult: error: near "SELEC": syntax error\n' in shown["books-alpha"]
    records = [json.loads(line) for f in (stack.store / "rollouts").glob("*.jsonl") for line in f.open()]
    assert {r["task_id"]: r["reward"] for r in records} == expected_reward

    # the execute node ran in every rollout, as a LangGraph node span of its own with no LLM call below it
    spans = stored_spans(stack.store)
    node = "traceloop.association.properties.langgraph_node"
    for tid, (writer, _) in by_task.items():
        mine = [s for s in spans if s["rollout_id"] == writer["rollout_id"]]
        nodes = {s["span_id"]: s["attributes"]["traceloop.entity.name"] for s in mine
                 if s["attributes"].get("traceloop.span.kind") == "task"
                 and s["attributes"].get("traceloop.entity.name") == s["attributes"].get(node)}
        assert sorted(nodes.values()) == ["execute", "rewriter", "writer"], tid
        chats = [s for s in mine if s["name"] == "ChatOpenAI.chat"]
        assert sorted(nodes[s["parent_span_id"]] for s in chats) == ["rewriter", "writer"], tid
