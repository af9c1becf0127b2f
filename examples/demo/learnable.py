"""Sanity check of the demo task, not of tracerl: can the tiny random model learn it by RL?

Runs, in one process and without the agent, server or trainer, group-relative REINFORCE on the
writer's call (the demo's prompt and reward, 4 tasks x 8 samples per round) and prints the mean
reward per round. It shows the task has a learning signal a from-scratch model can follow; the
real loop (`tracerl rollout` + `tracerl train`) is what trains the agent.

    python examples/demo/learnable.py --model ./tiny --rounds 60     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"demo_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (tracerl init-model DIR)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--group", type=int, default=8, help="samples per task per round")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--letters", default="aeot")
    p.add_argument("--max-tokens", type=int, default=6)
    args = p.parse_args()
    agent, reward = _load("agent"), _load("reward")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompts = {}
    for c in args.letters:
        ids = tok.apply_chat_template([{"role": "user", "content": agent.writer_prompt(c)}],
                                      add_generation_prompt=True, return_tensors="pt")
        prompts[c] = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    for rnd in range(args.rounds):
        opt.zero_grad()
        seen = []
        for c, ids in prompts.items():
            model.eval()
            with torch.no_grad():
                seqs = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                                      max_new_tokens=args.max_tokens, num_return_sequences=args.group)
            n = ids.shape[1]
            rewards = torch.tensor([reward.letter_score(tok.decode(s[n:], skip_special_tokens=True), c, args.letters)
                                    for s in seqs])
            seen += rewards.tolist()
            if rewards.std() == 0:
                continue  # no signal in a group whose samples all scored the same
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            model.train()
            resp = seqs[:, n:]
            mask = (resp != pad).float()
            logp = torch.log_softmax(model(seqs).logits[:, n - 1:-1].float(), -1)
            logp = logp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
            loss = -(adv[:, None] * logp * mask).sum(1) / mask.sum(1).clamp(min=1)
            (loss.mean() / len(prompts)).backward()
        opt.step()
        print(f"round {rnd:3d}  mean reward {statistics.fmean(seen):.3f}", flush=True)


if __name__ == "__main__":
    main()
