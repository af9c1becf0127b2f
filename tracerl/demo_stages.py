"""The stages of ``loop.rounds`` as ``tracerl demo`` runs them (``DemoStages``): the rollout driver against
the demo's processes, ``convert_store`` over its store (with ``--reward judge``, the judge between two
conversions), ``run_once`` with its settings and publisher, and the held-out evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loop.rounds import Batch, LoopPlan, Stages, Training
from loop.watch import round_status, store_answers, store_rewards, wait_for_round
from store.location import StoreLocation, parse_store
from tracerl.demo_config import DemoConfig, DemoRun, agent_env
from tracerl.demo_tasks import LORA_TARGETS, DemoTask, HeldOut, held_out_summary
from tracerl.supervisor import BIN, Children

if TYPE_CHECKING:  # imported where used: training pulls in torch
    from judge.batch import BatchJudgment
    from judge.config import JudgeSettings
    from span_to_transition.convert import ConvertConfig
    from trainer.config import TrainSettings
    from trainer.rounds import Publisher, RoundOutcome


AGENT_NICE = 10
"""How much lower the CPU priority of agents that may run beside training is (``Driver.nice``): on 2
cores a trainer micro-batch took 2.3-2.7 s alone and 8.6-8.9 s beside 32 agents at equal priority
(bench/async_round.py, load 13). Policy@0's held-out evaluation runs at this: round 0 waits for it
to publish, so the evaluation, not the trainer, is the one to finish first."""

AHEAD_NICE = 19
"""The priority of a batch's agents run ahead beside training (``--max-staleness``), lowest: there the
trainer is the bound. 32 agents starting at once at nice 10 outweighed it (a weight of 110 each
against its 1024): the first micro-batch of each round took 5.2-5.4 s (2.6-3.4 CPU-s) against
2.6-2.9 s at nice 19 (an asynchronous demo, 2026-11-28); the batch's rollouts took about 1 s longer."""

STORE_CLOCK_SLACK_S = 30.0
"""A batch's look at the store reads the files written from this long before its first agent started on
(``loop.watch.wait_for_round``'s ``since``): a bucket stamps objects with its own clock, not this host's.
Reading every file, a look took 0.55 s four rounds into the demo (136 span files) and grew each round."""

PASS_REWARD = 1.0
"""A grader reward that is a pass in the judge's AUC: the gold rows (sql_reward.py), the right letter."""


def demo_judge(cfg: DemoConfig, store: Path, server_url: str, task: DemoTask) -> JudgeSettings:
    """The judge of --reward judge: the demo's served model (``policy``), asked directly, not through the
    gateway (whose spans would make the judge's calls look like the agent's); group mode, a task's samples
    in one call, and no settling wait (a round is judged once all of it is stored)."""
    from judge.config import JudgeSettings

    return JudgeSettings(
        store=str(store),
        judge_url=f"{server_url}/v1",
        judge_model="policy",
        mode="group",
        group_wait_s=0.0,
        max_group=task.group,
        judge_concurrency=max(1, task.per_round),
        judge_timeout_s=cfg.timeout_s,
        max_tokens=cfg.judge_max_tokens,
    )


def driver_settings(
    cfg: DemoConfig,
    task: DemoTask,
    loc: StoreLocation,
    ports: tuple[int | None, int, int, int],
    concurrency: int,
) -> dict[str, Any]:
    """The rollout driver's settings every batch shares (``rollout.driver.Driver`` less its tasks): the demo
    agent under ``opentelemetry-instrument``, pointed at the demo's collector and gateway."""
    from rollout.rewards import load_reward_fn

    _, gateway_port, grpc_port, http_port = ports
    return dict(
        command=[str(BIN / "opentelemetry-instrument"), sys.executable, str(task.agent)],
        concurrency=concurrency,
        collector=f"http://127.0.0.1:{http_port}",
        otlp=f"http://127.0.0.1:{grpc_port}",
        gateway=f"http://127.0.0.1:{gateway_port}/v1",
        reward_fn=load_reward_fn(task.reward),
        timeout_s=cfg.timeout_s,
        retries=0,
        store=loc,
        base_env=agent_env(cfg),
        launcher=cfg.launcher,
    )


def train_settings(
    cfg: DemoConfig, task: DemoTask, store: Path, model: Path, server_url: str, plan: LoopPlan
) -> TrainSettings:
    """``tracerl train --once``'s settings for every round of the demo (the threads are the loop's)."""
    from trainer.config import TrainSettings

    real = task.name == "sql"
    return TrainSettings(
        store=str(store),
        model=str(model),
        server=server_url,
        min_rollouts=2,
        lr=cfg.lr,
        epochs=cfg.epochs,
        steps_per_epoch=cfg.steps_per_epoch,
        lora_rank=cfg.lora_rank,
        lora_targets=LORA_TARGETS[task.name],
        tasks=task.train_tasks_regex,
        # the SQL prompts (schema, example, the rewriter's result rows) run to ~300 tokens
        max_prompt_tokens=512 if real else 256,
        max_response_tokens=64,
        pack_tokens=640 if real else 512,
        progress=False,
        threads=plan.alone_threads,
        estimator=cfg.estimator,
        max_staleness=plan.lead,
        keep_model=True,  # every round starts from the one before, in this process
        # the tiny model's measured demo runs trained in fp32; bf16 autocast pays off on a
        # real model (135M LoRA step: 11 s instead of 18 s), not on 94k parameters
        bf16=bool(cfg.model) or real,
    )


