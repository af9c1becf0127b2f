"""Packed rows through the memory-efficient attention paths (trainer/attention.py) score and train
exactly as the dense mask does: same logprobs, same gradients, plain packing and shared-prefix trees.

Tolerance: the models run in float64, so the two paths differ only by the order of the float64 sums
inside attention (a segment's softmax over its own keys against a masked softmax over the row);
logprobs are reduced in fp32 by ``sequence_logprobs`` (``.float()``), so the bound is fp32's:
rtol 1e-5, atol 1e-6 on logprobs of size ~5 and on gradients. A leak across samples (one wrong mask
entry) moves logprobs by ~1e-2 on this model, so the bound cannot hide one
(``test_a_leak_is_caught``)."""

from __future__ import annotations

import pytest
import torch

from trainer.attention import Segment, batch_segments, resolve, row_segments, use_attention
from trainer.dataset import Sample, assign_weights
from trainer.packing import Batch, collate, make_batches, sequence_logprobs, share_prefixes

RTOL, ATOL = 1e-5, 1e-6


def _group(prompt_len, response_lens, vocab, *, seed, tails=None):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    out = []
    for j, n in enumerate(response_lens):
        tail = torch.randint(3, vocab, (tails[j],), generator=g).tolist() if tails else []
        resp = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(
            Sample(f"g{seed}-{j}", f"g{seed}-r{j}", head + tail, resp, None, advantage=float(j % 3 - 1))
        )
    return out


def _mixed(vocab: int = 200) -> list[Sample]:
    """Two prompt groups (one with per-sample tails, one tail empty) and two loners."""
    samples = (
        _group(12, [3, 5, 1, 4], vocab, seed=1)
        + _group(9, [2, 6, 3], vocab, seed=2, tails=[0, 4, 2])
        + _group(5, [3], vocab, seed=3)
        + _group(7, [2], vocab, seed=4)
    )
    assign_weights(samples, "rollout")
    return samples


def test_segments_of_plain_and_shared_units():
    # a plain unit [0, 5), then a unit with a 3-token prefix [5, 8) and branches 1 [8, 10) and 2 [10, 13), padding after
    branch = [0] * 8 + [1, 1, 2, 2, 2] + [0, 0]
    assert row_segments([(0, 5), (5, 13)], branch) == [
        Segment(0, 5),
        Segment(5, 8),
        Segment(8, 10, 5, 8),
        Segment(10, 13, 5, 8),
    ]
    batches = make_batches(_mixed(), 64, share_prefix=True)
    for b in batches:
        for row, spans in zip(batch_segments(b.sample_spans, b.branch_ids), b.sample_spans, strict=True):
            # segments tile the row's real tokens in order, and a branch's prefix lies inside its unit
            assert [s.start for s in row[1:]] == [s.end for s in row[:-1]]
            assert row[0].start == 0 and row[-1].end == spans[-1][1]
            assert all(s.prefix_end <= s.start for s in row)


