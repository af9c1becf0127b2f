"""Settings of ``tracerl train``: one dataclass, one help text per field, defaults that run on a laptop.

Fields carry the same metadata as ``tracerl.options.opt`` (``help`` and friends), so the CLI
builds its flags from this class while the trainer does not depend on the CLI package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from schemas.store import default_store


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its CLI help text (same metadata shape as ``tracerl.options.opt``)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainSettings:
    """Everything one training round needs; ``tracerl train --help`` lists these as flags."""

    store: str = setting(default_store(), "store directory (transitions/ in, rounds/ and checkpoints/ out)",
                         metavar="DIR")
    model: str | None = setting(None, "base model directory (HF format), served as policy@0; "
                                      "make a tiny one with 'tracerl init-model DIR'", metavar="DIR")
    server: str | None = setting(None, "serving URL to publish each new policy to (vLLM or 'tracerl serve'); "
                                       "several replicas comma-separated, each gets it; none: checkpoints are "
                                       "written but not announced", metavar="URL[,URL]")
    publish: str = setting("auto", "how a LoRA round reaches the server: lora (vLLM load_lora_adapter), full "
                                   "(merged into the base weights, reloaded in place), auto: full for a vLLM on "
                                   "a CPU (an adapter costs about 4x decode speed there), lora elsewhere",
                           choices=["auto", "lora", "full"])
    keep_checkpoints: int = setting(3, "keep the newest N checkpoints (>= 2: the serving one and the one a failed "
                                       "reload restores); 0 keeps all", metavar="N")
    min_rollouts: int = setting(8, "train a round once this many complete, rewarded rollouts of the current "
                                   "version exist")
    every: float = setting(0.0, "also train when this many seconds passed since the last round, with any "
                                "number (>= 2) of rollouts; 0 disables", metavar="S")
    staleness: int = setting(0, "round k also uses not-yet-used rollouts of versions k-S..k-1 (0: strictly "
                                "on-policy)", metavar="S")
    unversioned_as: int = setting(0, "policy version of calls recorded without one (the base model served as "
                                     "plain 'policy' is policy@0); -1 never trains on them", metavar="K")
    served_name: str = setting("policy", "served model name; round k publishes <served-name>@<k+1>", metavar="NAME")
    agents: str | None = setting(None, "train only calls whose agent_name matches this regex", metavar="REGEX")
    tasks: str | None = setting(None, "train only rollouts whose task_id matches this regex; keeps evaluation "
                                      "tasks out of training (e.g. '^train-')", metavar="REGEX")
    backend: str = setting("torch", "training backend: torch (here, or in --nproc ranks) or openrlhf (OpenRLHF "
                                    "+ DeepSpeed ZeRO-2, always in torchrun ranks; CPU ranks over gloo where "
                                    "there is no CUDA)", choices=["torch", "openrlhf"])
    nproc: int = setting(1, "training processes (ranks) on this machine; >1 launches torchrun (gloo on CPU, "
                            "nccl on GPU, one GPU per rank); the openrlhf backend always trains in ranks",
                         metavar="N")
    estimator: str = setting("grpo", "advantage estimator", choices=["grpo", "rloo", "reinforce_baseline"])
    aggregation: str = setting("rollout", "loss averaging: each rollout, each call or each token counts equally",
                               choices=["rollout", "sequence", "token"])
    lr: float = setting(1e-5, "AdamW learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    epochs: int = setting(1, "passes over a round's data (PPO epochs)")
    steps_per_epoch: int = setting(1, "optimizer steps per pass (mini-batches); >1 makes later steps off-policy "
                                      "and PPO clipping active")
    max_grad_norm: float = setting(1.0, "gradient clipping norm; 0 disables")
    clip_eps_low: float = setting(0.2, "PPO clip: lower bound 1 - eps_low on the ratio")
    clip_eps_high: float = setting(0.2, "PPO clip: upper bound 1 + eps_high (raise for DAPO clip-higher)")
    dual_clip: float | None = setting(None, "dual-clip bound for negative advantages (> 1); none disables")
    kl_coef: float = setting(0.0, "weight of the KL penalty to the base model; 0 disables (no reference pass)")
    kl_estimator: str = setting("k3", "KL estimator", choices=["k1", "k2", "k3"])
    is_correction: str = setting("clip", "importance correction with the serving engine's logprobs",
                                 choices=["off", "clip", "mask"])
    is_low: float = setting(0.5, "importance ratio lower bound (clip/mask)")
    is_high: float = setting(5.0, "importance ratio upper bound (clip/mask)")
    max_prompt_tokens: int = setting(1024, "keep the last N prompt tokens (counted when truncated)")
    max_response_tokens: int = setting(1024, "keep the first N response tokens (counted when truncated)")
    pack_tokens: int = setting(2048, "tokens per packed micro-batch row (>= max prompt + max response tokens; "
                                     "on CPU keep it near the longest sample: attention is O(L^2) per row)")
    share_prefix: bool = setting(True, "torch backend: calls whose prompts start alike (a group's samples) compute "
                                       "the common prefix once, with a tree-shaped attention mask: same gradient, "
                                       "2.9x fewer tokens on the demo's rounds (trainer/packing.py); not with "
                                       "flash-attention")
    lora_rank: int = setting(0, "LoRA rank; 0 trains all weights")
    lora_alpha: float = setting(16.0, "LoRA alpha")
    lora_targets: str = setting("all-linear", "LoRA target modules (comma list or 'all-linear')")
    device: str = setting("auto", "torch device: auto (cuda if available), cpu, cuda, cuda:1, ...; openrlhf "
                                  "with cpu: DeepSpeed's CPU accelerator, fp32, torch's AdamW")
    bf16: bool = setting(True, "bf16 on GPU (torch: autocast; openrlhf: DeepSpeed bf16) and, with the torch "
                               "backend, autocast on a CPU with bf16 instructions (AVX512-BF16 or AMX); openrlhf "
                               "on CPU and other CPUs train in fp32; --no-bf16 trains in fp32 everywhere")
    threads: int = setting(1, "torch threads of each training process on CPU (0: torch's default, one per core); "
                              "on cores shared with the agents and the server, more threads wait on each other")
    seed: int = setting(0, "random seed")
    poll_s: float = setting(10.0, "--watch: seconds between checks of the store")
    max_rounds: int = setting(0, "--watch: stop after this many rounds; 0 runs until interrupted")
    progress: bool = setting(True, "show progress bars")
