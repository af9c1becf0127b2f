"""Training rounds on a bucket store (moto's standalone S3 server stands in for S3, see tests/s3_server.py).

The manifest, the selections and the lock live in the bucket; checkpoints are written to a local
directory and copied into the bucket, so a trainer on another host (here: another empty local
directory) goes on from where the first one stopped.
"""

from __future__ import annotations

import json
import time
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from safetensors.torch import load_file
from tracerl_testing import tracerl

from schemas.tables import TRANSITIONS_SCHEMA
from store.lease import ObjectLease
from store.location import parse_store
from store.parquet import write_table_atomic
from trainer.checkpoint import MANIFEST, read_manifest
from trainer.manifest import read_rounds, read_selection
from trainer.rounds import PublishRequest, run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def put_rows(store: str, rows: list[dict]) -> None:
    """Transitions into the bucket, one committed file, as the converter writes them there."""
    loc = parse_store(store)
    write_table_atomic(pa.Table.from_pylist(rows, schema=TRANSITIONS_SCHEMA),
                       loc.path("transitions", "date=2026-11-25", f"part-{uuid.uuid4().hex}.parquet"),
                       "transitions", fs=loc.fs)


def stored_files(store: str, *parts: str) -> dict[str, int]:
    loc = parse_store(store)
    base = loc.path(*parts)
    infos = loc.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return {i.path[len(base) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}


def test_a_round_on_a_bucket_and_the_next_on_another_host(s3_store, tmp_path, make_rollouts, train_settings,
                                                          tiny_model_dir):
    put_rows(s3_store, make_rollouts(0))
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    out = tracerl("train", "--once", "--store", s3_store, "--checkpoints", str(host_a), "--model",
                  str(tiny_model_dir), "--min-rollouts", "8", "--no-progress")
    assert "round 0" in out.stdout and "status=trained" in out.stdout, out.stdout + out.stderr

    rounds = read_rounds(parse_store(s3_store))
    assert rounds[0]["status"] == "trained"
    assert rounds[0]["checkpoint_path"] == f"{s3_store}/checkpoints/policy-000001"
    sel = read_selection(parse_store(s3_store), 0)
    assert sel is not None and len(sel["rollout_ids"]) == 12
    local_1 = host_a / "policy-000001"
    in_bucket = stored_files(s3_store, "checkpoints", "policy-000001")
    assert in_bucket == {p.relative_to(local_1).as_posix(): p.stat().st_size
                         for p in local_1.rglob("*") if p.is_file()}
    assert not list(tmp_path.glob("host-a/round-*")), "selections live in the store, not the local cache"

    # host B: nothing local; it publishes round 0 (left unannounced) from a copy fetched from the bucket
    got: list[PublishRequest] = []
    s_b = train_settings(s3_store, checkpoints=str(host_b))
    first = run_once(s_b, publisher=got.append, log=lambda m: None)
    assert first.status == "published" and [g.name for g in got] == ["policy@1"]
    assert got[0].checkpoint_path == host_b / "policy-000001"
    assert load_file(str(host_b / "policy-000001" / "model.safetensors")).keys() == \
        load_file(str(local_1 / "model.safetensors")).keys()
    a = load_file(str(local_1 / "model.safetensors"))
    b = load_file(str(host_b / "policy-000001" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)

    # and trains round 1 from that parent on new data
    put_rows(s3_store, make_rollouts(1))
    second = run_once(s_b, publisher=got.append, log=lambda m: None)
    assert second.status == "published" and second.round == 1 and got[-1].name == "policy@2"
    assert read_manifest(host_b / "policy-000002")["parent"] == str(host_b / "policy-000001")
    assert MANIFEST in stored_files(s3_store, "checkpoints", "policy-000002")
    assert {r["status"] for r in read_rounds(parse_store(s3_store)).values()} == {"published"}
    used = set(read_selection(parse_store(s3_store), 0)["rollout_ids"]) & set(read_selection(parse_store(s3_store), 1)["rollout_ids"])
    assert not used, "no rollout is trained twice"


def test_a_dead_trainers_lease_blocks_until_it_expires(s3_store, tmp_path, make_rollouts, train_settings):
    put_rows(s3_store, make_rollouts(0))
    dead = ObjectLease.at(parse_store(s3_store), "checkpoints/.train", ttl_s=3.0, holder="dead-host")
    assert dead.try_take()  # taken and never renewed nor released: a trainer killed with kill -9
    s = train_settings(s3_store, checkpoints=str(tmp_path / "cache"))
    out = run_once(s, log=lambda m: None)
    assert out.status == "locked" and read_rounds(parse_store(s3_store)) == {}
    record, _ = dead.read()
    time.sleep(max(0.0, float(record["expires_at"]) - time.time()) + 0.2)
    out = run_once(s, log=lambda m: None)
    assert out.status == "trained" and out.round == 0
    lease, _ = dead.read()
    assert lease["holder"] != "dead-host" and float(lease["expires_at"]) <= time.time(), "released after the run"


def test_pruning_removes_old_checkpoints_from_the_bucket_too(s3_store, tmp_path, make_rollouts, train_settings):
    s = train_settings(s3_store, checkpoints=str(tmp_path / "cache"), keep_checkpoints=2)
    for v in range(3):
        put_rows(s3_store, make_rollouts(v))
        assert run_once(s, publisher=lambda req: None, log=lambda m: None).status == "published"
    names = {p.split("/", 1)[0] for p in stored_files(s3_store, "checkpoints")}
    assert {n for n in names if n.startswith("policy-")} == {"policy-000002", "policy-000003"}
    assert sorted(p.name for p in (tmp_path / "cache").glob("policy-*")) == ["policy-000002", "policy-000003"]
    assert json.loads(parse_store(s3_store).read_bytes(parse_store(s3_store).path("checkpoints", "round-000000.json")))
