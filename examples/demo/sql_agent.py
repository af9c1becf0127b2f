"""The real-model demo's agent: text-to-SQL with two roles, a writer and a rewriter.

The writer turns the question into SQL; the agent's own code runs it on the database (read-only)
and shows the rewriter the rows or the error, and the rewriter repeats or fixes the query. The
SQL runs here, not through a model tool call: SmolLM2-135M cannot make tool calls (0 of 48
parseable in a check with a hermes tool prompt). Prompts are short ChatML turns (the server
applies the model's chat template) with one worked example. An ordinary agent: it knows nothing
of tracerl and records its LLM calls as OTel GenAI spans (genai_chat.py).

Task (JSON on stdin, or as the first argument): {"id", "question", "db", "seed"?}. Prints one
JSON line: {"question", "writer": <draft SQL>, "result": <what it returned>, "sql": <final SQL>}.
"""

import json
import re
import sqlite3

from genai_chat import invoke_agent, read_task, tracer
from sql_reward import run_readonly

SYSTEM = "You write SQLite queries. Reply with one SQL query and nothing else."
SCHEMA = (
    "Tables: customers(id, name, city, signup_date), products(id, name, category, price), "
    "orders(id, customer_id, product_id, quantity, order_date)"
)
# Three worked examples: a text value and a number carried into the WHERE clause, quoted where
# they are text. Their values are in no question of the task set (no city Oslo, no product Widget,
# no price 7), so copying one never earns the reward's on-topic credit; their shapes are three
# templates' (city-names, product-price, price-below). Measured on the untrained writer alone
# (the 30 held-out questions x 4 seeded samples, bare engine, temperature 0.7, 32 tokens):
#   one example "the customer with id 3" -> `WHERE id = 3`: success 0.025, SQL that runs 0.39;
#     it was copied into most answers (`SELECT name FROM customers WHERE id = 3` for "How many
#     customers live in Madrid?"), and under RL the policy collapsed onto it;
#   one example, Oslo: 0.025, runs 0.28; Oslo + Widget: 0.108, 0.43; these three: 0.125, 0.43.
# A date example ('2024-02-14') was copied as well, and its digits matched month questions.
# The shared head is computed once by the server's prefix cache, so the longer prompt costs little.
EXAMPLES = [
    ("Question: Which customers live in Oslo?", "SELECT name FROM customers WHERE city = 'Oslo'"),
    (
        "Question: What is the price of the product Widget?",
        "SELECT price FROM products WHERE name = 'Widget'",
    ),
    ("Question: How many products cost less than 7 euros?", "SELECT COUNT(*) FROM products WHERE price < 7"),
]


def extract_sql(text: str) -> str:
    """The first SELECT statement in a reply: inside a code fence if there is one, up to ';' or a blank line."""
    fenced = re.search(r"```(?:sql)?\s*(.*?)(?:```|$)", text, re.S | re.I)
    body = fenced.group(1) if fenced else text
    m = re.search(r"\bSELECT\b.*", body, re.S | re.I)
    if not m:
        return ""
    return m.group(0).split(";")[0].split("\n\n")[0].strip()


def execute(db: str, sql: str) -> str:
    """What the rewriter is shown: the first rows, or the error."""
    if not sql:
        return "error: no SQL query"
    try:
        rows = run_readonly(db, sql)
    except (sqlite3.Error, sqlite3.Warning, ValueError) as e:
        return f"error: {e}"
    return repr(rows[:5]) + (f" ... ({len(rows)} rows)" if len(rows) > 5 else "")


def writer_messages(question: str) -> list[dict]:
    shots = [
        m
        for i, (q, sql) in enumerate(EXAMPLES)
        for m in (
            {"role": "user", "content": f"{SCHEMA}\n{q}" if i == 0 else q},
            {"role": "assistant", "content": sql},
        )
    ]
    return [
        {"role": "system", "content": SYSTEM},
        *shots,
        {"role": "user", "content": f"Question: {question}"},
    ]


def rewriter_messages(question: str, draft: str, result: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"{SCHEMA}\nQuestion: {question}\nSQL: {draft}\nResult: {result}\n"
            "If the result answers the question, repeat the SQL; otherwise fix it.",
        },
    ]


def main() -> None:
    task = read_task()
    question, seed = task["question"], task.get("seed")
    with tracer.start_as_current_span(
        "sql task", attributes={"demo.task_id": str(task.get("id", ""))}
    ) as span:
        draft = extract_sql(invoke_agent("writer", writer_messages(question), seed))
        result = execute(task["db"], draft)
        fixed = extract_sql(
            invoke_agent(
                "rewriter", rewriter_messages(question, draft, result), None if seed is None else seed + 1
            )
        )
        # the agent's output on its span, as a traced app records its result
        span.set_attribute("demo.answer", fixed or draft)
    print(json.dumps({"question": question, "writer": draft, "result": result, "sql": fixed or draft}))


if __name__ == "__main__":
    main()
