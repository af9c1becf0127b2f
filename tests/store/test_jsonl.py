"""store/jsonl.py on local disk: one file, a line kept (flushed) as soon as it is appended."""

from __future__ import annotations

import json

from store.jsonl import JsonLines
from store.location import parse_store


def test_each_append_is_on_disk_before_the_writer_closes(tmp_path):
    loc = parse_store(tmp_path / "store")
    log = JsonLines(loc, "rollouts", "driver-r1", part_lines=1)  # parts are for buckets only
    path = tmp_path / "store" / "rollouts" / "driver-r1.jsonl"
    assert (
        log.path == str(path) and path.read_text() == ""
    )  # exists from the start, as an interrupted run shows
    for i in range(3):
        log.append({"i": i, "text": "é"})
        assert [json.loads(x)["i"] for x in path.read_text(encoding="utf-8").splitlines()] == list(
            range(i + 1)
        )
    log.close()
    assert sorted(p.name for p in path.parent.iterdir()) == ["driver-r1.jsonl"]


def test_a_second_writer_of_the_same_name_appends(tmp_path):
    loc = parse_store(tmp_path)
    for i in range(2):
        with JsonLines(loc, "rollouts", "same") as log:
            log.append({"i": i})
    assert (tmp_path / "rollouts" / "same.jsonl").read_text().splitlines() == ['{"i": 0}', '{"i": 1}']
