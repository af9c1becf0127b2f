"""The agent-overhead benchmark times both variants and every instrumented call's span arrives.

A smoke test with tiny settings against the scripted upstream (the tiny-model one adds only the
engine, tested elsewhere, and ~10 s of torch): it checks the bench's plumbing (plain and
instrumented agent processes, the real gateway and `tracerl collect`, the span count in the
store), not its figures; the 2 % target is checked by running the bench.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "agent_overhead.py"
pytestmark = pytest.mark.slow


def load_bench():
    spec = importlib.util.spec_from_file_location("tracerl_bench_agent_overhead", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the file executes
    spec.loader.exec_module(bench)
    return bench


def test_agent_overhead_bench_times_both_variants_and_every_instrumented_call_reaches_the_store(tmp_path):
    bench = load_bench()
    args = bench.parse_args(["--upstream", "scripted", "--calls", "3", "--reps", "1", "--warmup-calls", "0",
                             "--out", str(tmp_path)])
    (r,) = bench.run(args)

    assert [run.variant for run in r.runs] == ["plain", "instrumented"]
    assert all(len(run.latencies) == 3 and len(set(run.ids)) == 3 for run in r.runs)
    assert len(r.steady("plain")) == len(r.steady("instrumented")) == 2  # the first call of each is warm-up
    assert r.spans_found == r.joined == 3, "each instrumented call: its openai.chat span, the gateway's as child"
    assert r.gateway_spans == r.calls_total == 6
    rows = [ln.split() for ln in bench.report([r], args).splitlines() if ln.startswith("scripted ")]
    assert [row[:2] for row in rows[:2]] == [["scripted", "plain"], ["scripted", "instrumented"]]
    assert len(rows) == 3 and rows[2][-2:] == ["3/3", "3/3"], "the added row ends with spans and joined"
