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
* **across batches**: ``PrefixCache`` keeps the KV of each group's prefix cut down to whole blocks
  of ``block`` tokens, least recently used evicted first, bounded in bytes. Any of an entry's
  leading blocks serve a later prompt that starts with them (found by chained block hashes, checked
  token by token), so a group starts from the longest cached block-aligned part of its prefix and
  computes only the rest. Entries live under a *scope* (the adapter, its load generation and the
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


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """One hash per full block of ``tokens``, each chained to the blocks before it (vLLM's block hash):
    equal hashes at block ``k`` mean, barring a collision, equal first ``k + 1`` blocks."""
    out: list[int] = []
    h = 0
    for i in range(0, len(tokens) // block * block, block):
        h = hash((h, tuple(tokens[i : i + block])))
        out.append(h)
    return out


@dataclass
class _Entry:
    scope: Hashable
    tokens: tuple[int, ...]
    hashes: list[int]
    value: Any
    size: int


class PrefixCache:
    """An LRU of block-aligned prefix KVs, bounded by ``max_bytes``; the values are opaque here.

    An entry holds the KV of a whole number of blocks, and serves any prompt that shares some of its
    first blocks, as vLLM's block table does (here one contiguous value per entry, so two entries may
    hold copies of the same head). ``lookup`` finds the longest such shared prefix, ``store`` adds an
    entry (dropping the ones it extends), ``drop`` and ``clear`` invalidate. Counters (``queries``,
    ``hits``, ``hit_tokens``) are for observability and the bench. Not thread-safe: the engine thread
    owns it.
    """

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.max_bytes = max(0, int(max_bytes))
        self.block = block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[Hashable, int, int], dict[int, None]] = {}  # (scope, blocks, hash) -> entries
        self._ids = itertools.count()
        self.bytes = 0
        self.queries = self.hits = self.hit_tokens = 0
        self.usable = True  # False once the model's KV proved not reusable as a prefix (sliding windows)

    def __len__(self) -> int:
        return len(self._entries)

    def scopes(self) -> set[Hashable]:
        """The scopes that have entries."""
        return {e.scope for e in self._entries.values()}

    def aligned(self, n: int) -> int:
        """The longest multiple of ``block`` that is at most ``n``."""
        return n // self.block * self.block

    def _find(self, scope: Hashable, tokens: Sequence[int], limit: int | None) -> tuple[int, int | None]:
        top = self.aligned(len(tokens) if limit is None else min(len(tokens), limit))
        hashes = block_hashes(tokens[:top], self.block)
        for k in range(len(hashes), 0, -1):
            n = k * self.block
            for eid in reversed(self._index.get((scope, k, hashes[k - 1]), {})):
                if self._entries[eid].tokens[:n] == tuple(tokens[:n]):  # a hash collision must not hit
                    return n, eid
        return 0, None

    def peek(self, scope: Hashable, tokens: Sequence[int], limit: int | None = None) -> int:
        """How long the longest cached prefix of ``tokens`` (at most ``limit``) is; touches nothing."""
        return self._find(scope, tokens, limit)[0]

    def lookup(self, scope: Hashable, tokens: Sequence[int], limit: int | None = None) -> tuple[int, Any]:
        """``(n, value)``: the longest cached prefix of ``tokens`` (at most ``limit`` long) is ``n`` tokens,
        and ``value`` is the KV of an entry whose first ``n`` tokens they are (it may be longer: slice it);
        ``(0, None)`` when nothing matches."""
        self.queries += 1
        n, eid = self._find(scope, tokens, limit)
        if eid is None:
            return 0, None
        self._entries.move_to_end(eid)
        self.hits += 1
        self.hit_tokens += n
        return n, self._entries[eid].value

    def store(self, scope: Hashable, tokens: Sequence[int], value: Any, size: int) -> bool:
        """Keep ``value`` (``size`` bytes) as the KV of ``tokens``, a whole number of blocks; evicts LRU entries.

        Entries that ``tokens`` extends are dropped (the new one serves their prompts). Returns False,
        keeping nothing, when ``tokens`` is not block-aligned, ``size`` alone is over the bound, or an
        entry already holds all of ``tokens`` (that entry counts as used).
        """
        if not tokens or len(tokens) % self.block or size > self.max_bytes:
            return False
        n, eid = self._find(scope, tokens, None)
        if n == len(tokens):
            self._entries.move_to_end(eid)
            return False
        hashes = block_hashes(tokens, self.block)
        for k in range(1, len(hashes)):
            for old in list(self._index.get((scope, k, hashes[k - 1]), {})):
                if self._entries[old].tokens == tuple(tokens[: k * self.block]):
                    self._remove(old)  # a prefix of ``tokens``: the new entry covers it
        eid = next(self._ids)
        self._entries[eid] = _Entry(scope, tuple(tokens), hashes, value, size)
        for k, h in enumerate(hashes, 1):
            self._index.setdefault((scope, k, h), {})[eid] = None
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def _remove(self, eid: int) -> None:
        e = self._entries.pop(eid)
        self.bytes -= e.size
        for k, h in enumerate(e.hashes, 1):
            holders = self._index[(e.scope, k, h)]
            del holders[eid]
            if not holders:
                del self._index[(e.scope, k, h)]

    def drop(self, scope_matches: Callable[[Hashable], bool]) -> int:
        """Forget every entry whose scope matches; returns how many."""
        gone = [eid for eid, e in self._entries.items() if scope_matches(e.scope)]
        for eid in gone:
            self._remove(eid)
        return len(gone)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes = 0
