"""Packed rows through attention whose memory grows with the row, not with its square.

A packed row (``trainer/packing.py``) holds many samples, and with a shared prompt prefix a tree of
them. The dense path hands the model an explicit ``[R, 1, L, L]`` mask: exact, but it forces the
masked sdpa/eager kernels, which keep an L x L score matrix per head (at 16k tokens, 1 GiB per head
in fp32, forward and backward). Three paths here replace it, all exact:

- **varlen** (``attn_implementation="tracerl_varlen"``, registered through transformers'
  ``AttentionInterface``): the row is cut into its *segments* (a plain sample; a shared prefix; a
  branch after it) and each segment attends with ``scaled_dot_product_attention`` to its own keys,
  causally, plus its prefix's keys in full (a branch). A plain segment takes ``is_causal=True``, the
  memory-efficient (flash) kernel on CPU and CUDA; a branch gets an explicit mask of its own
  ``n x (prefix + n)`` only. On CUDA, rows without a tree go through one varlen kernel call instead:
  ``flash_attn_varlen_func`` where flash-attn is installed (what OpenRLHF does with packed samples),
  else torch's own ``varlen_attn``. Works with autograd on CPU. The default everywhere.
- **flex** (``attn_implementation="flex_attention"``): PyTorch's FlexAttention with a ``BlockMask``
  built from the same unit and branch ids (``mask_mod``), one fused kernel for the whole row, tree
  included. Torch 2.13 has no FlexAttention *backward* on CPU (``NotImplementedError``), so flex trains
  on CUDA only; on CPU it can score (no grad). Opt-in: on one H200 it trained slower than varlen
  (``--attention auto`` picks varlen everywhere; see ``resolve``).
- **dense**: the explicit mask (the reference, and the fallback).

``tests/trainer/test_attention.py`` checks the logprobs and gradients of varlen (and flex's forward)
against dense; ``bench/attention_memory.py`` measures the memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_MODES = ("auto", "dense", "varlen", "flex")
VARLEN_IMPL = "tracerl_varlen"
FLEX_IMPL = "flex_attention"
SEGMENTS_KWARG = "tracerl_segments"  # a SegmentLayout, forwarded by transformers' **kwargs to the attention function


@dataclass(frozen=True)
class Segment:
    """Query tokens ``[start, end)`` of one row: they see ``[prefix_start, prefix_end)`` in full (a shared
    prompt prefix; empty for a plain sample or the prefix itself) and themselves causally."""

    start: int
    end: int
    prefix_start: int = 0
    prefix_end: int = 0

    @property
    def has_prefix(self) -> bool:
        return self.prefix_end > self.prefix_start


def row_segments(spans: Sequence[tuple[int, int]], branch_row: Sequence[int]) -> list[Segment]:
    """The segments of one row from its units' spans and branch ids (0: unshared or shared prefix,
    j + 1: member j's own tokens after the prefix), in layout order."""
    out: list[Segment] = []
    for start, end in spans:
        branches = branch_row[start:end]
        first = next((i for i, b in enumerate(branches) if b > 0), None)
        if first is None:
            out.append(Segment(start, end))
            continue
        prefix_end = start + first
        if first > 0:
            out.append(Segment(start, prefix_end))
        seg_start = prefix_end
        for pos in range(prefix_end + 1, end + 1):
            if pos == end or branch_row[pos] != branch_row[seg_start]:
                out.append(Segment(seg_start, pos, start, prefix_end))
                seg_start = pos
    return out


def batch_segments(
    spans: Sequence[Sequence[tuple[int, int]]], branch_ids: torch.Tensor
) -> list[list[Segment]]:
    """``row_segments`` for every row of a batch."""
    rows = branch_ids.tolist()
    return [row_segments(row_spans, rows[i]) for i, row_spans in enumerate(spans)]


