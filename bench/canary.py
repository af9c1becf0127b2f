"""The canary decision's error rates and detection speed (``loop/canary.py``), by seeded simulation.

1. Calibration: at each success rate, the share of windows where an equal candidate is rolled back and
   where a candidate worse by the margin is promoted, each evidence on its own with a look after every
   rollout, with its one-sided 95% Clopper-Pearson upper bound. Target: both upper bounds <= alpha.
2. Detection: rollouts to the first decision at a 0.2 canary share for harmed candidates on the demo's
   scale (held-out success of a trained policy ~0.25, of an untrained one ~0.05; a harmed checkpoint
   scores ~0), beside the oracle SPRT on the same windows (both rates known: the information bound).
   Target (issue 29): a harmed checkpoint rolled back within 200 rollouts (p90).

    python bench/canary.py                     # 2,000 windows per line
    python bench/canary.py --runs 500 --share 0.1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop.canary import CanaryRule, first_decision
from loop.canary_sim import calibration, detection

RATES = (0.02, 0.05, 0.1, 0.3, 0.5, 0.9)
HARMS = ((0.25, 0.0), (0.2, 0.0), (0.1, 0.0), (0.05, 0.0), (0.25, 0.05), (0.25, 0.45))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2000, help="seeded windows per line")
    p.add_argument("--share", type=float, default=0.2, help="the candidate's share of rollouts")
    p.add_argument("--rollouts", type=int, default=1200, help="rollouts per window (the horizon)")
    args = p.parse_args(argv)
    if args.runs < 1 or not 0 < args.share < 1 or args.rollouts < 1:
        p.error("--runs and --rollouts must be >= 1 and --share in (0, 1), e.g. --runs 2000 --share 0.2")
    rule = CanaryRule()
    print(f"canary rule: alpha {rule.alpha}, margin {rule.margin}, min per arm {rule.min_per_arm}; "
          f"share {args.share}, {args.runs} windows of {args.rollouts} rollouts, a look after every rollout")  # fmt: skip
    t0 = time.perf_counter()
    print("\ncalibration (each wrong answer's rate, upper bound: one-sided 95% Clopper-Pearson)")
    for k, rate in enumerate(RATES):
        print("  " + calibration(rate, rule, args.share, args.runs, args.rollouts, seed=k).line(rule.alpha))
    print("\ndetection (rollouts to the first decision)")
    for k, (p_s, p_c) in enumerate(HARMS):
        d = detection(p_s, p_c, rule, first_decision, args.share, args.runs, args.rollouts, seed=100 + k)
        print("  " + d.line())
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
