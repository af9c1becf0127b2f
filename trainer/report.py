"""The rounds manifest as a table and a PNG (reward, loss, KL per round; staleness and importance
weights when rounds ran asynchronously)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from store.location import StoreLocation
from trainer.manifest import read_rounds

COLUMNS = (
    "round",
    "status",
    "n_rollouts",
    "n_transitions",
    "mean_reward",
    "loss",
    "kl",
    "clip_fraction",
    "seconds",
    "estimator",
)


def round_rows(store: StoreLocation) -> list[dict[str, Any]]:
    """One dict per round with the columns of ``COLUMNS`` (seconds = sum of the phase timings)."""
    rows = []
    for r in read_rounds(store).values():
        m = json.loads(r.get("metrics") or "{}")
        rows.append(
            {
                **{c: r.get(c) for c in COLUMNS if c != "seconds"},
                "seconds": sum(json.loads(r["timings"] or "{}").values()),
                "estimator_reason": r.get("estimator_reason"),
                "canary": json.loads(r["canary"]) if r.get("canary") else None,
                "staleness": {int(d): n for d, n in (m.get("staleness") or {}).items()},
                "too_stale": m.get("n_rollouts_too_stale") or 0,
                "is_weight": (m.get("is_weight_min"), m.get("is_weight_mean"), m.get("is_weight_max"))
                if m.get("is_tokens")
                else None,
            }
        )
    return rows


def _asynchronous(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("too_stale") or any(d > 0 for d in r.get("staleness") or {}) for r in rows)


def _staleness_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Samples of each round stacked by how many versions behind the trained one they were sampled."""
    depth = max((d for r in rows for d in r["staleness"]), default=0)
    bottom = [0] * len(rows)
    xs = [r["round"] for r in rows]
    for d in range(depth + 1):
        ys = [r["staleness"].get(d, 0) for r in rows]
        ax.bar(xs, ys, bottom=bottom, label=f"{d} behind", width=0.7)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    for x, r, b in zip(xs, rows, bottom, strict=True):
        if r["too_stale"]:
            ax.annotate(
                f"{r['too_stale']} too stale",
                (x, b),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize="x-small",
                color="tab:red",
            )
    ax.legend(fontsize="x-small", loc="upper left")


def _importance_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Mean importance weight pi_old / pi_behaviour per round, with its min..max over tokens."""
    pts = [(r["round"], *r["is_weight"]) for r in rows if r["is_weight"]]
    if not pts:
        return
    xs, lo, mean, hi = zip(*pts, strict=True)
    ax.errorbar(
        xs,
        mean,
        yerr=[[m - a for m, a in zip(mean, lo, strict=True)], [b - m for m, b in zip(mean, hi, strict=True)]],
        fmt="o",
        capsize=3,
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    table = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table]
    # why each round used its estimator (--estimator auto's rule), once per run of rounds with the same reason
    last = None
    for r in rows:
        if r.get("estimator_reason") and (r["estimator"], r["estimator_reason"]) != last:
            lines.append(f"round {r['round']}: estimator {r['estimator']}: {r['estimator_reason']}")
            last = (r["estimator"], r["estimator_reason"])
    lines += [canary_line(r["round"], r["status"], r["canary"]) for r in rows if r.get("canary")]
    return "\n".join(lines)


def canary_line(k: int, status: str, c: dict[str, Any]) -> str:
    """A canary decision with its numbers (the ``canary`` column, written by ``tracerl promote``), or the eval
    gate's (``loop.gate``) for a candidate it stopped before any live traffic."""
    if "mean_candidate" not in c and "gate" in c:
        g = c["gate"]
        return (
            f"round {k}: eval gate v{c['candidate_version']} vs v{c['serving_version']}: {status}: held-out "
            f"success {g['success_candidate']:.3f} (n={g['n_candidate']}) vs {g['success_serving']:.3f} "
            f"(n={g['n_serving']}), margin {g['margin']}; {g['reason']}"
        )
    lo, hi = c.get("lower"), c.get("upper")  # the mSPRT's bounds (rows written before the paired-blocks test)
    bounds = f" in [{lo:+.3f}, {hi:+.3f}]" if lo is not None and lo == lo else ""
    if c.get("e_rollback") is not None:  # the paired-blocks test's evidence (loop/canary.py)
        bounds = f", evidence {c['e_rollback']:.3g} worse / {c['e_promote']:.3g} no worse"
    test = f", by betting at share {c['share']}" if c.get("test") == "betting" else ""
    return (
        f"round {k}: canary v{c['candidate_version']} vs v{c['serving_version']}: {status}: candidate "
        f"{c['mean_candidate']:.3f} (n={c['n_candidate']}) vs serving {c['mean_serving']:.3f} "
        f"(n={c['n_serving']}), difference {c['diff']:+.3f}{bounds} "
        f"(alpha {c['alpha']}, margin {c['margin']}{test}); {c['reason']}"
    )


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
    if _asynchronous(rows):
        panels += [("staleness", "samples by\nstaleness"), ("is_weight", "importance weight\nmean, min..max")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.3 * len(panels) + 0.4), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        if key == "heldout":
            xs = [k for k, _, _ in heldout]
            ys = [v for _, v, _ in heldout]
            err = [1.96 * (v * (1 - v) / max(n, 1)) ** 0.5 for _, v, n in heldout]
            ax.errorbar(xs, ys, yerr=err, fmt="s", capsize=4, color="tab:green")
            for x, y, (_, _, n) in zip(xs, ys, heldout, strict=True):
                ax.annotate(
                    f"{y:.3f} (n={n})", (x, y), textcoords="offset points", xytext=(8, 4), fontsize="small"
                )
            ax.set_ylim(0, max(0.1, min(1.0, max(y + e for y, e in zip(ys, err, strict=True)) * 1.3)))
        elif key == "staleness":
            _staleness_panel(ax, rows)
        elif key == "is_weight":
            _importance_panel(ax, rows)
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
