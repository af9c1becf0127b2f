"""Write the demo's tasks as JSONL: one per letter, `{"id": "letter-a", "letter": "a", "letters": "aeot"}`.

``letters`` (all the task letters) is read by the reward, never shown to the agent.

    python examples/demo/make_tasks.py > tasks.jsonl
    python examples/demo/make_tasks.py --letters aeot --repeat 2 > tasks.jsonl   # 8 tasks
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_LETTERS = "aeot"  # common letters of the tiny model's tokenizer, each a single-byte token


def make_tasks(letters: str = DEFAULT_LETTERS, repeat: int = 1) -> list[dict]:
    """Distinct ids per (letter, copy), so `repeat` gives more tasks (groups) of the same kind."""
    if not letters or len(set(letters)) != len(letters) or not all(c.isalpha() and c.isascii() for c in letters):
        raise ValueError(f"letters must be distinct ASCII letters, got {letters!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    return [{"id": f"letter-{c}" + (f"-{k}" if repeat > 1 else ""), "letter": c, "letters": letters}
            for k in range(repeat) for c in letters]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--letters", default=DEFAULT_LETTERS, help="one task per letter (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="copies of each task, with distinct ids")
    args = p.parse_args(argv)
    try:
        tasks = make_tasks(args.letters, args.repeat)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write("".join(json.dumps(t) + "\n" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
