"""What a run produced: one record per rollout (a JSON line) and the summary printed at the end."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RolloutRecord:
    """One line of ``STORE/rollouts/driver-<run>.jsonl``: how one (task, sample) went."""

    rollout_id: str
    task_id: str
    sample: int
    status: str  # ok | failed | timeout
    exit_code: int | None
    duration_s: float
    attempts: int
    reward: float | None = None
    reward_posted: bool | None = None  # None: nothing to post
    error: str | None = None  # reward function or reward POST problem
    stderr_tail: str = ""
    retried_rollout_ids: list[str] = field(default_factory=list)
    run_id: str = ""
    started_at: str = ""


@dataclass
class Summary:
    """What a run produced, for the printed summary and the exit code."""

    total: int
    ok: int
    failed: int
    timeout: int
    rewarded: int
    mean_reward: float | None
    reward_errors: int
    unposted_rewards: int
    mean_duration_s: float


@dataclass
class Tally:
    """Running counts for the progress bar: a continuous run must not re-summarise every record."""

    ok: int = 0
    failed: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0

    def add(self, rec: RolloutRecord) -> None:
        self.ok += rec.status == "ok"
        self.failed += rec.status != "ok"
        if rec.reward is not None:
            self.rewarded += 1
            self.reward_sum += rec.reward

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None


def summarize(records: list[RolloutRecord]) -> Summary:
    rewards = [r.reward for r in records if r.reward is not None]
    return Summary(
        total=len(records),
        ok=sum(r.status == "ok" for r in records),
        failed=sum(r.status == "failed" for r in records),
        timeout=sum(r.status == "timeout" for r in records),
        rewarded=len(rewards),
        mean_reward=statistics.fmean(rewards) if rewards else None,
        reward_errors=sum(r.error is not None and r.reward is None and r.status == "ok" for r in records),
        unposted_rewards=sum(r.reward_posted is False for r in records),
        mean_duration_s=statistics.fmean(r.duration_s for r in records) if records else 0.0,
    )


def format_summary(s: Summary, records_path: str) -> str:
    reward = "n/a" if s.mean_reward is None else f"{s.mean_reward:.3f} over {s.rewarded}"
    lines = [f"{s.total} rollouts: {s.ok} ok, {s.failed} failed, {s.timeout} timeout; "
             f"mean reward {reward}; mean duration {s.mean_duration_s:.2f}s",
             f"records: {records_path}"]
    if s.reward_errors:
        lines.append(f"{s.reward_errors} reward function error(s): see the 'error' field of the records")
    if s.unposted_rewards:
        lines.append(f"{s.unposted_rewards} reward(s) not posted to the collector: is `tracerl collect` "
                     f"running at --collector? The values are in the records file")
    return "\n".join(lines)

