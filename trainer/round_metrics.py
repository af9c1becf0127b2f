"""What a round reports: the one log line a user greps, and the ``rounds.metrics`` JSON column.

Pure functions of a round's manifest row, its dataset statistics and its training metrics; the round
protocol (``trainer.rounds``) writes them."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from trainer.backends.base import TrainMetrics
from trainer.dataset import DatasetStats


def metrics_line(row: dict[str, Any], stats: DatasetStats | None, m: TrainMetrics | None) -> str:
    """The one line per round a user greps: what went in, what came out, how long it took."""
    k = row["round"]
    parts = [
        f"round {k}: policy@{k} -> policy@{k + 1}",
        f"status={row['status']}",
        f"rollouts={row['n_rollouts']}",
        f"calls={row['n_transitions']}",
        f"reward={row['mean_reward']:.4f}",
        f"loss={row['loss']:.5f}",
        f"kl={row['kl']:.5f}",
        f"clip={row['clip_fraction']:.3f}",
        f"estimator={row.get('estimator')}",
    ]
    if stats is not None:
        parts += [
            f"retokenized={stats.n_retokenized}",
            f"truncated={stats.n_truncated_prompt}p/{stats.n_truncated_response}r",
            f"zero_var_groups={stats.n_groups_zero_variance}/{stats.n_groups}",
            f"incomplete={stats.n_rollouts_incomplete}",
        ]
        if stats.n_rollouts_feedback_waiting or stats.n_rollouts_unrewarded_at_close:
            parts += [
                f"feedback_waiting={stats.n_rollouts_feedback_waiting}",
                f"unrewarded_at_close={stats.n_rollouts_unrewarded_at_close}",
            ]
        if stats.n_rollouts_over_cap:
            parts.append(f"over_cap={stats.n_rollouts_over_cap}")
        if any(stats.staleness.get(d) for d in stats.staleness if d > 0) or stats.n_rollouts_too_stale:
            parts += [
                "staleness=" + ",".join(f"{d}:{n}" for d, n in sorted(stats.staleness.items())),
                f"too_stale={stats.n_rollouts_too_stale}",
                f"stale_no_logprobs={stats.n_stale_no_logprobs}",
            ]
    if m is not None and m.is_tokens:
        parts.append(f"is_weight={m.is_weight_mean:.3f}[{m.is_weight_min:.3f},{m.is_weight_max:.3f}]")
    if m is not None:
        parts += [f"tokens={m.tokens}", f"steps={m.optimizer_steps}", f"grad_norm={m.grad_norm:.3f}"]
        if m.seconds > 0:
            parts.append(f"tokens/s={m.tokens / m.seconds:.0f}")
    timings = json.loads(row["timings"] or "{}")
    parts.append(f"time={sum(timings.values()):.1f}s")
    return " ".join(parts)


def metrics_json(m: TrainMetrics, stats: DatasetStats, nproc: int) -> str:
    """The ``rounds.metrics`` column: every TrainMetrics and DatasetStats field in one flat JSON object
    (no names collide), plus tokens/s, so SQL can reach what the fixed columns leave out
    (``json_extract(metrics, '$.n_retokenized')``). Non-finite floats become null: valid JSON."""

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    out = {
        **dataclasses.asdict(stats),
        **dataclasses.asdict(m),
        "nproc": nproc,
        "tokens_per_s": m.tokens / m.seconds if m.seconds > 0 else None,
    }
    return json.dumps({k: clean(v) for k, v in out.items()}, sort_keys=True)
