"""The rounds manifest as a table and a PNG (reward, loss, KL per round)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from store.layout import StoreLayout
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


def plot(rows: list[dict[str, Any]], out: Path, heldout: list[tuple[int, float, int]] | None = None) -> Path:
    """Stacked panels sharing the round axis; written with the non-interactive Agg backend.

    ``heldout``: (policy version, held-out success, rollouts) measurements, drawn in a panel of their
    own at the round that trains on that version (policy@k is measured before round k), as points
    with a 95% binomial interval and no line between them: nothing was measured in between, and a
    share of held-out rollouts is not on the training reward's axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mean_reward", "mean reward\n(training rollouts)"), ("loss", "loss"), ("kl", "KL to base")]
    if heldout:
        panels.insert(0, ("heldout", "held-out success"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.3 * len(panels) + 0.4), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        if key == "heldout":
            xs = [k for k, _, _ in heldout]
            ys = [v for _, v, _ in heldout]
            err = [1.96 * (v * (1 - v) / max(n, 1)) ** 0.5 for _, v, n in heldout]
            ax.errorbar(xs, ys, yerr=err, fmt="s", capsize=4, color="tab:green")
            for x, y, (_, _, n) in zip(xs, ys, heldout, strict=True):
                ax.annotate(f"{y:.3f} (n={n})", (x, y), textcoords="offset points", xytext=(8, 4), fontsize="small")
            ax.set_ylim(0, max(0.1, min(1.0, max(y + e for y, e in zip(ys, err, strict=True)) * 1.3)))
        else:
            pts = [(r["round"], r[key]) for r in rows if r[key] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("round (trains on policy@round)")
    fig.suptitle("tracerl training rounds")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