@dataclass
class DemoStages:
    """The stages of ``loop.rounds`` as the demo runs them: the rollout driver against its processes,
    ``convert_store`` over its store, ``run_once`` with its settings and publisher."""

    cfg: DemoConfig
    run: DemoRun
    children: Children
    task: DemoTask
    loc: StoreLocation  # the store, parsed once; every stage takes it
    logs: Path
    driver: dict[str, Any]  # the rollout driver's settings every batch shares
    convert_cfg: ConvertConfig
    settings: TrainSettings
    publisher: Publisher
    abort: threading.Event = field(
        default_factory=threading.Event
    )  # kills running agents (rollouts run in threads)
    judge: JudgeSettings | None = None  # --reward judge: who judges each round (the served model, directly)
    judged_ids: list[str] = field(default_factory=list)  # every round's rollouts the judge was asked about
    agents: int = 0  # batches whose agents run now (``agents_running``): training and held-out ones
    _agents_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(
        cls,
        cfg: DemoConfig,
        run: DemoRun,
        children: Children,
        *,
        task: DemoTask,
        store: Path,
        logs: Path,
        model: Path,
        server_url: str,
        ports: tuple[int | None, int, int, int],
        concurrency: int,
        plan: LoopPlan,
    ) -> DemoStages:
        from span_to_transition.convert import ConvertConfig
        from trainer.publish import server_publisher

        loc = parse_store(store)
        # --reward judge: a round's rollouts wait, unrewarded, for the judge; the grader's reward never trains
        if cfg.reward == "judge":
            convert_cfg = ConvertConfig(quiet_s=0.0, workers=1, reward_from="judge", missing_reward="keep")
        else:
            convert_cfg = ConvertConfig(quiet_s=0.0, workers=1)
        return cls(
            cfg,
            run,
            children,
            task,
            loc,
            logs,
            driver_settings(cfg, task, loc, ports, concurrency),
            convert_cfg,
            train_settings(cfg, task, store, model, server_url, plan),
            server_publisher(server_url),
            judge=demo_judge(cfg, store, server_url, task) if cfg.reward == "judge" else None,
        )

    def stages(self, evaluate: bool) -> Stages:
        """``loop.rounds.Stages``; with policy@0's held-out evaluation beside round 0 when ``evaluate``."""
        # batch b asks the b-th tasks of the training split; with --max-staleness K the next K batches run
        # while a round trains (their rollouts start on the serving policy, whatever its version then)
        # a training batch is converted by its producer once stored (not with --reward judge, whose judging
        # sits between two conversions): with batches run ahead that is off the trainer's path, and no
        # later batch's agents run yet, so the conversion sees complete rollouts only (a conversion in
        # the loop's thread, beside the next batch, took 2-8 s a round instead of 0.4-1.1, load 12)
        # agents that may run beside training yield the CPU to it (training bounds a round on 2 cores; the
        # agents have slack): a training batch when batches run ahead, and the held-out evaluations
        nice = AHEAD_NICE if self.cfg.max_staleness else 0
        return Stages(
            rollouts=lambda b: self.rollouts(
                f"round batch {b}", self.task.round_tasks(b), convert=self.judge is None, nice=nice
            ),
            convert=self.convert,
            train=self.train,
            round_row=self.round_row,
            alive=self.children.check_alive,
            abort=self.abort,
            heldout=self.heldout_rollouts if evaluate else None,
            score_heldout=self.score_heldout,
            agents_running=self.agents_running,
        )

    def agents_running(self) -> bool:
        """Whether a batch's agents run now: once they are done, the round training beside the batch takes
        the cores while the batch is stored and converted (that tail took 2-3 s a batch, the engine idle)."""
        return self.agents > 0

    def rollouts(
        self, label: str, batch: list[dict], n: int | None = None, convert: bool = False, nice: int = 0
    ) -> Batch:
        """One batch of agent runs (``tracerl rollout``'s driver), until all its spans are stored; with
        ``convert``, then converted (``Batch.converted``)."""
        from rollout.driver import Driver, run_rollouts
        from rollout.records import summarize
        from rollout.tasks import parse_tasks

        t0 = time.perf_counter()
        tasks = parse_tasks([json.dumps(t) for t in batch], source=f"the demo's {label} tasks")
        driver = Driver(
            tasks=tasks,
            n=self.task.group if n is None else n,
            progress=None if label.startswith("held-out") else False,
            nice=nice,
            **self.driver,
        )
        since = time.time() - STORE_CLOCK_SLACK_S  # the batch's rows are stored in files written from now on
        with self._agents_lock:
            self.agents += 1
        try:
            with open(os.devnull, "w") as quiet:
                records, _ = run_rollouts(driver, out=quiet, abort=self.abort)
        finally:
            with self._agents_lock:
                self.agents -= 1
        self.children.check_alive()
        s = summarize(records)
        if s.ok == 0:
            tail = next((r.stderr_tail for r in records if r.stderr_tail), "")
            raise RuntimeError(f"{label}: all {s.total} agent runs failed; the last lines of one:\n{tail}")
        if s.unposted_rewards:
            raise RuntimeError(
                f"{label}: {s.unposted_rewards} rewards could not be posted to the collector; "
                f"see {self.logs / 'collect.log'}"
            )
        ids = [
            r.rollout_id for r in records if r.status == "ok"
        ]  # a run that failed may have sent no root span
        wait_for_round(
            self.loc,
            ids,
            sum(bool(r.reward_posted) for r in records),
            self.cfg.wait_s,
            self.children.check_alive,
            since,
        )
        if not convert:
            return Batch(records, time.perf_counter() - t0)
        t1 = time.perf_counter()
        converted = self.convert([r.rollout_id for r in records])
        return Batch(records, t1 - t0, converted=converted, convert_s=time.perf_counter() - t1)

    def convert(self, rollout_ids: list[str]) -> tuple[int, str]:
        """Convert the batch; with --reward judge, judge it and convert its judged rollouts again."""
        from span_to_transition.store import convert_store

        stats = convert_store(self.loc, self.convert_cfg)
        if self.judge is not None:
            from judge.batch import format_judgment, judge_batch

            judged = judge_batch(self.judge, rollout_ids, PASS_REWARD)
            self.run.judged.append(judged)
            self.judged_ids.extend(rollout_ids)
            print(f"    {format_judgment(judged)}", flush=True)
            stats = convert_store(self.loc, self.convert_cfg)  # the judge's rows reach the transitions
        return round_status(self.loc, rollout_ids)["converted"], stats.summary()

    def judge_total(self) -> BatchJudgment | None:
        """Every round's judging together: agreement over all judged rollouts (read from the store), tokens."""
        from judge.batch import combine, judge_pairs

        if self.judge is None or not self.run.judged:
            return None
        return combine(self.run.judged, judge_pairs(self.loc, self.judged_ids, self.judge.name), PASS_REWARD)

    def train(self, training: Training) -> RoundOutcome:
        """One ``tracerl train --once`` (``loop.rounds.Training`` says its threads and whether it publishes)."""
        from trainer.rounds import run_once

        return run_once(
            dataclasses.replace(self.settings, threads=training.threads),
            publisher=self.publisher if training.publish else None,
            log=lambda _msg: None,
            threads_now=training.threads_now,
        )

    def round_row(self, k: int) -> dict[str, Any] | None:
        from trainer.manifest import read_rounds

        return read_rounds(self.loc).get(k)

    def heldout_rollouts(self, k: int) -> Batch:
        """policy@k on the held-out questions (seeded samples, not trained on), until stored."""
        return self.rollouts(f"held-out evaluation of policy@{k}", self.task.heldout, n=1, nice=AGENT_NICE)

    def score_heldout(self, k: int, batch: Batch) -> HeldOut:
        """Scored from the store's rewards, and converted: queryable like the rounds' rollouts (the
        trainer's --tasks regex keeps them out of training)."""
        from span_to_transition.store import convert_store

        records, run = batch.records, self.run
        convert_store(self.loc, self.convert_cfg)
        stored = store_rewards(self.loc, [r.rollout_id for r in records])
        h = held_out_summary(
            {r.task_id: stored.get(r.rollout_id, 0.0) for r in records}
        )  # no reward: failed, 0
        run.heldout.append((k, h))
        answers = store_answers(self.loc, [r.rollout_id for r in records])
        run.answers[k] = {
            r.task_id: (answers.get(r.rollout_id, ""), stored.get(r.rollout_id, 0.0)) for r in records
        }
        print(
            f"held-out  policy@{k}: success {h.success:.3f}  mean reward {h.mean_reward:.3f}  SQL runs "
            f"{h.runs:.3f}  in-group reward variance {h.group_variance:.4f}  ({h.n} rollouts, {batch.seconds:.0f}s)",
            flush=True,
        )
        return h

    def final_eval(self, k: int) -> None:
        """One more batch of the training tasks on the final policy: measured, never trained on."""
        from span_to_transition.store import convert_store

        batch = self.rollouts("evaluation", self.task.train)
        ids = [r.rollout_id for r in batch.records]
        stored = store_rewards(self.loc, ids)
        self.run.final_reward = sum(stored.values()) / len(stored) if stored else None
        convert_store(self.loc, self.convert_cfg)  # queryable like the rounds' rollouts (never trained on)
        print(
            f"{'eval':>5}  {'policy@' + str(k):>9}  {len(ids):>8}  "
            f"{self.run.final_reward:>11.3f}  {'-':>8}  {'-':>7}  {batch.seconds:>7.1f}",
            flush=True,
        )
