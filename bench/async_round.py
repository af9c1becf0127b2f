"""Asynchronous rounds vs the on-policy loop: samples trained per minute and idle time (issue #22).

Runs the real demo (SmolLM2-135M-Instruct learning text-to-SQL through real vLLM on CPU, the
``tracerl demo`` code) once per mode, one after the other on this machine, from the same base model
and the same settings: ``--max-staleness 0`` (agents wait while the trainer trains: the baseline),
then 1 and 2 (the next K batches of rollouts run while a round trains). For each mode it prints:

* samples trained per minute: calls trained on, over the rounds' wall time (first training batch's
  rollouts started .. last round published; the engine's start and both held-out evaluations excluded:
  policy@0's runs before round 0, ``tracerl demo --heldout-first``, so the window holds training alone;
  ``--heldout-beside`` runs it beside round 0 as the demo does, where its ~45 s of engine work, the
  same in every mode, sits in the window and dilutes the ratio);
* idle fractions over that window: the engine's (no training batch's agents running; with
  ``--heldout-beside``, the held-out evaluation is not counted as work) and the trainer's (no round
  training);
* held-out success before the first and after the last round (30 questions x --heldout-samples
  seeded samples), and the samples trained, so the modes are compared at an equal amount of data;
* where each mode's window went, in seconds (``bench/_phases.py``): the engine busy (a training
  batch's call in flight, from the gateway's spans), busy on held-out calls only, or idle, and its
  mean calls in flight; the trainer busy, split by the rounds manifest's timings (dataset,
  model_load, train, save, publish); both idle; the loop's conversion and its wait for the batch;
  each batch's head (its start to its first call: agent processes starting) and tail (its last
  call's end to all of it stored), and per agent its start to its first call;
* the 1-minute load average sampled through each mode's window: the machine is shared, and the
  trainer's speed, hence the ratio, moves with it.

Target (issue #32 item 2) on 2 cores: >= 1.4x samples per minute with held-out success no worse
beyond noise. The ceiling of overlapping two stages is (rollouts + training) / max(rollouts,
training) per round: the split says which side bounds it.

A mode ``K:T`` also sets the training threads while rollouts run beside it (``tracerl demo
--train-threads T``; default 1, the demo's --threads: on 2 cores the engine has one).

    python bench/async_round.py --modes 0,1,2        # 6 rounds each (~20 min on 2 quiet cores)
    python bench/async_round.py --modes 0,1,1:2 --rounds 3 --json bench/out/async.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._cpu import CpuSampler, cpu_bound, window_cpu  # noqa: E402
from bench._phases import Agent, covered, phases  # noqa: E402

DEFAULT_MODEL = ROOT / ".models" / "smollm2-135m-instruct"


def store_timeline(store: Path) -> tuple[list[Agent], list[Agent], list[dict]]:
    """What the store recorded: the training batches' and the held-out evaluations' agent processes
    (driver records) with their LLM calls (gateway spans), and the rounds manifest's rows."""
    from datetime import datetime

    from store.location import parse_store
    from store.views import connect_readonly
    from trainer.manifest import read_rounds

    loc = parse_store(store)
    con = connect_readonly(loc)
    try:
        # a gateway span carries the agent's trace id; the agent's own spans carry its rollout id
        rows = con.execute(
            "SELECT a.rollout_id, g.start_time_ns / 1e9, g.end_time_ns / 1e9 FROM spans g JOIN "
            "(SELECT DISTINCT trace_id, rollout_id FROM spans WHERE name NOT LIKE 'tracerl.gateway %') a "
            "USING (trace_id) WHERE g.name LIKE 'tracerl.gateway %'"
        ).fetchall()
    finally:
        con.close()
    calls: dict[str, list[tuple[float, float]]] = {}
    for rid, s, e in rows:
        calls.setdefault(rid, []).append((s, e))
    train, heldout = [], []
    for f in sorted((store / "rollouts").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            start = datetime.fromisoformat(r["started_at"]).timestamp()
            agent = Agent(start, start + r["duration_s"], sorted(calls.get(r["rollout_id"], [])))
            (heldout if r["task_id"].startswith("heldout-") else train).append(agent)
    return train, heldout, list(read_rounds(loc).values())


def after_first_round(run) -> dict:
    """Samples per minute from round 0's end to the last round's: the rate of the rounds after the first,
    whose start differs by mode (on-policy, round 0's batch runs alone; run ahead, the next batches start
    beside round 0's training). With ``--heldout-beside`` round 0 also waits for policy@0's held-out
    evaluation in every mode (~45-60 s of engine work that no schedule shortens)."""
    rounds = run.loop_rounds
    if len(rounds) < 2:
        return {}
    seconds = rounds[-1].trained_at - rounds[0].trained_at
    samples = sum(r.row["n_transitions"] or 0 for r in rounds[1:])
    return {
        "samples": samples,
        "seconds": round(seconds, 1),
        "samples_per_min": round(samples / (seconds / 60.0), 2) if seconds > 0 else None,
    }


def measure(run, clock: float, cpu_samples: list | None = None) -> dict:
    """The figures of one demo run (a ``tracerl.demo.DemoRun``); ``clock``: wall minus monotonic time;
    ``cpu_samples``: the run's ``CpuSampler.samples``."""
    lo = min(s for s, _ in run.rollout_spans)
    hi = max(e for _, e in run.train_spans)
    window = hi - lo
    cpu = window_cpu(cpu_samples or [], lo + clock, hi + clock)
    before = next((h for k, h in run.heldout if k == 0), None)
    after = max(run.heldout, key=lambda kh: kh[0]) if run.heldout else None
    train, heldout, manifest = store_timeline(run.store)
    wall = [(s + clock, e + clock) for s, e in run.rollout_spans]
    split = phases(
        (lo + clock, hi + clock),
        wall,
        [(s + clock, e + clock) for s, e in run.train_spans],
        train,
        [c for a in heldout for c in a.calls],
        [json.loads(r["timings"] or "{}") for r in manifest],
        sum(r.convert_s for r in run.loop_rounds),
        sum(r.wait_s for r in run.loop_rounds),
    )
    return {
        "rounds": len(run.rounds),
        "samples": run.samples,
        "window_s": round(window, 1),
        "samples_per_min": round(run.samples / (window / 60.0), 2) if window > 0 else None,
        "engine_idle": round(1 - covered(run.rollout_spans, lo, hi) / window, 3),
        "trainer_idle": round(1 - covered(run.train_spans, lo, hi) / window, 3),
        "heldout_before": before.success if before else None,
        "heldout_after": after[1].success if after else None,
        "heldout_n": after[1].n if after else None,
        "round_seconds": [round(r.seconds, 1) for r in run.rounds],
        "after_round_0": after_first_round(run),
        "cpu_s": {g: round(v, 1) for g, v in cpu.items()},
        "cpu": cpu_bound(cpu, window, run.samples, os.cpu_count() or 1),
        "phases": {label: round(v, 2) for label, v in split.rows()},
        # the trainer's seconds per micro-batch by thread limit, then count (loop/threads.py)
        "thread_means": {lim: {n: round(v, 2) for n, v in m.items()} for lim, m in run.thread_means.items()},
        "per_round": [
            {
                "round": r.round,
                "seconds": round(r.seconds, 1),
                "wait": round(r.wait_s, 1),
                "rollout": round(r.rollout_s, 1),
                "convert": round(r.convert_s, 1),
                "batch_convert": round(r.batch_convert_s, 1),
                "train": round(r.train_s, 1),
            }
            for r in run.loop_rounds
        ],
    }


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds while a mode runs, in a daemon thread: the
    machine is shared, and a figure measured at load 12 is not one measured at load 2."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append((time.time(), os.getloadavg()[0]))

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, lo: float, hi: float) -> dict:
        """Mean, min and max of the samples taken inside [lo, hi] (wall clock)."""
        xs = [v for t, v in self.samples if lo <= t <= hi] or [v for _, v in self.samples]
        if not xs:
            return {}
        return {"mean": round(sum(xs) / len(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}


def window_of(run, clock: float) -> tuple[float, float]:
    """The measured window (first training batch's start .. last round's end), wall clock."""
    return min(s for s, _ in run.rollout_spans) + clock, max(e for _, e in run.train_spans) + clock


def print_split(results: dict[str, dict]) -> None:
    """Seconds per phase per mode, one column per mode."""
    labels = list(next(iter(results.values()))["phases"])
    print(f"\n{'where the window went (s)':<36}" + "".join(f"{m:>10}" for m in results))
    for label in labels:
        print(f"{label:<36}" + "".join(f"{r['phases'].get(label, 0.0):>10.2f}" for r in results.values()))


def print_cpu(results: dict[str, dict], base: str) -> None:
    """CPU-seconds per part of the loop in each mode's window, and what they bound: no schedule brings a
    window below its CPU work over the cores, so samples per minute cannot pass samples / floor."""
    groups = [g for g in next(iter(results.values()))["cpu_s"] if g != "total"]
    if not groups:
        return
    print(f"\n{'CPU-seconds in the window':<46}" + "".join(f"{m:>10}" for m in results))
    for g in [*groups, "total"]:
        print(f"{g:<46}" + "".join(f"{r['cpu_s'].get(g, 0.0):>10.1f}" for r in results.values()))
    for label, key in (
        ("cores used (cpu / window)", "cores_used"),
        ("CPU-s per sample trained", "cpu_s_per_sample"),
        ("floor: cpu / cores (s)", "floor_s"),
    ):
        print(f"{label:<46}" + "".join(f"{r['cpu'][key]:>10}" for r in results.values()))
    b = results[base]
    for k, r in results.items():
        floor = r["cpu"]["floor_s"]
        if k != base and floor and b["samples_per_min"]:
            print(
                f"mode {k}: at its own CPU work per sample, the best ratio over mode {base} is "
                f"{r['samples'] / (floor / 60.0) / b['samples_per_min']:.2f} (window at its floor, {floor:.0f} s)"
            )
    for k, r in results.items():
        a = r["after_round_0"]
        if a and b["after_round_0"].get("samples_per_min"):
            print(
                f"after round 0, mode {k}: {a['samples']} samples in {a['seconds']} s, {a['samples_per_min']} "
                f"samples/min, ratio {a['samples_per_min'] / b['after_round_0']['samples_per_min']:.2f}"
            )


def print_summary(results: dict[str, dict], modes: list[str]) -> None:
    """The modes side by side (ratio against the first), where each window went, CPU, load, the ratios."""
    base = results[modes[0]]
    print(
        f"\n{'mode':>9}  {'rounds':>6}  {'samples':>7}  {'window s':>8}  {'samples/min':>11}  {'ratio':>5}  "
        f"{'engine idle':>11}  {'trainer idle':>12}  {'held-out before -> after':>24}"
    )
    for k, r in results.items():
        ratio = r["samples_per_min"] / base["samples_per_min"] if base["samples_per_min"] else float("nan")
        r["ratio"] = round(ratio, 3)
        print(
            f"{k:>9}  {r['rounds']:>6}  {r['samples']:>7}  {r['window_s']:>8.1f}  {r['samples_per_min']:>11.2f}  "
            f"{ratio:>5.2f}  {r['engine_idle']:>11.3f}  {r['trainer_idle']:>12.3f}  "
            f"{r['heldout_before']:>11.3f} -> {r['heldout_after']:.3f} (n={r['heldout_n']})"
        )
    print_split(results)
    print_cpu(results, modes[0])
    for k, r in results.items():
        print(f"load average (1 min) during mode {k}'s window: {r['load']}")
    for k, r in results.items():
        if k != modes[0]:
            print(f"RATIO samples_per_min staleness {k} / {modes[0]}: {r['ratio']:.2f} (target >= 1.4)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--modes",
        default="0,1,2",
        help="--max-staleness values to run, the first is the baseline; K:T also sets --train-threads T",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds per mode: the first has no batch ahead of it in any mode, so more rounds weigh the "
        "steady state more (default: %(default)s)",
    )
    ap.add_argument("--heldout-samples", type=int, default=4)
    ap.add_argument(
        "--heldout-beside",
        action="store_true",
        help="run policy@0's held-out evaluation beside round 0, as the demo does (default: before the "
        "rounds, outside the window)",
    )
    ap.add_argument(
        "--model",
        default=str(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else None,
        help="SmolLM2 directory (default: .models/smollm2-135m-instruct, else built per run)",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="where each mode's store and logs go, kept (default: a temp dir, ~3 GB, removed at the end)",
    )
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument(
        "--launcher",
        default="fork",
        choices=["fork", "exec"],
        help="how the demo's agents start (tracerl demo --launcher): exec measures the fresh-process start",
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.workdir:
        return _run(args, modes, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="tracerl-async-bench-") as work:
        return _run(args, modes, Path(work))


def _run(args: argparse.Namespace, modes: list[str], work: Path) -> int:
    """Each mode's demo in ``work``, then the tables."""
    from tracerl.demo import run_demo
    from tracerl.demo_config import DemoConfig

    results: dict[str, dict] = {}
    for mode in modes:
        k, _, threads = mode.partition(":")
        print(
            f"\n=== --max-staleness {k}" + (f" --train-threads {threads}" if threads else "") + " ===",
            flush=True,
        )
        cfg = DemoConfig(
            workdir=str(work / f"staleness-{mode.replace(':', '-t')}"),
            model=args.model,
            rounds=args.rounds,
            heldout_samples=args.heldout_samples,
            max_staleness=int(k),
            heldout_first=not args.heldout_beside,
            train_threads=int(threads) if threads else None,
            launcher=args.launcher,
        )
        with LoadSampler() as load, CpuSampler() as cpu:
            run = run_demo(cfg)
        results[mode] = measure(run, time.time() - time.monotonic(), cpu.samples)
        results[mode]["load"] = load.summary(*window_of(run, time.time() - time.monotonic()))
        print(json.dumps(results[mode]), flush=True)

    print_summary(results, modes)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
