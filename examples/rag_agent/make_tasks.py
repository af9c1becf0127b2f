"""Write the RAG agent's tasks as JSONL: a question over the corpus and the keywords of its answer.

Each answer is a fact stated once in ``corpus/*.md``, so a reply can be checked by keywords:
``{"id": "returns", "question": "...", "keywords": ["60 days"]}``. A keyword with ``|`` lists
spellings that count alike (``"5-year|5 years|five years"``). ``keywords`` is read by the reward,
never shown to the agent.

    python examples/rag_agent/make_tasks.py > tasks.jsonl
    python examples/rag_agent/make_tasks.py --only returns,warranty > tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

TASKS: list[dict] = [
    {"id": "returns", "question": "Within how many days can I return an unused item?",
     "keywords": ["60 days"]},
    {"id": "warranty", "question": "How long is the warranty on Brightwater products?",
     "keywords": ["5-year|5 years|five years|five-year"]},
    {"id": "kestrel-weight", "question": "How much does the Kestrel 2 tent weigh?",
     "keywords": ["2.4 kg"]},
    {"id": "fjord-length", "question": "How long is the Fjord 430 kayak, and what is it made of?",
     "keywords": ["4.3 m", "polyethylene"]},
    {"id": "polar-comfort", "question": "What is the comfort rating of the Polar Down sleeping bag?",
     "keywords": ["minus 12|-12"]},
    {"id": "ember-boil", "question": "How fast does the Ember stove boil one litre of water?",
     "keywords": ["3 minutes 20 seconds|3 min 20|3:20|200 seconds"]},
    {"id": "shipping-sweden", "question": "What does shipping to Sweden cost?",
     "keywords": ["249 NOK"]},
    {"id": "pole-repair", "question": "What does the repair workshop charge to replace a pole section?",
     "keywords": ["150 NOK"]},
    {"id": "loyalty-points", "question": "How many loyalty points do I need to redeem for 50 NOK off?",
     "keywords": ["100 points"]},
    {"id": "rental-deposit", "question": "How big is the deposit when I rent gear?",
     "keywords": ["2,000 NOK|2000 NOK|2 000 NOK"]},
    {"id": "founder", "question": "Who founded Brightwater Outfitters, and in which year?",
     "keywords": ["Ingrid Halvorsen", "2011"]},
    {"id": "second-round", "question": "What voucher do I get for handing in a worn-out product?",
     "keywords": ["15%|15 %|15 percent"]},
]


def make_tasks(only: list[str] | None = None) -> list[dict]:
    """All tasks, or those whose ids are in ``only`` (in the order of ``TASKS``)."""
    ids = {t["id"] for t in TASKS}
    unknown = sorted(set(only or []) - ids)
    if unknown:
        raise ValueError(f"unknown task ids {unknown}; known: {sorted(ids)}")
    return [t for t in TASKS if only is None or t["id"] in only]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated task ids (default: all)")
    args = p.parse_args(argv)
    try:
        tasks = make_tasks([s for s in args.only.split(",") if s] or None)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write("".join(json.dumps(t) + "\n" for t in tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
