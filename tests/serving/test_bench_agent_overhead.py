"""The agent-overhead benchmark times both variants and every instrumented call's span arrives; its report
and verdict on runs of known latencies (pure functions, no processes).

The smoke test with tiny settings against the scripted upstream (the tiny-model one adds only the
engine, tested elsewhere, and ~10 s of torch): it checks the bench's plumbing (plain and
instrumented agent processes, the real gateway and `tracerl collect`, the span count in the
store), not its figures; the 2 % target is checked by running the bench.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "agent_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("tracerl_bench_agent_overhead", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the file executes
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_agent_overhead_bench_times_both_variants_and_every_instrumented_call_reaches_the_store(tmp_path):
    bench = load_bench()
    args = bench.parse_args(
        [
            "--upstream",
            "scripted",
            "--calls",
            "3",
            "--reps",
            "1",
            "--warmup-calls",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    (r,) = bench.run(args)

    assert [run.variant for run in r.runs] == ["plain", "instrumented"]
    assert all(len(run.latencies) == 3 and len(set(run.ids)) == 3 for run in r.runs)
    assert len(r.steady("plain")) == len(r.steady("instrumented")) == 2  # the first call of each is warm-up
    assert r.spans_found == r.joined == 3, (
        "each instrumented call: its openai.chat span, the gateway's as child"
    )
    assert r.gateway_spans == r.calls_total == 6
    rows = [ln.split() for ln in bench.report([r], args).splitlines() if ln.startswith("scripted ")]
    assert [row[:2] for row in rows[:2]] == [["scripted", "plain"], ["scripted", "instrumented"]]
    assert len(rows) == 3 and rows[2][-2:] == ["3/3", "3/3"], "the added row ends with spans and joined"


def result(bench, upstream: str, plain_s: float, instrumented_s: float, reps: int = 2):
    """``reps`` processes per variant, 4 calls each at a fixed latency (the first, warm-up, twice as slow)."""
    r = bench.Result(upstream)
    for rep in range(reps):
        for variant, lat in (("plain", plain_s), ("instrumented", instrumented_s)):
            calls = [2 * lat, lat, lat, lat]
            ids = [f"{upstream}-{rep}-{variant}-{i}" for i in range(4)]
            r.runs.append(bench.Run(variant, calls, ids, loop_cpu=0.001 * len(calls), wall=sum(calls) + 0.3))
    r.calls_total, r.spans_found, r.joined, r.gateway_spans = 4 * 2 * reps, 4 * reps, 4 * reps, 4 * 2 * reps
    return r


ARGS = argparse.Namespace(calls=4, reps=2, max_tokens=16, export_every_ms=200)


def test_the_report_shows_what_instrumentation_adds_and_judges_the_target_by_the_larger_estimate():
    bench = load_bench()
    tiny = result(bench, "tiny", 0.010, 0.0101)  # +100 µs on 10 ms: +1 %
    scripted = result(bench, "scripted", 0.001, 0.0013)  # +300 µs of pure instrumentation work
    text = bench.report([scripted, tiny], ARGS)

    rows = {
        tuple(ln.split()[:2]): ln.split() for ln in text.splitlines() if ln.startswith(("tiny ", "scripted "))
    }
    assert rows[("tiny", "plain")][2:4] == ["6", "10.000"]  # 3 steady calls in each of 2 processes, p50 in ms
    assert rows[("tiny", "instrumented")][3] == "10.100"
    added = next(ln for ln in text.splitlines() if ln.startswith("tiny ") and "%" in ln)
    assert "+100 µs  +1.0%" in added and added.split()[-2:] == ["8/8", "8/8"]
    assert "measured directly   +1.00 %" in text
    assert "from absolute cost  +3.00 %" in text  # 300 µs over the tiny engine's 10 ms
    assert text.rstrip().endswith("-> NOT met (judged by the larger)")


def test_the_target_is_met_when_both_estimates_are_within_two_percent():
    bench = load_bench()
    text = bench.report(
        [result(bench, "scripted", 0.001, 0.00105), result(bench, "tiny", 0.010, 0.0101)], ARGS
    )
    assert text.rstrip().endswith("-> met (judged by the larger)")
