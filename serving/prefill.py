"""A batch's prompt forward pass, with shared prefixes computed once (``serving.prefix_cache`` plans them).

Each group of rows that shares a prefix gets that prefix's KV from the cache, or computes what the
cache lacks at batch size 1 (and caches its block-aligned part). The batch then runs only the rows'
remaining suffixes, laid out per row as::

    [left padding][prefix KV of the row's group][left padding][suffix tokens]

with ``attention_mask`` 0 on both paddings and ``position_ids`` that go on from the row's prefix
length. Rotary positions are baked into cached keys, so a prefix's KV means the same wherever it
sits in the tensor; masked slots are zeros and take no attention. Without a cache (or with no
usable prefix) this is the plain left-padded prompt pass.

The cached KV tensors are never handed to the model: ``DynamicCache`` copies what it is built from
(``DynamicLayer.update`` concatenates, transformers 5.23 ``cache_utils.py``), and each stored entry
is a clone, so no later decode step can write into the cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from serving.prefix_cache import PrefixCache, plan_groups

KV = tuple[tuple[Any, Any], ...]  # per layer (keys, values), each [1, kv_heads, length, head_dim]


def prefill(
    model: Any,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int],
    pad_id: int,
    cache: PrefixCache | None = None,
    scope: Hashable = None,
) -> tuple[Any, Any, Any]:
    """Run the prompts of a batch (row ``r`` is prompt ``row_prompt[r]``); returns (output, mask, positions).

    The output's logits hold the last position only; ``mask`` and ``positions`` are those of the
    last forward, for the decode steps to extend.
    """
    import torch

    weights = [0] * len(prompts)
    for p in row_prompt:
        weights[p] += 1
    prefix: list[tuple[KV, int] | None] = [None] * len(prompts)
    if cache is not None and cache.usable:
        groups = plan_groups(
            prompts, weights, lambda toks, limit: cache.peek(scope, toks, limit), cache.block
        )
        for g in groups:
            if g.prefix_len:
                kv = _prefix_kv(model, list(prompts[g.members[0]][: g.prefix_len]), cache, scope)
                for m in g.members:
                    prefix[m] = None if kv is None else (kv, g.prefix_len)
    lens = [0 if x is None else x[1] for x in prefix]
    width_c = max((lens[p] for p in row_prompt), default=0)
    suffix = [list(prompts[p][lens[p] :]) for p in range(len(prompts))]
    width_s = max(len(suffix[p]) for p in row_prompt)
    ids, mask, pos = [], [], []
    for p in row_prompt:
        c, s = lens[p], suffix[p]
        gap = width_s - len(s)
        ids.append([pad_id] * gap + s)
        mask.append([0] * (width_c - c) + [1] * c + [0] * gap + [1] * len(s))
        pos.append([c] * gap + list(range(c, c + len(s))))
    mask_t = torch.tensor(mask)
    pos_t = torch.tensor(pos)
    past = _batch_cache(prefix, row_prompt, width_c) if width_c else None
    out = model(
        input_ids=torch.tensor(ids),
        attention_mask=mask_t,
        position_ids=pos_t,
        past_key_values=past,
        use_cache=True,
        logits_to_keep=1,
    )
    return out, mask_t, pos_t


def _prefix_kv(model: Any, tokens: list[int], cache: PrefixCache, scope: Hashable) -> KV | None:
    """The KV of ``tokens``: from the cache, extended by a batch-1 pass where it falls short; None if
    the model's cache is not plain per-layer KV (sliding windows), which this layout cannot reuse."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    have, kv = cache.lookup(scope, tokens)
    if kv is not None:  # the entry may hold more than the ``have`` tokens shared with ``tokens``
        kv = tuple((k[..., :have, :], v[..., :have, :]) for k, v in kv)
    if have == len(tokens):
        return kv
    past = DynamicCache(ddp_cache_data=kv) if kv is not None else None
    rest = tokens[have:]
    out = model(
        input_ids=torch.tensor([rest]),
        attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
        position_ids=torch.arange(have, len(tokens)).view(1, -1),
        past_key_values=past,
        use_cache=True,
        logits_to_keep=1,
    )
    layers = out.past_key_values.layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        cache.usable = False  # not worth a batch-1 pass per group again
        return None
    kv = tuple((layer.keys, layer.values) for layer in layers)
    n = cache.aligned(len(tokens))
    if n > have:
        part = tuple((k[..., :n, :].clone(), v[..., :n, :].clone()) for k, v in kv)
        cache.store(scope, tokens[:n], part, sum(k.nbytes + v.nbytes for k, v in part))
    return kv


def _batch_cache(prefix: Sequence[tuple[KV, int] | None], row_prompt: Sequence[int], width: int) -> Any:
    """A ``DynamicCache`` of ``width`` positions per row: each row's prefix KV, left-padded with zeros."""
    import torch
    from transformers import DynamicCache

    some = next(x[0] for x in prefix if x is not None)
    layers = []
    for layer, (k0, v0) in enumerate(some):
        keys, values = [], []
        for p in row_prompt:
            if prefix[p] is None:
                keys.append(k0.new_zeros((1, k0.shape[1], width, k0.shape[3])))
                values.append(v0.new_zeros((1, v0.shape[1], width, v0.shape[3])))
                continue
            (k, v), c = prefix[p][0][layer], prefix[p][1]
            keys.append(torch.nn.functional.pad(k, (0, 0, width - c, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, width - c, 0)))
        layers.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=layers)
