"""The gateway benchmark runs, records one span per proxied call, and reports both paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"


def test_gateway_bench_measures_both_paths_and_records_every_call():
    spec = importlib.util.spec_from_file_location("tracerl_bench_gateway", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.run(calls=60, model_dir=None)
    assert r["spans"] == 60 + 50  # warm-up calls are proxied (and recorded) too
    assert 0 < r["direct_p50_ms"] < r["gateway_p50_ms"]
    assert r["added_p50_ms"] < 20, "sanity bound only; the 1 ms target is checked by running the bench"
