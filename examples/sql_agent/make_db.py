"""Write the example's SQLite shop database: customers, products, orders. Deterministic (stdlib only).

The same call always writes the same rows, so a task's gold answer never changes and two
machines score the same SQL the same way.

    python examples/sql_agent/make_db.py shop.db
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
from pathlib import Path

SCHEMA = """
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL,
    signup_date TEXT NOT NULL          -- ISO date, YYYY-MM-DD
);
CREATE TABLE products (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    category TEXT NOT NULL,
    price REAL NOT NULL                -- in euros
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    quantity INTEGER NOT NULL,
    order_date TEXT NOT NULL           -- ISO date, YYYY-MM-DD
);
"""

CUSTOMERS = [("Ada", "Berlin"), ("Ben", "Paris"), ("Chloe", "Berlin"), ("Dev", "Madrid"), ("Eva", "Paris"),
             ("Finn", "Berlin"), ("Gia", "Rome"), ("Hugo", "Madrid"), ("Ines", "Rome"), ("Jon", "Paris"),
             ("Kai", "Berlin"), ("Lea", "Vienna")]
PRODUCTS = [("Atlas", "books", 24.0), ("Brewer", "kitchen", 89.5), ("Cosmos", "books", 18.5),
            ("Drone", "toys", 120.0), ("Easel", "art", 45.0), ("Fable", "books", 12.0),
            ("Grinder", "kitchen", 35.25), ("Helix", "toys", 15.0), ("Inkset", "art", 9.75),
            ("Juicer", "kitchen", 60.0)]
N_ORDERS = 60
SEED = 7


def build(path: str | Path) -> Path:
    """(Re)write the database at ``path`` and return it. Customers 12 (Lea) never orders."""
    path = Path(path)
    path.unlink(missing_ok=True)
    rng = random.Random(SEED)
    con = sqlite3.connect(path)
    try:
        con.executescript(SCHEMA)
        con.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)",
                        [(i, name, city, f"2023-{1 + i % 12:02d}-{1 + (7 * i) % 28:02d}")
                         for i, (name, city) in enumerate(CUSTOMERS, start=1)])
        con.executemany("INSERT INTO products VALUES (?, ?, ?, ?)",
                        [(i, *p) for i, p in enumerate(PRODUCTS, start=1)])
        buyers = range(1, len(CUSTOMERS))  # every customer but the last places orders
        con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                        [(i, rng.choice(buyers), rng.randint(1, len(PRODUCTS)), rng.randint(1, 4),
                          f"2024-{rng.randint(1, 6):02d}-{rng.randint(1, 28):02d}")
                         for i in range(1, N_ORDERS + 1)])
        con.commit()
    finally:
        con.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="shop.db", help="database file to (re)write (default: %(default)s)")
    args = p.parse_args(argv)
    print(build(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
