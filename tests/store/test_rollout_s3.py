"""``tracerl rollout --store s3://…`` writes its records into the bucket (moto's server stands in for S3).

Before, the driver wrote ``Path(store) / "rollouts"``: ``s3://bucket/p`` became a local directory
``s3:/bucket/p/rollouts`` in the working directory and nothing reached the bucket.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from tracerl_testing import tracerl

from rollout.driver import Driver, run_rollouts
from rollout.tasks import parse_tasks
from store.jsonl import JsonLines
from store.location import parse_store

pytestmark = pytest.mark.slow  # a moto server and agent processes

AGENT = [sys.executable, str(Path(__file__).parents[1] / "rollout" / "fake_agent.py")]


def _records(loc, stem_glob: str = "driver-") -> list[dict]:
    files = [f for f in loc.files("rollouts", suffix=".jsonl") if f.rsplit("/", 1)[-1].startswith(stem_glob)]
    return [json.loads(line) for f in files for line in loc.read_bytes(f).decode().splitlines()]


def test_the_rollout_command_writes_its_records_into_the_bucket_and_nothing_local(s3_store, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "answer": str(i)}) + "\n" for i in range(3)))
    work = tmp_path / "cwd"
    work.mkdir()
    proc = tracerl(
        "rollout",
        "--tasks",
        str(tasks),
        "--store",
        s3_store,
        "--collector",
        "",
        "-n",
        "2",
        "--",
        *AGENT,
        cwd=work,
    )
    assert "6 rollouts: 6 ok" in proc.stdout
    loc = parse_store(s3_store)
    (path,) = loc.files("rollouts", suffix=".jsonl")
    assert path in proc.stdout  # the summary names the object it wrote
    recs = _records(loc)
    assert sorted((r["task_id"], r["sample"]) for r in recs) == [
        (f"t{i}", s) for i in range(3) for s in range(2)
    ]
    assert all(r["status"] == "ok" for r in recs)
    assert list(work.iterdir()) == [], "a bucket store must leave nothing in the working directory"


def test_the_driver_function_writes_through_the_location_it_is_given(s3_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = parse_store(s3_store)
    driver = Driver(
        command=AGENT,
        tasks=parse_tasks(['{"id": "a"}', '{"id": "b"}']),
        n=1,
        concurrency=2,
        retries=0,
        store=loc,
        progress=False,
    )
    records, path = run_rollouts(driver, out=io.StringIO())
    assert {r.task_id for r in records} == {"a", "b"}
    assert loc.is_file(path)
    assert {r["rollout_id"] for r in _records(loc)} == {r.rollout_id for r in records}
    assert list(tmp_path.iterdir()) == []


def test_a_long_run_on_a_bucket_goes_to_parts_each_whole(s3_store):
    loc = parse_store(s3_store)
    with JsonLines(loc, "rollouts", "driver-x", part_lines=2) as log:
        for i in range(5):
            log.append({"i": i})
            # after each append every line so far is stored, none torn
            assert sorted(r["i"] for r in _records(loc, "driver-x")) == list(range(i + 1))
    names = sorted(f.rsplit("/", 1)[-1] for f in loc.files("rollouts", suffix=".jsonl"))
    assert names == ["driver-x.1.jsonl", "driver-x.2.jsonl", "driver-x.jsonl"]
