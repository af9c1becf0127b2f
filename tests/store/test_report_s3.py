"""``tracerl report`` reads the rounds manifest from a bucket (moto's standalone server stands in for S3)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from tracerl_testing import tracerl

from schemas.tables import ROUNDS_SCHEMA
from store.location import parse_store
from store.parquet import write_table_atomic
from trainer.manifest import read_rounds

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def test_report_reads_the_rounds_of_a_bucket_store(s3_store, tmp_path):
    loc = parse_store(s3_store)
    rows = [{"round": k, "policy_version": k, "base_model": "/m", "checkpoint_path": None, "adapter": False,
             "n_rollouts": 8, "n_transitions": 16, "mean_reward": 0.25 * k, "loss": 0.1, "kl": 0.0,
             "clip_fraction": 0.0, "timings": json.dumps({"train": 2.0}), "published_at": None,
             "status": "published", "metrics": json.dumps({"staleness": {"0": 10, "1": 6}, "is_tokens": 40,
                                                           "is_weight_min": 0.8, "is_weight_mean": 1.0,
                                                           "is_weight_max": 1.3})} for k in range(2)]
    for r in rows:
        write_table_atomic(pa.Table.from_pylist([r], schema=ROUNDS_SCHEMA),
                           loc.path("rounds", "date=2026-11-25", f"round-{r['round']:06d}.parquet"), "rounds",
                           fs=loc.fs)
    assert sorted(read_rounds(parse_store(s3_store))) == [0, 1]
    png = tmp_path / "report.png"
    out = tracerl("report", "--store", s3_store, "--out", str(png)).stdout
    assert "published" in out and "0.2500" in out
    assert png.stat().st_size > 0
