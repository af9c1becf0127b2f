"""Samples -> micro-batches: packing and shared prompt prefixes score every token exactly as if
each sample ran alone, forward and backward, on a real tiny model (sdpa and eager attention)."""

from __future__ import annotations

import pytest
import torch

from trainer.dataset import Sample, assign_weights
from trainer.packing import (
    Batch,
    Unit,
    collate,
    make_batches,
    make_padded_batches,
    pack_units,
    sequence_logprobs,
    share_prefixes,
)

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def _samples(lengths, tokenizer):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(3, len(tokenizer), (p + r,), generator=g).tolist()
        out.append(Sample(f"t{i}", f"r{i}", ids[:p], ids[p:], None, advantage=float(i % 3 - 1)))
    assign_weights(out, "token")
    return out


def _group(prompt_len, response_lens, tokenizer, *, seed, tails=None):
    """Samples answering one prompt (optionally each with its own prompt tail after the shared head)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, len(tokenizer), (prompt_len,), generator=g).tolist()
    out = []
    for j, n in enumerate(response_lens):
        tail = torch.randint(3, len(tokenizer), (tails[j],), generator=g).tolist() if tails else []
        resp = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
        lps = (-torch.rand(n, generator=g)).tolist()
        out.append(Sample(f"g{seed}-{j}", f"g{seed}-r{j}", head + tail, resp, lps, advantage=float(j % 3 - 1)))
    return out


def _mixed(tokenizer):
    """Two groups with a common head (one where every prompt is identical, one with per-sample tails
    of different lengths, one tail empty), plus loners."""
    samples = (_group(12, [3, 5, 1, 4], tokenizer, seed=1) + _group(9, [2, 6, 3], tokenizer, seed=2, tails=[0, 4, 2])
               + _samples([(5, 3), (7, 2)], tokenizer))
    assign_weights(samples, "rollout")
    return samples


def test_packing_fills_rows_without_exceeding_capacity(tokenizer):
    samples = _samples([(5, 3), (20, 10), (2, 2), (7, 7), (30, 2)], tokenizer)
    rows = pack_units([Unit(0, [s]) for s in samples], pack_tokens=32)
    assert all(sum(u.length for u in row) <= 32 for row in rows)
    assert sorted(u.members[0].transition_id for row in rows for u in row) == sorted(s.transition_id for s in samples)
    assert len(rows) == 3  # 32 | 30+2 | 14+8+4 = 26 ... first-fit decreasing
    with pytest.raises(ValueError, match="raise --pack-tokens"):
        pack_units([Unit(0, [s]) for s in samples], pack_tokens=16)


def test_shared_prefixes_group_equal_prompt_heads_and_never_share_responses(tokenizer):
    samples = _mixed(tokenizer)
    units = share_prefixes(samples, pack_tokens=64)
    shared = sorted((u.shared, sorted(m.transition_id for m in u.members)) for u in units if u.shared)
    assert shared == [(9, ["g2-0", "g2-1", "g2-2"]), (12, ["g1-0", "g1-1", "g1-2", "g1-3"])]
    assert sorted(m.transition_id for u in units for m in u.members) == sorted(s.transition_id for s in samples)
    assert all(u.shared <= len(m.prompt_ids) for u in units for m in u.members)
    assert sum(u.length for u in units) == sum(s.length for s in samples) - 12 * 3 - 9 * 2
    # a unit never outgrows a row: the 4-sample group (12 + 3+5+1+4 = 25 tokens) splits at 20
    small = share_prefixes(samples, pack_tokens=20)
    assert all(u.length <= 20 for u in small)
    assert sorted(m.transition_id for u in small for m in u.members) == sorted(s.transition_id for s in samples)
    # a short common head is not worth a unit
    assert all(u.shared == 0 for u in share_prefixes(samples, pack_tokens=64, min_shared=13))


def _alone(model, s: Sample) -> torch.Tensor:
    return sequence_logprobs(model, collate([[s]]))[0, len(s.prompt_ids) - 1:]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_logprobs_equal_each_sample_alone(tiny_model_dir, tokenizer, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    samples = _mixed(tokenizer)
    by_id = {s.transition_id: s for s in samples}
    units = share_prefixes(samples, pack_tokens=64)
    batch = collate([units], pad_id=tokenizer.pad_token_id, pad_to=80)
    assert batch.shares_prefixes and batch.n_tokens == sum(s.length for s in samples) - 12 * 3 - 9 * 2
    with torch.no_grad():
        lp = sequence_logprobs(model, batch, targets=batch.weights > 0)
        scored = lp[batch.weights > 0]  # every response token, in layout order
        expected = torch.cat([_alone(model, by_id[m.transition_id]) for u in units for m in u.members])
        torch.testing.assert_close(scored, expected, rtol=1e-4, atol=1e-5)
        # the weights sit on response tokens only and survive the layout unchanged
        assert batch.weights.sum().item() == pytest.approx(sum(s.weight * len(s.response_ids) for s in samples))
        full = sequence_logprobs(model, batch)  # every position scored: equals the targeted run where targeted
        torch.testing.assert_close(full[batch.weights > 0], scored, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked_logprobs(tiny_model_dir, tokenizer, attn):
    """No attention leaks across packed samples: each sample scores as if it were alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    samples = _samples([(6, 4), (3, 9), (11, 2)], tokenizer)
    packed = collate([samples], pad_id=tokenizer.pad_token_id, pad_to=40)  # with trailing padding
    with torch.no_grad():
        lp_packed = sequence_logprobs(model, packed)
        for (start, end), s in zip(packed.sample_spans[0], samples, strict=True):
            alone = collate([[s]])
            lp_alone = sequence_logprobs(model, alone)[0]
            torch.testing.assert_close(lp_packed[0, start:end - 1], lp_alone, rtol=1e-4, atol=1e-5)
        # without the block-diagonal mask (position_ids only, cache on: transformers then does not look for
        # packed sequences) the later samples *would* see the earlier ones
        leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
        s0_end = packed.sample_spans[0][0][1]
        alone1 = model(input_ids=collate([[samples[1]]]).input_ids).logits[0]
        assert not torch.allclose(leaky[0, s0_end:s0_end + samples[1].length], alone1, atol=1e-3)


