"""Automatic prefix caching for the embedded engine: which prompt prefixes to compute once, and an LRU of them.

Agents send the same long head again and again (a system message, a schema, a worked example) and
only the end of each prompt differs. vLLM caches the KV of every full block of every prompt, keyed
by the block's tokens and everything before it, so a later request whose prompt starts the same
way skips those tokens' prefill (vLLM docs, "Automatic Prefix Caching"; ``--enable-prefix-caching``,
on by default in vLLM V1). The embedded engine does the same at two levels, with no model code here
(``serving.prefill`` runs the model):

* **within a batch**: ``plan_groups`` splits the batch's distinct prompts into groups that share a
  long prefix; each group's longest common prefix is computed once, at batch size 1, and its KV is
  laid under every row of the group (a job with ``n`` samples is a group of ``n`` rows by itself).
* **across batches**: ``PrefixCache`` keeps the KV of block-aligned prefixes (the longest multiple of
  ``block`` tokens within each group's prefix), least recently used evicted first, bounded in bytes.
  A group then starts from the longest cached aligned prefix of its own prefix and computes only
  the rest. Keys are exact token tuples under a *scope* (the adapter, its load generation and the
  weights generation), so a re-loaded adapter or new weights can never hit a stale entry.

A prefix always leaves at least one token of its prompt to run, since the last prompt token's
logits are what the first sample is drawn from.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

BLOCK = 16  # vLLM's default block size: prefixes are cached at multiples of it


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Group:
    """Prompts (indices into the batch's prompt list) that share ``prefix_len`` leading tokens."""

    members: list[int]
    prefix_len: int


def plan_groups(
    prompts: Sequence[Sequence[int]],
    weights: Sequence[int],
    cached: Callable[[Sequence[int], int], int] | None = None,
    min_len: int = BLOCK,
) -> list[Group]:
    """Split a batch's prompts into groups, each with the shared prefix that saves the most prefill.

    ``weights[i]`` is how many rows prompt ``i`` fills (a request's ``n``); ``cached(tokens, limit)``
    says how many leading tokens of ``tokens`` (at most ``limit``) the cache already holds. The cost of
    a group counted in token positions run through the model: its prefix once, less what is cached,
    plus each row's own rest of the prompt; without a prefix, each row's whole prompt. Sorted prompts
    put the longest shared prefixes side by side; a range of them is split at its weakest neighbour
    pair when the two halves cost less than the range as one group (or as much, when the range shares
    no usable prefix: then a lone prompt's prefix is still computed once and cached for later batches).
    A prefix stops one token short of its group's shortest prompt, and one shorter than ``min_len``
    is not used (``prefix_len`` 0).
    """
    peek = cached or (lambda _tokens, _limit: 0)
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    adjacent = [common_prefix_len(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]

    def cost(lo: int, hi: int) -> tuple[int, int]:
        members = order[lo:hi]
        shared = min(adjacent[lo : hi - 1], default=len(prompts[members[0]]))
        p = min(shared, min(len(prompts[i]) for i in members) - 1)
        plain = sum(weights[i] * len(prompts[i]) for i in members)
        if p < min_len:
            return plain, 0
        with_prefix = (
            p - peek(prompts[members[0]], p) + sum(weights[i] * (len(prompts[i]) - p) for i in members)
        )
        return (with_prefix, p) if with_prefix <= plain else (plain, 0)

    def best(lo: int, hi: int) -> tuple[int, list[Group]]:
        c, p = cost(lo, hi)
        if hi - lo == 1:
            return c, [Group([order[lo]], p)]
        cut = min(range(lo, hi - 1), key=lambda k: adjacent[k]) + 1
        (lc, lg), (rc, rg) = best(lo, cut), best(cut, hi)
        if lc + rc < c or (lc + rc == c and p == 0):
            return lc + rc, lg + rg
        return c, [Group(sorted(order[lo:hi]), p)]

    return best(0, len(order))[1] if prompts else []


@dataclass
class _Entry:
    value: Any
    size: int


class PrefixCache:
    """An LRU of block-aligned prefix KVs, bounded by ``max_bytes``; the values are opaque here.

    ``lookup`` finds the longest cached aligned prefix of some tokens; ``store`` adds one; ``drop``
    and ``clear`` invalidate. Counters (``queries``, ``hits``, ``hit_tokens``) are for observability
    and the bench. Not thread-safe: the engine thread owns it.
    """

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.max_bytes = max(0, int(max_bytes))
        self.block = block
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self.bytes = 0
        self.queries = self.hits = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def aligned(self, n: int) -> int:
        """The longest multiple of ``block`` that is at most ``n``."""
        return n // self.block * self.block

    def _find(self, scope: Hashable, tokens: Sequence[int], limit: int | None) -> tuple[int, Any]:
        top = self.aligned(len(tokens) if limit is None else min(len(tokens), limit))
        for n in range(top, 0, -self.block):
            key = (scope, tuple(tokens[:n]))
            if key in self._entries:
                return n, key
        return 0, None

    def peek(self, scope: Hashable, tokens: Sequence[int], limit: int | None = None) -> int:
        """How long the longest cached prefix of ``tokens`` (at most ``limit``) is; touches nothing."""
        return self._find(scope, tokens, limit)[0]

    def lookup(self, scope: Hashable, tokens: Sequence[int], limit: int | None = None) -> tuple[int, Any]:
        """``(length, value)`` of the longest cached prefix of ``tokens`` (at most ``limit`` long), or ``(0, None)``."""
        self.queries += 1
        n, key = self._find(scope, tokens, limit)
        if key is None:
            return 0, None
        self._entries.move_to_end(key)
        self.hits += 1
        self.hit_tokens += n
        return n, self._entries[key].value

    def store(self, scope: Hashable, tokens: Sequence[int], value: Any, size: int) -> bool:
        """Keep ``value`` (``size`` bytes) as the KV of ``tokens``, a whole number of blocks; evicts LRU entries.

        Returns False (and keeps nothing) when ``tokens`` is not block-aligned or ``size`` alone is
        over the bound.
        """
        if not tokens or len(tokens) % self.block or size > self.max_bytes:
            return False
        key = (scope, tuple(tokens))
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[key] = _Entry(value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.size
        return True

    def drop(self, scope_matches: Callable[[Hashable], bool]) -> int:
        """Forget every entry whose scope matches; returns how many."""
        keys = [k for k in self._entries if scope_matches(k[0])]
        for k in keys:
            self.bytes -= self._entries.pop(k).size
        return len(keys)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
