"""What one conversion pass did: counts, problems and phase timings, and the summary ``tracerl convert`` prints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_PROBLEMS = 50
"""Problem messages kept per pass (the summary prints the first ten)."""


@dataclass
class ConvertStats:
    """What one conversion pass did; printed by ``tracerl convert`` and logged by ``collect --convert``."""

    span_files_read: int = 0
    spans_read: int = 0
    rollouts_seen: int = 0
    rollouts_pending: int = 0
    rollouts_converted: int = 0
    rollouts_excluded_no_reward: int = 0
    rollouts_filled_reward: int = 0
    rollouts_without_calls: int = 0
    transitions_written: int = 0
    trainable_transitions: int = 0
    duplicate_spans: int = 0
    duplicate_calls: int = 0
    orphan_spans: int = 0
    calls_without_content: int = 0
    late_spans: int = 0  # spans that arrived after their rollout was converted (this pass)
    late_spans_total: int = 0
    rollouts_reconverted: int = 0  # converted again: a reward arrived after their conversion, or --rebuild
    rewards_unjoined: int = 0  # feedback rows (latest per reward_id) whose keys match no rollout seen
    unjoined_samples: list[str] = field(default_factory=list)  # their keys, a few
    files_removed: int = 0  # superseded transitions files deleted by --rebuild
    settings_changed: str | None = None  # these settings differ from those of the rows already converted
    pending_waits: dict[str, int] = field(default_factory=dict)  # waiting_quiet / waiting_root -> rollouts
    without_calls_reasons: dict[str, int] = field(default_factory=dict)  # reason -> rollouts without calls
    excluded_reasons: dict[str, int] = field(default_factory=dict)  # reason -> rollouts excluded
    content_joined: int = 0  # calls given exact ids by a gateway span with the same request and response
    content_ties: int = 0  # gateway spans whose content matched several calls (or shared one): not joined
    content_near_misses: int = 0  # gateway spans equal to a call on the request or the response only: not joined
    untrainable_reasons: dict[str, int] = field(default_factory=dict)  # malformed chat: reason -> calls
    files_written: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # read, status, convert (+ write), ledger

    def lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_seconds[phase] = round(self.phase_seconds.get(phase, 0.0) + now - since, 4)
        return now

    def summary(self) -> str:
        lines = [
            f"converted {self.rollouts_converted} rollouts -> {self.transitions_written} transitions "
            f"({self.trainable_transitions} trainable) from {self.spans_read} spans in {self.span_files_read} "
            f"files, {self.seconds:.2f}s",
            f"pending (not complete yet): {self.rollouts_pending}{_waits(self.pending_waits)}; without LLM calls: "
            f"{self.rollouts_without_calls}{_why(self.without_calls_reasons)}; duplicate spans dropped: {self.duplicate_spans}; duplicate calls (same response id): "
            f"{self.duplicate_calls}; orphan spans repaired: {self.orphan_spans}",
        ]
        if self.rollouts_excluded_no_reward:
            lines.append(
                f"excluded: {self.rollouts_excluded_no_reward}{_why(self.excluded_reasons)}; they are "
                "reconsidered when a reward row arrives, or pass --missing-reward fill --fill-reward V"
            )
        if self.rollouts_filled_reward:
            lines.append(f"rollouts given the fill reward: {self.rollouts_filled_reward}")
        if self.content_joined or self.content_ties or self.content_near_misses:
            lines.append(
                f"gateway spans joined by content (same request and response, no traceparent or response id): "
                f"{self.content_joined}; not joined, the calls stay retokenized: {self.content_ties} ties, "
                f"{self.content_near_misses} near-misses"
            )
        if self.untrainable_reasons:
            lines.append(
                f"untrainable (malformed chat; written with trainable=false and untrainable_reason, never trained): "
                f"{sum(self.untrainable_reasons.values())}{_why(self.untrainable_reasons)}; see tracerl doctor"
            )
        if self.calls_without_content:
            lines.append(f"LLM calls without message content (not converted): {self.calls_without_content}")
        if self.rollouts_reconverted:
            lines.append(
                f"converted again (a reward arrived after their conversion, or --rebuild): "
                f"{self.rollouts_reconverted} rollouts; their earlier rows are superseded"
            )
        if self.rewards_unjoined:
            lines.append(
                f"feedback matching no rollout (kept in rewards/, joined if its rollout arrives): "
                f"{self.rewards_unjoined}, e.g. {', '.join(self.unjoined_samples[:3])}; see tracerl doctor"
            )
        if self.settings_changed:
            lines.append(f"note: {self.settings_changed}")
        if self.late_spans or self.late_spans_total:
            lines.append(
                f"late spans (arrived after their rollout was converted; kept in spans, not converted): "
                f"{self.late_spans} new, {self.late_spans_total} total; raise --quiet-s if this grows"
            )
        lines += [f"  problem: {p}" for p in self.problems[:10]]
        if len(self.problems) > 10:
            lines.append(f"  ... and {len(self.problems) - 10} more problems")
        if not self.rollouts_converted and (
            self.rollouts_pending or self.rollouts_without_calls or self.rollouts_excluded_no_reward
        ):
            lines.append(
                "nothing converted: run 'tracerl doctor' (with the same --store) for what it saw, what it means "
                "and the fix"
            )
        return "\n".join(lines)


WAITS = {
    "waiting_quiet": "waiting --quiet-s (root span ended, not quiet long enough)",
    "waiting_root": "waiting --max-wait-s (no root span yet; converted with repair once quiet that long)",
}
"""The two waits of ``tree.decide_completion``, named by the flag that ends them."""


def _waits(waits: dict[str, int]) -> str:
    return _why({WAITS.get(k, k): n for k, n in waits.items()})


def _why(reasons: dict[str, int]) -> str:
    """`` (2: reason a, 1: reason b)``: the reasons behind a count, most frequent first."""
    if not reasons:
        return ""
    return " (" + "; ".join(f"{n}: {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])) + ")"
