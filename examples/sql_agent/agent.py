"""A text-to-SQL agent in LangGraph: a writer, a checker with a query tool, and a rewriter.

An ordinary LangChain/LangGraph program that knows nothing of tracerl: ``opentelemetry-instrument``
exports its spans (OpenLLMetry's LangChain and OpenAI instrumentations) and environment variables
say where the model (OPENAI_BASE_URL, OPENAI_API_KEY) and the collector
(OTEL_EXPORTER_OTLP_ENDPOINT) are. Each LLM call runs inside its LangGraph node, so training can
attribute it to the role that made it.

Two shapes (``SQL_AGENT_SHAPE``). ``checker`` (the default) needs a model that makes tool calls::

    START -> writer -> checker --(tool call)--> check_tools -> checker
                          |--(FIX: ...)--> rewriter -> execute
                          '--(OK)--------------------> execute --(error, rewrites left)--> rewriter
                                                          '--> END

``paper`` is the Agent Lightning paper's shape, for a small model that cannot (SmolLM2-135M made
0 of 48 parseable tool calls): the SQL runs in a plain node of the agent's own code, between the
two LLM roles, and the rewriter sees the rows or the error and repeats or fixes the query. Short
prompts: a one-line system message, a one-line schema, one worked example::

    START -> writer -> execute -> rewriter -> END

Task (JSON on stdin): {"id", "question", "db", "seed"?} (other keys, e.g. the reward's
``gold_sql``, are ignored; ``seed`` makes the samples reproducible, for a fixed evaluation).
Prints one JSON line: {"id", "question", "sql", "rows", "error"} (checker), or {"id", "question",
"draft", "result", "sql"} (paper: the writer's query, what it returned, the final query).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode

SHAPES = ("checker", "paper")
SHAPE = os.environ.get("SQL_AGENT_SHAPE", "checker")
MODEL = os.environ.get("SQL_AGENT_MODEL", "policy")
TEMPERATURE = float(os.environ.get("SQL_AGENT_TEMPERATURE", "1.0"))
MAX_TOKENS = int(os.environ.get("SQL_AGENT_MAX_TOKENS", "256"))
MAX_REWRITES = 2  # rewrites in all, after a FIX or a failed execution
MAX_CHECKS = 3  # checker turns (each tool result is one more turn) before its last word stands
TOOL_ROWS = 5  # rows the checker's tool shows

WRITER = ("You are the SQL writer. Write one SQLite query that answers the question over the schema. "
          "Reply with the query only, in a ```sql block.")
CHECKER = ("You are the SQL checker. Review the query written for the question. You may call run_query to "
           "execute it and see its first rows. Then answer OK if it answers the question, or FIX: and what "
           "is wrong.")
REWRITER = ("You are the SQL rewriter. The query below is wrong. Write a corrected SQLite query that answers "
            "the question. Reply with the query only, in a ```sql block.")

# the paper shape's prompts, as examples/demo/sql_agent.py's (measured there on SmolLM2-135M: with these,
# about a third of its queries run); the schema line comes from the database (schema_line)
SYSTEM = "You write SQLite queries. Reply with one SQL query and nothing else."
# the demo's worked example (examples/demo/sql_agent.py says why this one: its value is in no question)
EXAMPLE = ("Question: Which customers live in Oslo?", "SELECT name FROM customers WHERE city = 'Oslo'")


class SQLState(TypedDict, total=False):
    question: str
    schema: str
    sql: str
    review: Annotated[list[AnyMessage], add_messages]  # the checker's conversation, with tool results
    rows: list[list[Any]]
    error: str | None
    result: str  # what the rewriter is shown of the execution: the first rows, or the error
    draft: str  # paper shape: the writer's query
    rewrites: int


def read_task() -> dict:
    """The task from stdin (the driver's default), else $TRACERL_TASK."""
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    return json.loads(text.strip() or os.environ["TRACERL_TASK"])


def run_sql(db: str, sql: str, limit: int) -> tuple[list[str], list[list[Any]]]:
    """Column names and the first ``limit`` rows of ``sql``, on a read-only connection (nothing the model
    writes can change the database); raises ``sqlite3.Error``."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cur = con.execute(sql)
        return [d[0] for d in cur.description or ()], [list(r) for r in cur.fetchmany(limit)]
    finally:
        con.close()


def schema_of(db: str) -> str:
    """The CREATE TABLE statements, as the model sees the database."""
    return "\n".join(r[0] for r in run_sql(db, "SELECT sql FROM sqlite_master WHERE type = 'table'", 100)[1])


def schema_line(db: str) -> str:
    """The schema on one line, as the paper shape's prompts show it: ``Tables: customers(id, name, ...), ...``."""
    tables = run_sql(db, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid", 100)[1]
    cols = {t: [r[1] for r in run_sql(db, f"PRAGMA table_info('{t}')", 100)[1]] for (t,) in tables}
    return "Tables: " + ", ".join(f"{t}({', '.join(c)})" for t, c in cols.items())


def extract_sql(text: str) -> str:
    """The query of a reply: from the first SELECT (inside its first code fence if there is one) up to ';', a
    blank line or a backtick (a small model wraps queries in prose and inline code); a fenced query with no
    SELECT is kept as it is (it fails to execute, and the error says why); prose with no query gives ''."""
    fenced = re.search(r"```(?:sql)?\s*(.*?)(?:```|$)", text, re.S | re.I)
    body = fenced.group(1) if fenced else text
    m = re.search(r"\bSELECT\b.*", body, re.S | re.I)
    if m:
        return m.group(0).split(";")[0].split("\n\n")[0].split("`")[0].strip()
    return body.strip() if fenced else ""


def execute_sql(db: str, sql: str) -> dict:
    """The ``execute`` node's update: the rows, or the error, and the text the rewriter is shown of them."""
    if not sql:
        return {"rows": [], "error": "no SQL query", "result": "error: no SQL query"}
    try:
        rows = run_sql(db, sql, 100)[1]
    except (sqlite3.Error, sqlite3.Warning, ValueError) as e:  # ValueError: a NUL byte in the query
        return {"rows": [], "error": str(e), "result": f"error: {e}"}
    more = f" ... ({len(rows)} rows)" if len(rows) > 5 else ""
    return {"rows": rows, "error": None, "result": json.dumps(rows[:5], default=str) + more}


def make_run_query(db: str) -> BaseTool:
    """The checker's tool: run a query on the task's database and show its first rows (or the error)."""

    @tool
    def run_query(query: str) -> str:
        """Execute a SQLite query on the database and return its first rows as JSON, or the error."""
        try:
            cols, rows = run_sql(db, query, TOOL_ROWS)
        except sqlite3.Error as e:
            return f"error: {e}"
        return json.dumps({"columns": cols, "rows": rows}, default=str)

    return run_query


def build_graph(db: str, llm: ChatOpenAI) -> CompiledStateGraph:
    """The LangGraph ``StateGraph`` of the three roles; one node per role, named after it."""
    tools = [make_run_query(db)]
    checker_llm = llm.bind_tools(tools)

    def task_text(state: SQLState) -> str:
        return f"Schema:\n{state['schema']}\n\nQuestion: {state['question']}"

    def writer(state: SQLState) -> dict:
        reply = llm.invoke([SystemMessage(WRITER), HumanMessage(task_text(state))])
        return {"sql": extract_sql(reply.text)}

    def checker(state: SQLState) -> dict:
        review = state.get("review") or []  # after a tool call: the conversation so far, with its result
        new = [] if review else [SystemMessage(CHECKER), HumanMessage(f"{task_text(state)}\n\nQuery:\n{state['sql']}")]
        reply = checker_llm.invoke([*review, *new])
        return {"review": [*new, reply]}

    def after_checker(state: SQLState) -> str:
        last = state["review"][-1]
        turns = sum(isinstance(m, AIMessage) for m in state["review"])
        if isinstance(last, AIMessage) and last.tool_calls and turns < MAX_CHECKS:
            return "check_tools"
        return "rewriter" if last.text.strip().upper().startswith("FIX") else "execute"

    def rewriter(state: SQLState) -> dict:
        why = f"It failed: {state['error']}" if state.get("error") else f"The checker says: {state['review'][-1].text}"
        reply = llm.invoke([SystemMessage(REWRITER),
                            HumanMessage(f"{task_text(state)}\n\nQuery:\n{state['sql']}\n\n{why}")])
        return {"sql": extract_sql(reply.text), "rewrites": state.get("rewrites", 0) + 1, "error": None}

    def execute(state: SQLState) -> dict:
        return execute_sql(db, state["sql"])

    def after_execute(state: SQLState) -> str:
        return "rewriter" if state.get("error") and state.get("rewrites", 0) < MAX_REWRITES else END

    g = StateGraph(SQLState)
    g.add_node("writer", writer)
    g.add_node("checker", checker)
    g.add_node("check_tools", ToolNode(tools, messages_key="review"))
    g.add_node("rewriter", rewriter)
    g.add_node("execute", execute)
    g.add_edge(START, "writer")
    g.add_edge("writer", "checker")
    g.add_conditional_edges("checker", after_checker, ["check_tools", "rewriter", "execute"])
    g.add_edge("check_tools", "checker")
    g.add_edge("rewriter", "execute")
    g.add_conditional_edges("execute", after_execute, ["rewriter", END])
    return g.compile()


def build_paper_graph(db: str, llm: ChatOpenAI) -> CompiledStateGraph:
    """The paper's shape: writer -> execute (plain code, no model tool call) -> rewriter; one node per role."""
    schema = schema_line(db)

    def writer(state: SQLState) -> dict:
        reply = llm.invoke([SystemMessage(SYSTEM), HumanMessage(f"{schema}\n{EXAMPLE[0]}"), AIMessage(EXAMPLE[1]),
                            HumanMessage(f"Question: {state['question']}")])
        sql = extract_sql(reply.text)
        return {"sql": sql, "draft": sql}

    def execute(state: SQLState) -> dict:
        return execute_sql(db, state["sql"])

    def rewriter(state: SQLState) -> dict:
        reply = llm.invoke([SystemMessage(SYSTEM), HumanMessage(
            f"{schema}\nQuestion: {state['question']}\nSQL: {state['sql']}\nResult: {state['result']}\n"
            "If the result answers the question, repeat the SQL; otherwise fix it.")])
        return {"sql": extract_sql(reply.text) or state["sql"]}  # no query in the reply: keep the draft

    g = StateGraph(SQLState)
    g.add_node("writer", writer)
    g.add_node("execute", execute)
    g.add_node("rewriter", rewriter)
    g.add_edge(START, "writer")
    g.add_edge("writer", "execute")
    g.add_edge("execute", "rewriter")
    g.add_edge("rewriter", END)
    return g.compile()


def main() -> None:
    if SHAPE not in SHAPES:
        sys.exit(f"SQL_AGENT_SHAPE={SHAPE!r} is not a shape; use one of {', '.join(SHAPES)}")
    task = read_task()
    llm = ChatOpenAI(model=MODEL, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,  # OPENAI_BASE_URL/_API_KEY
                     seed=task.get("seed"))
    if SHAPE == "paper":
        state = build_paper_graph(task["db"], llm).invoke({"question": task["question"]})
        out = {"draft": state.get("draft"), "result": state.get("result"), "sql": state.get("sql")}
    else:
        state = build_graph(task["db"], llm).invoke({"question": task["question"], "schema": schema_of(task["db"])},
                                                    {"recursion_limit": 25})
        out = {"sql": state.get("sql"), "rows": state.get("rows", []), "error": state.get("error")}
    print(json.dumps({"id": task.get("id"), "question": task["question"], **out}, default=str))


if __name__ == "__main__":
    main()