class SegmentLayout:
    """Every row's segments, as the model's forward hands them down to the attention function.

    A plain object on purpose, not a list: ``torch.compile`` guards on the length of a list it is given,
    so a compiled decoder layer (``--compile-blocks``) re-traced for every packed layout. It does not look
    inside an object that only the attention function reads, and that function runs eagerly behind a
    graph break (``torch.compiler.disable``), so one graph serves every layout."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[list[Segment]]) -> None:
        self.rows = rows


@functools.cache
def flash_varlen() -> Any | None:
    """flash-attn's ``flash_attn_varlen_func`` when it can really run (CUDA torch and the package's
    compiled CUDA module), else None: an installed flash-attn without its CUDA build imports its
    Python part and fails only at the first call."""
    if not torch.cuda.is_available():
        return None
    try:
        import flash_attn_2_cuda  # noqa: F401  (the compiled kernels)
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@functools.cache
def torch_varlen() -> Any | None:
    """PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (the flash-attention varlen kernel built into
    CUDA torch, no extra package), adapted to one call ``(q, k, v, cu, longest, scale)`` on ``[T, H, d]``
    tensors; None where it is missing or its signature is not one we know.

    Why adapted: the API is young and moved between releases. torch 2.13 says causal with
    ``window_size=(-1, 0)`` and GQA with ``enable_gqa``; older ones take ``is_causal``, and without
    ``enable_gqa`` the kernel takes fewer key/value heads as they are (flash-attention's GQA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal: dict[str, Any] = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
             scale: float | None) -> torch.Tensor | None:
        kwargs = dict(causal)
        if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            if "scale" not in params:
                return None
            kwargs["scale"] = scale
        if q.shape[1] != k.shape[1] and "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)

    return call


def _row_pieces(x: torch.Tensor, row: Sequence[Segment], length: int) -> tuple[torch.Tensor, ...]:
    """``x [1, heads, L, d]`` cut into the row's segments (which tile ``[0, end)`` in order) and the
    padding after them, by one ``split``. Why not a slice per segment: each slice's backward fills a
    zero tensor of the whole row and the engine adds them up, so a row of n segments wrote n full-size
    gradients per layer; a split's backward is one concatenation."""
    done = row[-1].end if row else 0
    sizes = [s.end - s.start for s in row] + ([length - done] if done < length else [])
    return x.split(sizes, dim=2)


def _segment_attention(
    qs: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float | None,
) -> torch.Tensor:
    """One segment of one row: its queries and own keys/values ``[1, heads, n, d]``, and its shared
    prefix's keys/values (a branch) or None; returns ``[1, heads, n, d]``."""
    if prefix is None:
        return F.scaled_dot_product_attention(qs, own_k, own_v, is_causal=True, scale=scale, enable_gqa=True)
    n, p = qs.shape[2], prefix[0].shape[2]
    keys = torch.cat([prefix[0], own_k], dim=2)
    values = torch.cat([prefix[1], own_v], dim=2)
    mask = torch.ones(n, p + n, dtype=torch.bool, device=qs.device)
    mask[:, p:] = torch.tril(mask[:, p:])
    return F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def _segments_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: Sequence[Segment], scale: float | None, groups: int
) -> torch.Tensor:
    """A row segment by segment (sdpa each; a branch sees its prefix): ``[1, heads, L, d]`` out, the
    padding's output being its own value, as in the dense mask."""
    length = q.shape[2]
    qp, kp, vp = (_row_pieces(x, row, length) for x in (q, k, v))
    index = {(s.start, s.end): j for j, s in enumerate(row)}
    parts = []
    for j, s in enumerate(row):
        prefix = None
        if s.has_prefix:
            at = index.get((s.prefix_start, s.prefix_end))
            prefix = (
                (kp[at], vp[at]) if at is not None
                else (k[:, :, s.prefix_start : s.prefix_end], v[:, :, s.prefix_start : s.prefix_end])
            )
        parts.append(_segment_attention(qp[j], kp[j], vp[j], prefix, scale))
    if len(qp) > len(row):  # padding attends to itself only: its output is its value
        parts.append(vp[-1].repeat_interleave(groups, dim=1))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def _varlen_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment], scale: float | None,
    groups: int,
) -> torch.Tensor | None:
    """A tree-free row through one varlen kernel call (flash-attn's, else torch's own on CUDA), as
    OpenRLHF does with packed samples: ``[1, heads, L, d]`` in and out; None where no kernel applies."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or not segments:
        return None
    if any(s.has_prefix for s in segments):
        return None
    end = segments[-1].end
    cu = torch.tensor([0] + [s.end for s in segments], dtype=torch.int32, device=q.device)
    longest = max(s.end - s.start for s in segments)
    qt, kt, vt = (x[0, :, :end].transpose(0, 1) for x in (q, k, v))
    flash = flash_varlen()
    if flash is not None:
        out = flash(qt, kt, vt, cu, cu, longest, longest, softmax_scale=scale, causal=True)
    else:
        kernel = torch_varlen()
        out = kernel(qt, kt, vt, cu, longest, scale) if kernel is not None else None
        if out is None:
            return None
    out = out.transpose(0, 1)[None]
    if end < q.shape[2]:  # padding attends to itself only: its output is its value
        out = torch.cat([out, v[:, :, end:].repeat_interleave(groups, dim=1)], dim=2)
    return out


@torch.compiler.disable
def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query`` ``[B, H, L, d]``, ``key``/``value``
    ``[B, KV, L, d]``) -> ``([B, L, H, d], None)``. Without ``tracerl_segments`` (one right-padded sample
    per row) it is plain causal sdpa. Never traced by ``torch.compile``: see ``SegmentLayout``."""
    if dropout:
        raise ValueError("the varlen attention path has no dropout; load the model with attention dropout 0")
    layout: SegmentLayout | None = kwargs.get(SEGMENTS_KWARG)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    rows = []
    for i, row in enumerate(layout.rows):
        q, k, v = query[i : i + 1], key[i : i + 1], value[i : i + 1]
        out = _varlen_row(q, k, v, row, scaling, groups)
        rows.append(out if out is not None else _segments_row(q, k, v, row, scaling, groups))
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None