def test_resolve_picks_a_kernel_that_trains_on_the_device():
    assert resolve("auto", torch.device("cpu")) == "varlen"
    assert resolve("auto", torch.device("cuda")) == "varlen"
    assert resolve("dense", torch.device("cpu")) == "dense"
    with pytest.raises(ValueError, match="no backward on CPU"):
        resolve("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="choose one of"):
        resolve("fast", torch.device("cpu"))


def _model(tiny_model_dir, mode: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float64, attn_implementation="sdpa"
    )
    use_attention(model, mode)
    return model


def _loss_and_grads(
    model, batches: list[Batch]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    lps = [sequence_logprobs(model, b, targets=b.weights > 0) for b in batches]
    loss = sum((lp * b.advantages * b.weights).sum() for lp, b in zip(lps, batches, strict=True))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (
        loss.detach(),
        torch.cat([lp[b.weights > 0] for lp, b in zip(lps, batches, strict=True)]).detach(),
        grads,
    )


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared-prefix"])
def test_varlen_gives_the_dense_loss_and_gradients(tiny_model_dir, share):
    samples = _mixed()
    batches = make_batches(samples, 48, 0, share_prefix=share)
    batches.append(collate([share_prefixes(samples[:4], 64)], pad_to=40))  # trailing padding too
    assert any(b.shares_prefixes for b in batches) == share or share is False
    dense = _loss_and_grads(_model(tiny_model_dir, "dense"), batches)
    varlen = _loss_and_grads(_model(tiny_model_dir, "varlen"), batches)
    torch.testing.assert_close(varlen[0], dense[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(varlen[1], dense[1], rtol=RTOL, atol=ATOL)
    assert dense[2].keys() == varlen[2].keys() and len(dense[2]) > 5
    for name, g in dense[2].items():
        torch.testing.assert_close(varlen[2][name], g, rtol=RTOL, atol=ATOL, msg=name)
    assert any(g.abs().sum() > 0 for g in dense[2].values())


@pytest.mark.slow
def test_a_leak_is_caught(tiny_model_dir):
    """The tolerance above would see one wrong visibility rule: a varlen run whose branches do not see
    their prefix scores differently from dense."""
    import trainer.attention as attention

    samples = _mixed()
    batches = make_batches(samples, 48, 0, share_prefix=True)
    dense = _loss_and_grads(_model(tiny_model_dir, "dense"), batches)[1]
    original = attention.row_segments
    try:
        attention.row_segments = lambda spans, branch: [
            Segment(s.start, s.end) for s in original(spans, branch)
        ]
        leaky = _loss_and_grads(_model(tiny_model_dir, "varlen"), batches)[1]
    finally:
        attention.row_segments = original
    assert (leaky - dense).abs().max() > 100 * ATOL


@pytest.mark.slow
def test_flex_scores_as_dense_on_cpu(tiny_model_dir):
    """FlexAttention's BlockMask encodes the same tree (forward only: no flex backward on CPU)."""
    samples = _mixed()
    batches = make_batches(samples, 48, 0, share_prefix=True)
    with torch.no_grad():
        dense = [sequence_logprobs(_model(tiny_model_dir, "dense").float(), b) for b in batches]
        flex = [sequence_logprobs(_model(tiny_model_dir, "flex").float(), b) for b in batches]
    for f, d, b in zip(flex, dense, batches, strict=True):
        real = b.weights > 0
        torch.testing.assert_close(f[real], d[real], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels run on CUDA only")
@pytest.mark.parametrize("kernel", ["torch", "flash-attn"])
def test_one_varlen_call_matches_segment_by_segment_on_cuda(kernel):
    """A tree-free row through one varlen kernel call gives the per-segment sdpa's output and
    gradients (bf16, GQA 6:1, trailing padding): the fast path on CUDA changes no number beyond bf16's
    rounding."""
    import trainer.attention as attention

    if kernel == "torch" and attention.torch_varlen() is None:
        pytest.skip("this torch has no usable torch.nn.attention.varlen")
    if kernel == "flash-attn" and attention.flash_varlen() is None:
        pytest.skip("flash-attn is not installed with its CUDA build")
    g = torch.Generator(device="cuda").manual_seed(0)
    row = [Segment(0, 700), Segment(700, 1500), Segment(1500, 1530)]
    shape = (1, 12, 1600, 128), (1, 2, 1600, 128)
    q = torch.randn(shape[0], generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(shape[1], generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    weight = torch.randn(shape[0], generator=g, device="cuda", dtype=torch.bfloat16)

    def run(fast: bool):
        original = attention.flash_varlen
        if kernel == "torch":
            attention.flash_varlen = lambda: None
        try:
            out = (attention._varlen_row(q, k, v, row, 128**-0.5, 6) if fast
                   else attention._segments_row(q, k, v, row, 128**-0.5, 6))
        finally:
            attention.flash_varlen = original
        assert out is not None
        grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
        return out.detach().float(), [x.float() for x in grads]

    fast_out, fast_grads = run(True)
    ref_out, ref_grads = run(False)
    torch.testing.assert_close(fast_out, ref_out, rtol=2e-2, atol=2e-2)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
    assert ref_grads[0].abs().sum() > 0