def _weighted_loss(model, batches: list[Batch]) -> torch.Tensor:
    return sum((sequence_logprobs(model, b, targets=b.weights > 0) * b.advantages * b.weights).sum() for b in batches)


def test_shared_prefix_gradients_equal_plain_packing(tiny_model_dir, tokenizer):
    """The prefix computed once gets every sample's gradient: the step is the same as plain packing's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    samples = _mixed(tokenizer)
    grads = []
    for share in (False, True):
        model.zero_grad()
        batches = make_batches(samples, 48, tokenizer.pad_token_id, share_prefix=share)
        assert any(b.shares_prefixes for b in batches) == share
        _weighted_loss(model, batches).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-8, msg=name)  # logprobs are fp32
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_padded_batches_give_the_same_logprobs_as_packed(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    samples = _samples([(6, 4), (3, 9), (11, 2), (2, 2)], tokenizer)
    with torch.no_grad():
        def weighted(batches):
            return sum((sequence_logprobs(model, b) * b.weights).sum().item() for b in batches)
        assert weighted(make_batches(samples, 32)) == pytest.approx(weighted(make_padded_batches(samples, 3)), rel=1e-5)
        assert weighted(make_batches(samples, 32, share_prefix=True)) == pytest.approx(
            weighted(make_batches(samples, 32)), rel=1e-5)


def test_a_batch_survives_its_state_round_trip_mask_included(tokenizer):
    for b in make_batches(_mixed(tokenizer), 48, share_prefix=True):
        back = Batch.from_state(b.state())
        assert back.attention_mask.equal(b.attention_mask) and back.pred_from.equal(b.pred_from)


def test_a_unit_of_one_is_laid_out_plainly(tokenizer):
    (s,) = _samples([(4, 2)], tokenizer)
    assert share_prefixes([s], 64) == [Unit(0, [s])]
    b = collate([[s]])
    assert not b.shares_prefixes and b.pred_from.tolist() == [list(range(5))]