def unit_ids(
    spans: Sequence[Sequence[tuple[int, int]]], length: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[R, L]`` long: the index of each token's unit in its row, -1 on padding."""
    unit = torch.full((len(spans), length), -1, dtype=torch.long)
    for i, row in enumerate(spans):
        for j, (start, end) in enumerate(row):
            unit[i, start:end] = j
    return unit.to(device)


def flex_block_mask(spans: Sequence[Sequence[tuple[int, int]]], branch_ids: torch.Tensor) -> Any:
    """The dense mask's rule (``packing.unit_mask``) as a FlexAttention ``BlockMask``: token q sees k when
    both are in one unit, k <= q, and k is shared (branch 0) or in q's branch; padding sees itself."""
    from torch.nn.attention.flex_attention import create_block_mask

    n_rows, length = branch_ids.shape
    unit = unit_ids(spans, length, branch_ids.device)
    branch = branch_ids

    def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        same = (unit[b, q] == unit[b, k]) & (unit[b, q] >= 0)
        visible = (branch[b, k] == 0) | (branch[b, k] == branch[b, q])
        return (same & (k <= q) & visible) | (q == k)

    return create_block_mask(mask_mod, n_rows, None, length, length, device=branch_ids.device)


@functools.cache
def register() -> None:
    """Make ``tracerl_varlen`` a transformers attention implementation (idempotent). It needs no mask
    from transformers (its name is not in the mask interface, so transformers builds none)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPL, varlen_attention_forward)


def resolve(mode: str, device: torch.device) -> str:
    """``--attention auto``: varlen on CPU and CUDA. On one H200 (1.5B model, 45.8k tokens in 3 rows,
    ``--compile-blocks``) varlen trained at 48.5k tok/s against flex's 37.6k (``bench/gpu_checks.sh``,
    session 15); on CPU flex has no backward. An explicit flex on CPU is refused for training with the
    reason."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose one of {', '.join(ATTENTION_MODES)}")
    if mode == "auto":
        return "varlen"
    if mode == "flex" and device.type != "cuda":
        raise ValueError(
            "--attention flex trains on CUDA only: torch's FlexAttention has no backward on CPU; "
            "use --attention varlen (or auto) there"
        )
    return mode


def use_attention(model: Any, mode: str) -> None:
    """Switch a loaded model (a peft wrapper too) to ``mode``'s kernel; dense keeps sdpa/eager as loaded."""
    if mode == "dense":
        return
    name = VARLEN_IMPL if mode == "varlen" else FLEX_IMPL
    if mode == "varlen":
        register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(name)
