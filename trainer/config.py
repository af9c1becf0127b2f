"""Settings of ``tracerl train``: one dataclass, one help text per field, defaults that run on a laptop.

Fields are declared with ``options.opt`` (the ground-floor settings helper, standard library only: the
trainer imports nothing of the CLI), so the CLI builds its flags from this class. Choices come from the
registries that define them (``trainer.choices``, ``trainer.backends.BACKENDS``), not restated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from options import opt
from store.layout import default_store
from trainer.advantages import AUTO, ESTIMATORS, GROUP_ESTIMATOR, GROUP_FREE_ESTIMATOR, REPEAT_SHARE
from trainer.backends import BACKENDS
from trainer.choices import AGGREGATIONS, IS_CORRECTIONS, KL_ESTIMATORS, PUBLISH_MODES


@dataclass
class TrainSettings:
    """Everything one training round needs; ``tracerl train --help`` lists these as flags."""

    store: str = opt(default_store(), "store directory (transitions/ in, rounds/ and checkpoints/ out), or "
                                      "s3://bucket/prefix", metavar="DIR|URI")
    checkpoints: str = opt("", "local directory checkpoints are written to and loaded from (torch saves and vLLM "
                               "loads local files); default STORE/checkpoints, or ./tracerl-checkpoints when "
                               "the store is s3://, where each complete checkpoint is also copied to "
                               "STORE/checkpoints/ and fetched back on a host that lacks it", metavar="DIR")
    model: str | None = opt(None, "base model directory (HF format), served as policy@0; "
                                  "make a tiny one with 'tracerl init-model DIR'", metavar="DIR")
    server: str | None = opt(None, "serving URL to publish each new policy to (vLLM or 'tracerl serve'); "
                                   "several replicas comma-separated, each gets it (with --canary: the two "
                                   "arms' servers, and a full-weight round reloads only the one not serving); "
                                   "none: checkpoints are written but not announced", metavar="URL[,URL]")
    publish: str = opt("auto", "how a LoRA round reaches the server: lora (vLLM load_lora_adapter), full "
                               "(merged into the base weights, reloaded in place), auto: full for a vLLM on "
                               "a CPU (an adapter costs about 4x decode speed there), lora elsewhere",
                       choices=list(PUBLISH_MODES))
    keep_checkpoints: int = opt(3, "keep the newest N checkpoints (>= 2: the serving one and the one a failed "
                                   "reload restores); 0 keeps all", metavar="N")
    min_rollouts: int = opt(8, "train a round once this many complete, rewarded rollouts of the current "
                               "version exist")
    max_rollouts: int = opt(0, "cap a round at N rollouts, so cron rounds on a busy service stay bounded and "
                               "on-policy: the newest N of the serving version (most recently ended first), then "
                               "of older versions within --max-staleness; the rest are not consumed (a later "
                               "round may take them; past --max-staleness they are dropped and counted). "
                               "0: no cap, every unused rollout", metavar="N")
    every: float = opt(0.0, "also train when this many seconds passed since the last round, with any "
                            "number (>= 2) of rollouts; 0 disables", metavar="S")
    max_staleness: int = opt(0, "asynchronous rounds: round k also trains on not-yet-used rollouts that started "
                                "on versions k-K..k-1 (rollouts keep running while it trains), each call "
                                "corrected by its importance weight; older unused ones are dropped and counted. "
                                "0: strictly on-policy", metavar="K")
    feedback_window: str = opt("0", "late and sparse feedback: train a rollout only once this long has passed since "
                                    "its last call ended (600, 10m, 2h, 1d), so feedback that comes later still "
                                    "counts; rollouts still waiting are not trained yet, those without feedback at "
                                    "the close are left out; both are counted. Use with --max-staleness >= 1 so "
                                    "rollouts still waiting when a round publishes are trained by the next one. "
                                    "0: train at once", metavar="DURATION")
    stale_without_logprobs: str = opt("drop", "a stale call recorded without the engine's logprobs (retokenized) "
                                              "has no importance weight: drop it (counted) or train on it as if "
                                              "on-policy", choices=["drop", "train"])
    unversioned_as: int = opt(0, "policy version of calls recorded without one (the base model served as "
                                 "plain 'policy' is policy@0); -1 never trains on them", metavar="K")
    served_name: str = opt("policy", "served model name; round k publishes <served-name>@<k+1>", metavar="NAME")
    canary: bool = opt(False, "publish each round as a canary (status 'canary'): it serves the gateway's "
                              "--canary share beside the version it trained from, and the next round waits "
                              "until `tracerl promote --once` promotes or rolls it back")
    gateway: str = opt("", "--watch --canary: decide each canary between polls (as `tracerl promote --once` with "
                           "its default rule) and tell this `tracerl gateway --canary` the pair and the share; "
                           "unset: run `tracerl promote --once --gateway URL` from cron", metavar="URL")
    gate_tasks: str = opt("", "--canary: an eval gate before each canary: run this held-out tasks file (JSONL, as "
                              "`tracerl rollout --tasks`) with --gate-agent against the candidate's server and the "
                              "serving one; the candidate goes to live traffic only if its success (mean "
                              "--gate-reward; a failed run counts 0) is no worse than serving's minus --gate-margin, "
                              "else it is rolled back with the gate's numbers. Needs two full-weight servers "
                              "(--server A,B)", metavar="FILE")
    gate_agent: str = opt("", "--gate-tasks: the agent command, as after `tracerl rollout --` (one string, split "
                              "like a shell), e.g. 'python examples/demo/agent.py'", metavar="CMD")
    gate_reward: str = opt("", "--gate-tasks: the reward function scoring the agent's stdout, MODULE:FN or "
                               "FILE.py:FN (as `tracerl rollout --reward`)", metavar="FN")
    gate_samples: int = opt(1, "--gate-tasks: runs per task on each arm", metavar="N")
    gate_margin: float = opt(0.05, "--gate-tasks: the loss of held-out success a candidate may show and still pass",
                             metavar="M")
    agents: str | None = opt(None, "train only calls whose agent_name matches this regex", metavar="REGEX")
    tasks: str | None = opt(None, "train only rollouts whose task_id matches this regex; keeps evaluation "
                                  "tasks out of training (e.g. '^train-')", metavar="REGEX")
    backend: str = opt("torch", "training backend: torch (here, or in --nproc ranks) or openrlhf (OpenRLHF "
                                "+ DeepSpeed ZeRO-2, always in torchrun ranks; CPU ranks over gloo where "
                                "there is no CUDA)", choices=list(BACKENDS))
    nproc: int = opt(1, "training processes (ranks) on this machine; >1 launches torchrun (gloo on CPU, "
                        "nccl on GPU, one GPU per rank); the openrlhf backend always trains in ranks",
                     metavar="N")
    estimator: str = opt(AUTO, f"advantage estimator; auto: {GROUP_ESTIMATOR} where the round's tasks repeat "
                               f"(a share >= {REPEAT_SHARE:g} of its rollouts share their task with another), else "
                               f"{GROUP_FREE_ESTIMATOR} (group-free: a service's requests that never repeat "
                               "train too); the round manifest records which and why",
                         choices=[AUTO, *ESTIMATORS])
    aggregation: str = opt("rollout", "loss averaging: each rollout, each call or each token counts equally",
                           choices=list(AGGREGATIONS))
    lr: float = opt(1e-5, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    epochs: int = opt(1, "passes over a round's data (PPO epochs)")
    steps_per_epoch: int = opt(1, "optimizer steps per pass (mini-batches); >1 makes later steps off-policy "
                                  "and PPO clipping active")
    max_grad_norm: float = opt(1.0, "gradient clipping norm; 0 disables")
    clip_eps_low: float = opt(0.2, "PPO clip: lower bound 1 - eps_low on the ratio")
    clip_eps_high: float = opt(0.2, "PPO clip: upper bound 1 + eps_high (raise for DAPO clip-higher)")
    dual_clip: float | None = opt(None, "dual-clip bound for negative advantages (> 1); none disables")
    kl_coef: float = opt(0.0, "weight of the KL penalty to the base model; 0 disables (no reference pass)")
    kl_estimator: str = opt("k3", "KL estimator", choices=list(KL_ESTIMATORS))
    is_correction: str = opt("clip", "importance correction with the serving engine's logprobs",
                             choices=list(IS_CORRECTIONS))
    is_low: float = opt(0.5, "importance ratio lower bound (clip/mask)")
    is_high: float = opt(5.0, "importance ratio upper bound (clip/mask)")
    max_prompt_tokens: int = opt(1024, "keep the last N prompt tokens (counted when truncated)")
    max_response_tokens: int = opt(1024, "keep the first N response tokens (counted when truncated)")
    pack_tokens: int = opt(2048, "tokens per packed micro-batch row (>= max prompt + max response tokens; "
                                 "attention memory grows linearly with the row, except with --attention dense)")
    share_prefix: bool = opt(True, "torch backend: calls whose prompts start alike (a group's samples) compute "
                                   "the common prefix once, with a tree-shaped attention mask: same gradient, "
                                   "2.9x fewer tokens on the demo's rounds (trainer/packing.py); not with "
                                   "flash-attention")
    attention: str = opt("auto", "torch backend: attention kernel for packed rows. varlen: each sample (or shared "
                                 "prefix and branch) through sdpa's memory-efficient kernel, flash-attn varlen on "
                                 "CUDA where installed; flex: PyTorch FlexAttention with a block mask (CUDA only: "
                                 "no backward on CPU); dense: an explicit L x L mask (memory grows with the row's "
                                 "square); auto: varlen (the fastest on CPU and on one H200). All give the same gradients "
                                 "(trainer/attention.py)", choices=["auto", "varlen", "flex", "dense"])
    activation_checkpointing: bool = opt(False, "torch backend: keep only each decoder layer's input in the "
                                                "forward pass and recompute the layer in the backward pass: "
                                                "activation memory drops by about the layer count, a step costs "
                                                "about a third more compute (for long rows or big models on a GPU)")
    compile_blocks: bool = opt(False, "torch backend: torch.compile each decoder layer whole (dynamic shapes and "
                                      "an opaque packed layout, so rows of any length and layout reuse one graph; "
                                      "its norms and MLP only under --activation-checkpointing): the elementwise "
                                      "ops around the matmuls fuse. On one H200 a 1.5B model went from 33.4%% to "
                                      "43.8%% MFU. The first step pays the compile (tens of seconds)")
    keep_model: bool = opt(False, "torch backend in one process (--watch): keep the trained model and its "
                                  "optimizer in memory for the next round when it starts from the checkpoint "
                                  "just written, instead of reading them back (0.9-1.0 s a round for the "
                                  "demo's SmolLM2 LoRA on 2 cores); the memory stays held between rounds")
    lora_rank: int = opt(0, "LoRA rank; 0 trains all weights")
    lora_alpha: float = opt(16.0, "LoRA alpha")
    lora_targets: str = opt("all-linear", "LoRA target modules (comma list or 'all-linear')")
    device: str = opt("auto", "torch device: auto (cuda if available), cpu, cuda, cuda:1, ...; openrlhf "
                              "with cpu: DeepSpeed's CPU accelerator, fp32, torch's AdamW")
    bf16: bool = opt(True, "bf16 on GPU (torch: autocast; openrlhf: DeepSpeed bf16) and, with the torch "
                           "backend, autocast on a CPU with bf16 instructions (AVX512-BF16 or AMX); openrlhf "
                           "on CPU and other CPUs train in fp32; --no-bf16 trains in fp32 everywhere")
    threads: int = opt(1, "torch threads of each training process on CPU (0: torch's default, one per core); "
                          "on cores shared with the agents and the server, more threads wait on each other")
    seed: int = opt(0, "random seed")
    poll_s: float = opt(10.0, "--watch: seconds between checks of the store; on a local store a check also "
                              "happens as soon as new transitions are written")
    max_rounds: int = opt(0, "--watch: stop after this many rounds; 0 runs until interrupted")
    progress: bool = opt(True, "show progress bars")
