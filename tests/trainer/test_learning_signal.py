"""A real learning signal: on a task whose reward is a known function of the response, the policy's
*exact* expected reward rises over rounds of sample -> transitions Parquet -> ``run_once``.

Task: for each of a few prompts, the policy writes a short response; the reward is 1 when the first
response token is in a fixed target set (the even token ids), else 0. The expected reward of a
policy is then exactly the mean over prompts of P(first token in target | prompt), read from the
model's softmax: no sampling noise in the measurement, only in the training data.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from store.layout import StoreLayout
from trainer.checkpoint import checkpoint_dir
from trainer.config import TrainSettings
from trainer.manifest import read_rounds
from trainer.rounds import run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

N_TASKS = 4
GROUP = 8  # rollouts per task per round
RESPONSE_TOKENS = 3
ROUNDS = 3
MARGIN = 0.15  # absolute rise in expected reward required after ROUNDS rounds


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for t in range(N_TASKS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"task {t}: pick a token"}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def target_mask(vocab: int) -> torch.Tensor:
    return torch.arange(vocab) % 2 == 0


def expected_reward(model, prompt_ids: list[list[int]], target: torch.Tensor) -> float:
    with torch.no_grad():
        probs = [torch.softmax(model(torch.tensor([p])).logits[0, -1].float(), -1)[target].sum().item()
                 for p in prompt_ids]
    return sum(probs) / len(probs)


def sample_rollouts(model, prompt_ids, target, version: int, gen: torch.Generator, make_row) -> list[dict]:
    """The 'agent' plus 'serving engine': sample from the current policy, record ids and logprobs."""
    rows = []
    with torch.no_grad():
        for t, p in enumerate(prompt_ids):
            for _ in range(GROUP):
                ids, lps = list(p), []
                for _ in range(RESPONSE_TOKENS):
                    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    ids.append(tok)
                    lps.append(float(logp[tok]))
                response = ids[len(p):]
                reward = 1.0 if target[response[0]] else 0.0
                rows.append(make_row(f"v{version}-{uuid.uuid4().hex[:8]}", task_id=f"task-{t}", version=version,
                                     reward=reward, prompt_ids=p, response_ids=response, logprobs=lps))
    return rows


def test_expected_reward_rises_over_rounds(tmp_path: Path, tiny_model_dir, tokenizer, make_row, write_rows):
    from transformers import AutoModelForCausalLM

    store = tmp_path / "store"
    layout = StoreLayout.at(store)
    settings = TrainSettings(store=str(store), model=str(tiny_model_dir), min_rollouts=N_TASKS * GROUP,
                             lr=3e-3, epochs=2, steps_per_epoch=2, progress=False, pack_tokens=256, seed=0)
    p_ids = prompts(tokenizer)
    gen = torch.Generator().manual_seed(1234)
    policy_dir = tiny_model_dir
    history = []
    for k in range(ROUNDS):
        model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
        target = target_mask(model.config.vocab_size)
        history.append(expected_reward(model, p_ids, target))
        write_rows(store, sample_rollouts(model, p_ids, target, k, gen, make_row))
        out = run_once(settings, log=lambda m: None)
        assert out.status == "trained" and out.round == k
        policy_dir = checkpoint_dir(layout.checkpoints, k + 1)
    final = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    history.append(expected_reward(final, p_ids, target_mask(final.config.vocab_size)))
    print("expected reward per policy version:", [round(h, 4) for h in history])
    rounds = read_rounds(layout.location)
    assert [r["policy_version"] for r in rounds.values()] == list(range(ROUNDS))
    assert history[-1] >= history[0] + MARGIN, history
    # the sampled reward recorded in the manifest moves the same way as the exact one
    assert rounds[ROUNDS - 1]["mean_reward"] > rounds[0]["mean_reward"]
