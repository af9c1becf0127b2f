"""The one atomic writer: whole or nothing, on local disk and on object storage."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.tables import SCHEMA_VERSION, TABLES
from store.atomic import write_atomic
from store.location import parse_store
from store.parquet import write_table_atomic


def _fail_halfway(f) -> None:
    f.write(b"half of the new bytes")
    raise OSError("disk full")


def test_a_local_write_replaces_the_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "d" / "state.json"
    write_atomic(path, b"old")
    write_atomic(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_local_write_keeps_the_old_bytes(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, b"old")
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, _fail_halfway)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


@pytest.mark.slow
def test_an_object_write_is_one_put_and_a_failed_one_leaves_the_old_object(s3_store):
    """Against moto's S3 server (a stand-in for S3) through pyarrow's real S3 client."""
    loc = parse_store(s3_store)
    path = loc.path("rounds", "state.json")
    write_atomic(path, b"old", loc.fs)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, _fail_halfway, loc.fs)
    with loc.fs.open_input_stream(path) as f:
        assert f.read() == b"old"
    write_atomic(path, b"new", loc.fs)
    with loc.fs.open_input_stream(path) as f:
        assert f.read() == b"new"


@pytest.mark.slow
def test_parquet_carries_the_same_metadata_on_disk_and_in_a_bucket(tmp_path, s3_store):
    rows = pa.Table.from_pylist([{"reward_id": "w1", "rollout_id": "r1", "name": "score", "value": 1.0}],
                                schema=TABLES["rewards"])
    local = write_table_atomic(rows, tmp_path / "rewards" / "a.parquet", "rewards")
    loc = parse_store(s3_store)
    remote = write_table_atomic(rows, loc.path("rewards", "a.parquet"), "rewards", fs=loc.fs)
    disk = pq.read_table(local)
    with loc.fs.open_input_file(remote) as f:
        bucket = pq.read_table(f)
    assert disk.schema.metadata[b"tracerl.schema_version"] == SCHEMA_VERSION.encode()
    assert bucket.schema.metadata == disk.schema.metadata and bucket.schema == disk.schema
    assert bucket.equals(disk) and disk.schema.names == TABLES["rewards"].names
