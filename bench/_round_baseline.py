"""The bare baseline ``bench/round.py`` sets the loop against: the same model in the bench's own process,
``model.generate`` on the very prompts the loop's calls sent (their recorded token ids) and one bare LoRA
policy-gradient step on the recorded responses. No server, no spans, no store: what the loop's
generation and training would cost with none of tracerl around them.

Imported by ``bench/round.py`` with ``bench/`` on ``sys.path`` (the scripts are plain files, not a package).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

AGENTS = ("writer", "rewriter")
"""The demo's agents in call order: each rewriter call needs its writer's answer, so they are generated apart."""


def bare_model(model: Path, lora_rank: int) -> tuple[Any, Any]:
    """(tokenizer, model): the base weights under a fresh LoRA of the trainer's shape (zero B: same outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.config import TrainSettings

    tok = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    s = TrainSettings()
    targets = s.lora_targets if s.lora_targets == "all-linear" else s.lora_targets.split(",")
    cfg = LoraConfig(
        r=lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets
    )
    return tok, get_peft_model(base, cfg)


@contextlib.contextmanager
def generating(model: Any) -> Iterator[None]:
    """Within: ``model`` in eval mode without gradients, as a server generates; back to training after."""
    import torch

    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()


def bare_generate(
    model: Any, prompts: list[list[int]], max_tokens: int, batch: int, pad: int
) -> tuple[float, int]:
    """Left-padded batches of ``model.generate`` (sampling at temperature 1); (seconds, new tokens)."""
    import torch

    t, new = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
        )
        new += int((out[:, width:] != pad).sum())
    return time.perf_counter() - t, new


def bare_step(model: Any, rows: list[dict], lr: float, autocast: Callable[[], Any]) -> tuple[float, int]:
    """One policy-gradient step, -A*logp over every response token, advantages = reward - task mean;
    (seconds, tokens)."""
    import torch

    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["task_id"], []).append(r["reward"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    t = time.perf_counter()
    seqs = [r["prompt_token_ids"] + r["response_token_ids"] for r in rows]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    resp = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        p = len(r["prompt_token_ids"])
        resp[i, p - 1 : p - 1 + len(r["response_token_ids"])] = 1
    adv = torch.tensor([r["reward"] - sum(groups[r["task_id"]]) / len(groups[r["task_id"]]) for r in rows])
    with autocast():
        logits = model(input_ids=ids).logits[:, :-1].float()
    logp = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    loss = -(adv[:, None] * logp * resp).sum() / resp.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t, int(sum(map(len, seqs)))


def bare_round(
    tok: Any,
    model: Any,
    rows: list[dict],
    max_tokens: int,
    batch: int,
    lr: float,
    autocast: Callable[[], Any],
) -> dict[str, float]:
    """The baseline of one round on its transitions ``rows``: the writers' prompts generated, then the
    rewriters', in batches of ``batch`` (the server's --max-num-seqs), then one bare step."""
    with generating(model):
        gens = [
            bare_generate(
                model,
                [x["prompt_token_ids"] for x in rows if x["agent_name"] == agent_name],
                max_tokens,
                batch,
                tok.pad_token_id,
            )
            for agent_name in AGENTS
        ]
    r = {"bare_generate_s": sum(g[0] for g in gens), "bare_generated_tokens": sum(g[1] for g in gens)}
    r["bare_step_s"], r["step_tokens"] = bare_step(model, rows, lr, autocast)
    r["bare_s"] = r["bare_generate_s"] + r["bare_step_s"]
    return r
