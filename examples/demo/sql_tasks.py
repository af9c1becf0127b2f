"""The real-model demo's tasks: text-to-SQL questions over the shop database, split train / held-out.

The database is the SQL example's (../sql_agent/make_db.py: 12 customers in 5 cities, 10 products
in 4 categories, 60 orders). Questions come from 16 templates that need different SQL shapes
(``WHERE col = 'text'``, numeric comparisons, ``COUNT``/``AVG``, ``ORDER BY ... LIMIT 1``,
``LIKE`` on dates, sub-queries over two tables), each filled with every value the database has.
Every template contributes questions to both splits (every fourth value is held out), so the
held-out curve measures whether the agent learned the shapes, not the answers: no held-out
question is ever trained on. Held-out tasks carry a ``seed`` per sample, so the untrained and the
trained policy are scored on the same random draws.

    python examples/demo/sql_tasks.py --db shop.db --split train > train.jsonl
    python examples/demo/sql_tasks.py --db shop.db --split heldout --samples 4 > heldout.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sqlite3
import sys
from pathlib import Path

SQL_AGENT = Path(__file__).resolve().parents[1] / "sql_agent"

# (template id, question, gold SQL, the SQL that lists the values to fill in)
TEMPLATES = [
    (
        "city-count",
        "How many customers live in {v}?",
        "SELECT COUNT(*) FROM customers WHERE city = '{v}'",
        "SELECT DISTINCT city FROM customers ORDER BY city",
    ),
    (
        "city-names",
        "List the names of the customers who live in {v}.",
        "SELECT name FROM customers WHERE city = '{v}'",
        "SELECT DISTINCT city FROM customers ORDER BY city",
    ),
    (
        "customer-city",
        "Which city does {v} live in?",
        "SELECT city FROM customers WHERE name = '{v}'",
        "SELECT name FROM customers ORDER BY id",
    ),
    (
        "customer-signup",
        "On what date did {v} sign up?",
        "SELECT signup_date FROM customers WHERE name = '{v}'",
        "SELECT name FROM customers ORDER BY id",
    ),
    (
        "product-price",
        "What is the price of the product {v}?",
        "SELECT price FROM products WHERE name = '{v}'",
        "SELECT name FROM products ORDER BY id",
    ),
    (
        "product-category",
        "Which category is the product {v} in?",
        "SELECT category FROM products WHERE name = '{v}'",
        "SELECT name FROM products ORDER BY id",
    ),
    (
        "category-names",
        "List the names of the products in the {v} category.",
        "SELECT name FROM products WHERE category = '{v}'",
        "SELECT DISTINCT category FROM products ORDER BY 1",
    ),
    (
        "category-count",
        "How many products are in the {v} category?",
        "SELECT COUNT(*) FROM products WHERE category = '{v}'",
        "SELECT DISTINCT category FROM products ORDER BY 1",
    ),
    (
        "category-avg",
        "What is the average price of the products in the {v} category?",
        "SELECT AVG(price) FROM products WHERE category = '{v}'",
        "SELECT DISTINCT category FROM products ORDER BY 1",
    ),
    (
        "category-max",
        "What is the name of the most expensive product in the {v} category?",
        "SELECT name FROM products WHERE category = '{v}' ORDER BY price DESC LIMIT 1",
        "SELECT DISTINCT category FROM products ORDER BY 1",
    ),
    (
        "price-above",
        "How many products cost more than {v} euros?",
        "SELECT COUNT(*) FROM products WHERE price > {v}",
        "VALUES (10), (20), (30), (40), (50), (100)",
    ),
    (
        "price-below",
        "List the names of the products that cost less than {v} euros.",
        "SELECT name FROM products WHERE price < {v}",
        "VALUES (15), (20), (25), (40), (50)",
    ),
    (
        "month-orders",
        "How many orders were placed in month {v} of 2024?",
        "SELECT COUNT(*) FROM orders WHERE order_date LIKE '2024-0{v}-%'",
        "VALUES (1), (2), (3), (4), (5), (6)",
    ),
    (
        "quantity-orders",
        "How many orders have a quantity of {v}?",
        "SELECT COUNT(*) FROM orders WHERE quantity = {v}",
        "VALUES (1), (2), (3), (4)",
    ),
    (
        "customer-orders",
        "How many orders did {v} place?",
        "SELECT COUNT(*) FROM orders WHERE customer_id = (SELECT id FROM customers WHERE name = '{v}')",
        "SELECT name FROM customers ORDER BY id",
    ),
    (
        "product-units",
        "How many units of the product {v} were ordered in total?",
        "SELECT SUM(quantity) FROM orders WHERE product_id = (SELECT id FROM products WHERE name = '{v}')",
        "SELECT name FROM products ORDER BY id",
    ),
]
HELD_OUT_EVERY = 4  # value i of a template is held out when i % 4 == 1


def build_db(path: str | Path) -> Path:
    """The SQL example's deterministic shop database (../sql_agent/make_db.py)."""
    spec = importlib.util.spec_from_file_location("sql_agent_make_db", SQL_AGENT / "make_db.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(path)


def questions(db: str | Path) -> dict[str, list[dict]]:
    """Every filled template, as tasks ``{"id", "question", "gold_sql", "value", "db"}`` by split."""
    path = str(Path(db).resolve())
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out: dict[str, list[dict]] = {"train": [], "heldout": []}
        for tid, question, gold, values_sql in TEMPLATES:
            for i, (v,) in enumerate(con.execute(values_sql).fetchall()):
                split = "heldout" if i % HELD_OUT_EVERY == 1 else "train"
                slug = str(v).lower().replace(" ", "-")
                out[split].append(
                    {
                        "id": f"{split}-{tid}-{slug}",
                        "question": question.format(v=v),
                        "gold_sql": gold.format(v=v),
                        "value": v,  # what the question is about (the reward's on-topic check)
                        "db": path,
                    }
                )
    finally:
        con.close()
    return out


def with_seeds(tasks: list[dict], samples: int) -> list[dict]:
    """``samples`` copies of each task, each with its own id and sampling ``seed`` (a fixed evaluation)."""
    return [
        {**t, "id": f"{t['id']}-s{s}", "seed": 1000 * s + k}
        for k, t in enumerate(tasks)
        for s in range(samples)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default="shop.db", help="database file, written if missing (default: %(default)s)")
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--samples", type=int, default=0, help="seeded copies per task (0: the tasks as they are)")
    args = p.parse_args(argv)
    if not Path(args.db).is_file():
        build_db(args.db)
    tasks = questions(args.db)[args.split]
    if args.samples:
        tasks = with_seeds(tasks, args.samples)
    sys.stdout.write("".join(json.dumps(t) + "\n" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
