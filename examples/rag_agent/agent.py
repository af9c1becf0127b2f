"""A retrieval-augmented agent on the OpenAI Agents SDK: a researcher searches, a writer answers.

Two named agents over the bundled corpus (``corpus/*.md``, a made-up outdoor gear company):

- ``researcher`` calls ``search_docs(query)`` (BM25 over the corpus's paragraphs, plain Python)
  and, once it has the passages, hands off to
- ``writer``, which answers the question from the passages in the conversation.

It is an ordinary Agents SDK program and knows nothing of tracerl: ``opentelemetry-instrument``
exports its spans (the OpenInference processor records the agents, tools and handoffs;
OpenLLMetry records each chat call) and environment variables say where the model
(OPENAI_BASE_URL, OPENAI_API_KEY) and the collector (OTEL_EXPORTER_OTLP_ENDPOINT) are.

The model is served by a vLLM-style endpoint that speaks Chat Completions, not the Responses API
the SDK uses by default, so each agent gets an ``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI()``
client: the SDK's documented way to use a non-OpenAI endpoint.

Task (JSON on stdin, or as the first argument, or in $TRACERL_TASK):
``{"id": ..., "question": "..."}``. Prints the writer's answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from openai import AsyncOpenAI

CORPUS = Path(__file__).resolve().parent / "corpus"
MODEL = os.environ.get("RAG_MODEL", "policy")
TOP_K = int(os.environ.get("RAG_TOP_K", "3"))
MAX_TURNS = int(os.environ.get("RAG_MAX_TURNS", "8"))

STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "for", "from", "how", "i", "in", "is",
    "it", "its", "me", "my", "of", "on", "or", "the", "to", "what", "when", "which", "who", "why", "will", "with",
    "you", "your",
})


def tokenize(text: str) -> list[str]:
    """Lowercase words and numbers ("4,990" and "2.4" stay one token), stopwords dropped, a plural
    "s" cut ("products" finds "product"): the least stemming that lets questions find passages."""
    words = re.findall(r"[a-z0-9]+(?:[.,][0-9]+)*", text.lower())
    return [w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in words if w not in STOPWORDS]


def load_passages(corpus: Path = CORPUS) -> list[tuple[str, str]]:
    """``(source, passage)`` per paragraph of every document; the title is kept with each paragraph
    so a question naming the product finds its passages."""
    out = []
    for path in sorted(corpus.glob("*.md")):
        title, *paragraphs = [p.strip() for p in path.read_text().split("\n\n") if p.strip()]
        title = title.lstrip("# ").strip()
        for p in paragraphs:
            out.append((path.name, f"{title}: {' '.join(p.split())}"))
    return out


class BM25:
    """Okapi BM25 (k1 = 1.5, b = 0.75) over a fixed list of passages; small enough to build per process."""

    def __init__(self, passages: list[tuple[str, str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.passages = passages
        self.docs = [Counter(tokenize(text)) for _, text in passages]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg = sum(self.lengths) / max(len(self.docs), 1)
        df = Counter(w for d in self.docs for w in d)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}
        self.k1, self.b = k1, b

    def score(self, query: list[str], i: int) -> float:
        doc, norm = self.docs[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg)
        return sum(self.idf[w] * doc[w] * (self.k1 + 1) / (doc[w] + norm) for w in query if w in doc)

    def search(self, query: str, k: int = TOP_K) -> list[tuple[str, str]]:
        """The ``k`` best passages with a positive score, best first (ties in corpus order)."""
        words = tokenize(query)
        scored = sorted(((self.score(words, i), i) for i in range(len(self.docs))), key=lambda s: (-s[0], s[1]))
        return [self.passages[i] for s, i in scored[:k] if s > 0]


@lru_cache(maxsize=1)
def index() -> BM25:
    return BM25(load_passages())


@function_tool
def search_docs(query: str) -> str:
    """Search Brightwater Outfitters' documents (products, prices, policies) and return the best passages.

    Args:
        query: keywords or a question, e.g. "return policy days".
    """
    hits = index().search(query)
    if not hits:
        return "No passage matches; try other keywords."
    return "\n".join(f"[{source}] {text}" for source, text in hits)


RESEARCHER = ("You are the researcher of Brightwater Outfitters' help desk. Call search_docs with keywords "
              "from the customer's question. When the passages answer it, hand off to the writer; if they "
              "do not, search again with other keywords.")
WRITER = ("You are the writer of Brightwater Outfitters' help desk. Answer the customer's question in one "
          "or two sentences, using only the passages found by search_docs, and quote the exact figures.")


def build_agents(client: AsyncOpenAI) -> Agent:
    """The entry agent (``researcher``), which hands off to the ``writer``."""
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    writer = Agent(name="writer", instructions=WRITER, model=model)
    return Agent(name="researcher", instructions=RESEARCHER, tools=[search_docs], handoffs=[writer], model=model)


def read_task() -> dict:
    """The task from the first argument, else stdin, else $TRACERL_TASK (whatever the launcher gives)."""
    if len(sys.argv) > 1:
        return json.loads(sys.argv[1])
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    return json.loads(text.strip() or os.environ["TRACERL_TASK"])


async def answer(question: str) -> str:
    result = await Runner.run(build_agents(AsyncOpenAI()), question, max_turns=MAX_TURNS)
    return str(result.final_output)


def main() -> None:
    print(asyncio.run(answer(read_task()["question"])))


if __name__ == "__main__":
    main()
