"""Write the calculator agent's tasks as JSONL: arithmetic word problems with a numeric answer.

Each task is ``{"id": "calc-0", "question": "...", "answer": 23}``; the agent reads only
``question``, the reward compares its final number with ``answer``. Problems come from a few
templates with numbers drawn from a seeded generator, so the same ``--seed`` gives the same tasks,
and every answer is an integer (computed here exactly, never by the model).

    python examples/calculator_agent/make_tasks.py > tasks.jsonl
    python examples/calculator_agent/make_tasks.py --n 32 --seed 7 > tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable

Template = Callable[[random.Random], tuple[str, int]]


def _change(r: random.Random) -> tuple[str, int]:
    price, n = r.randint(2, 9), r.randint(3, 9)
    paid = (price * n // 10 + 1) * 10 + r.choice([0, 10, 40])
    return (f"A pen costs ${price}. Maria buys {n} pens and pays with ${paid}. "
            f"How many dollars of change does she get?", paid - price * n)


def _boxes(r: random.Random) -> tuple[str, int]:
    boxes, per, eaten = r.randint(3, 12), r.randint(6, 24), r.randint(1, 9)
    return (f"There are {boxes} boxes with {per} apples each. {eaten} apples are eaten. "
            f"How many apples are left?", boxes * per - eaten)


def _share(r: random.Random) -> tuple[str, int]:
    people, each, extra = r.randint(3, 9), r.randint(4, 30), r.randint(1, 5)
    total = people * each + extra
    return (f"{total} stickers are shared equally among {people} children and the {extra} left over "
            f"go back in the drawer. How many stickers does each child get?", each)


def _trip(r: random.Random) -> tuple[str, int]:
    speed, hours, back = r.randint(40, 90), r.randint(2, 6), r.randint(10, 60)
    return (f"A train travels at {speed} km per hour for {hours} hours, then goes back {back} km. "
            f"How far is it from where it started, in km?", speed * hours - back)


def _savings(r: random.Random) -> tuple[str, int]:
    start, weekly, weeks, spent = r.randint(10, 80), r.randint(5, 25), r.randint(3, 12), r.randint(5, 40)
    return (f"Sam has ${start}, saves ${weekly} every week for {weeks} weeks and then spends ${spent}. "
            f"How many dollars does Sam have now?", start + weekly * weeks - spent)


def _area(r: random.Random) -> tuple[str, int]:
    w, h, tile = r.randint(3, 15), r.randint(3, 15), r.choice([1, 2, 4])
    w, h = w * tile, h * tile  # whole tiles only
    return (f"A floor is {w} m by {h} m. Each square tile is {tile} m by {tile} m. "
            f"How many tiles cover the floor?", (w * h) // (tile * tile))


TEMPLATES: tuple[Template, ...] = (_change, _boxes, _share, _trip, _savings, _area)


def make_tasks(n: int = 8, seed: int = 0) -> list[dict]:
    """``n`` tasks cycling through the templates, numbers from ``random.Random(seed)``."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    r = random.Random(seed)
    tasks = []
    for i in range(n):
        question, answer = TEMPLATES[i % len(TEMPLATES)](r)
        tasks.append({"id": f"calc-{seed}-{i}", "question": question, "answer": answer})
    return tasks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8, help="number of tasks (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the numbers (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        tasks = make_tasks(args.n, args.seed)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write("".join(json.dumps(t) + "\n" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
