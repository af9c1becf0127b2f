"""Write the SQL agent's tasks as JSONL: ``{"id", "question", "gold_sql", "db"}`` per line.

``gold_sql`` is read by the reward only (the agent sees the question and the schema); ``db`` is
the absolute path of the database from ``make_db.py``, so the agent and the reward open the same
file wherever the driver runs them.

    python examples/sql_agent/make_db.py shop.db
    python examples/sql_agent/make_tasks.py --db shop.db > tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

QUESTIONS = [
    ("customers-total", "How many customers are there?",
     "SELECT COUNT(*) FROM customers"),
    ("customers-berlin", "How many customers live in Berlin?",
     "SELECT COUNT(*) FROM customers WHERE city = 'Berlin'"),
    ("books-alpha", "List the names of the products in the books category, alphabetically.",
     "SELECT name FROM products WHERE category = 'books' ORDER BY name"),
    ("priciest-product", "What is the name of the most expensive product?",
     "SELECT name FROM products ORDER BY price DESC LIMIT 1"),
    ("revenue-total", "What is the total revenue of all orders (quantity times price)?",
     "SELECT SUM(o.quantity * p.price) FROM orders o JOIN products p ON p.id = o.product_id"),
    ("never-ordered", "Which customers have never placed an order? Give their names.",
     "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)"),
    ("orders-per-city", "How many orders were placed by customers of each city? Give city and count.",
     "SELECT c.city, COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id GROUP BY c.city"),
    ("march-orders", "How many orders were placed in March 2024?",
     "SELECT COUNT(*) FROM orders WHERE order_date BETWEEN '2024-03-01' AND '2024-03-31'"),
    ("units-per-category", "How many units were sold per product category, by category name?",
     "SELECT p.category, SUM(o.quantity) FROM orders o JOIN products p ON p.id = o.product_id "
     "GROUP BY p.category ORDER BY p.category"),
    ("top-customer", "Which customer placed the most orders? Give the name.",
     "SELECT c.name FROM orders o JOIN customers c ON c.id = o.customer_id GROUP BY c.id "
     "ORDER BY COUNT(*) DESC, c.name LIMIT 1"),
]


def make_tasks(db: str | Path) -> list[dict]:
    """One task per question, each naming the database by absolute path."""
    path = str(Path(db).resolve())
    return [{"id": tid, "question": q, "gold_sql": sql, "db": path} for tid, q, sql in QUESTIONS]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default="shop.db", help="database written by make_db.py (default: %(default)s)")
    args = p.parse_args(argv)
    if not Path(args.db).is_file():
        p.error(f"no database at {args.db}; write it first: python examples/sql_agent/make_db.py {args.db}")
    sys.stdout.write("".join(json.dumps(t) + "\n" for t in make_tasks(args.db)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
