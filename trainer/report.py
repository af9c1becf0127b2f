"""The rounds manifest as a table and a PNG (reward, loss, KL per round)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.store import StoreLayout
from trainer.rounds import read_rounds

COLUMNS = ("round", "status", "n_rollouts", "n_transitions", "mean_reward", "loss", "kl", "clip_fraction", "seconds")


def round_rows(store: str) -> list[dict[str, Any]]:
    """One dict per round with the columns of ``COLUMNS`` (seconds = sum of the phase timings)."""
    rows = []
    for r in read_rounds(StoreLayout.at(store)).values():
        rows.append({**{c: r.get(c) for c in COLUMNS if c != "seconds"},
                     "seconds": sum(json.loads(r["timings"] or "{}").values())})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    table = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table)


def plot(rows: list[dict[str, Any]], out: Path, heldout: list[tuple[int, float]] | None = None) -> Path:
    """Three stacked panels sharing the round axis; written with the non-interactive Agg backend.

    ``heldout``: (policy version, held-out success) points, drawn on the reward panel at the round
    that trains on that version (policy@k is measured before round k).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
    for ax, key, label in zip(axes, ("mean_reward", "loss", "kl"), ("mean reward", "loss", "KL to base"),
                              strict=True):
        pts = [(r["round"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="training rollouts")
        if key == "mean_reward" and heldout:
            ax.plot([p[0] for p in heldout], [p[1] for p in heldout], marker="s", linestyle="--",
                    label="held-out success")
            ax.legend(fontsize="small")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("round (trains on policy@round)")
    fig.suptitle("tracerl training rounds")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
