"""``tracerl ui --store s3://…``: every page of the viewer over a bucket shows what it shows over the same
store on local disk.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1 (s3_server.py); the
viewer is the real ``tracerl ui`` process reaching it through pyarrow's S3 client, configured only by the
standard AWS variables. The store is a real round's (``tracerl demo``, the ui tests' ``real_store``:
spans, transitions with exact token ids, a round, its selection file and checkpoint manifest), plus a
record quarantined by the collector's own writer, copied into the bucket with ``pyarrow.fs.copy_files``.
"""

from __future__ import annotations

import re
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from markupsafe import escape
from tracerl_testing import free_port, start_tracerl, stop_tracerl, tracerl
from ui_testing import store_sql

from collector_exporter.quarantine import Quarantined, write_quarantine
from schemas.tables import ROUNDS_SCHEMA
from store.layout import StoreLayout
from store.location import StoreLocation, parse_store
from store.parquet import write_table_atomic
from trainer.checkpoint import MANIFEST, read_manifest
from trainer.manifest import read_rounds, write_round

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

TRAINER_CACHE = "/nonexistent/trainer-host/cache/policy-000001"
"""Where a trainer on another host keeps its checkpoint (``rounds.checkpoint_path``): not on this host,
so the viewer must read the manifest the trainer mirrors into the store."""


@pytest.fixture(scope="module")
def local_store(real_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the real round's store (the session's is shared, so it stays untouched) with one
    quarantined record, and the round's checkpoint path on a host the viewer cannot read."""
    store = tmp_path_factory.mktemp("ui-s3") / "store"
    shutil.copytree(real_store, store, ignore=shutil.ignore_patterns("wal", "*.safetensors", "optimizer.pt"))
    write_quarantine(parse_store(store), "collector-h1", "000000000007",
                     [Quarantined("spans", "unsupported attribute value <b>kind</b>", 1, 1_764_000_000_000_000_000,
                                  b"\x0a\x00")])
    layout = StoreLayout.at(store)
    for row in read_rounds(layout.location).values():
        write_round(layout.location, {**row, "checkpoint_path": TRAINER_CACHE})
    return store


def upload(store: Path, uri: str, skip: str | None = None) -> None:
    """Copy the local store under ``uri`` (``pyarrow.fs.copy_files``, as a user would sync a store up);
    ``skip``: a top-level path of the store left out."""
    loc = parse_store(uri)
    pafs.copy_files(str(store), loc.root, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=loc.fs)
    if skip:
        loc.fs.delete_dir(loc.path(skip))


def write_round_to(loc: StoreLocation, row: dict) -> None:
    """Replace the bucket's manifest row of ``row['round']`` (``trainer.manifest.write_round`` is local-only)."""
    (path,) = [p for p in loc.files("rounds") if p.endswith(f"round-{row['round']:06d}.parquet")]
    write_table_atomic(pa.Table.from_pylist([row], schema=ROUNDS_SCHEMA), path, "rounds", fs=loc.fs)


@pytest.fixture
def served(local_store: Path, s3_store: str) -> Iterator[tuple[str, str, str]]:
    """(local viewer URL, bucket viewer URL, the bucket's store URI): two ``tracerl ui`` processes."""
    upload(local_store, s3_store)
    procs, urls = [], []
    try:
        for where in (str(local_store), s3_store):
            port = free_port()
            procs.append(start_tracerl("ui", "--store", where, "--listen", f"127.0.0.1:{port}",
                                       health=f"http://127.0.0.1:{port}/healthz"))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls[0], urls[1], s3_store
    finally:
        for p in procs:
            stop_tracerl(p)


def _get(url: str) -> str:
    r = httpx.get(url, timeout=60)
    assert r.status_code == 200, (url, r.status_code, r.text[:500])
    return r.text


def test_every_page_reads_the_bucket_as_it_reads_the_directory(served, local_store):
    """Against moto's S3 server (a stand-in for S3): the same pages, the same content, store name aside."""
    local, bucket, uri = served
    rid = store_sql(local_store, "SELECT rollout_id FROM transitions WHERE token_source = 'gateway' "
                                 "AND policy_version = 1 LIMIT 1")[0][0]
    task = store_sql(local_store, "SELECT task_id FROM rollouts WHERE rollout_id = ?", [rid])[0][0]
    manifest = read_manifest(local_store / "checkpoints" / "policy-000001")
    pages = {
        "/rounds": ["policy@0", manifest["git_sha"][:10] if manifest.get("git_sha") else "policy@0",
                    str(escape(f'"estimator": "{manifest["settings"]["estimator"]}"'))],  # the manifest's settings
        "/rollouts": [rid, task],
        f"/rollouts/{urllib.parse.quote(rid, safe='')}": ["tracerl.gateway policy", 'class="tokens"', "data-id="],
        f"/tasks/{urllib.parse.quote(task, safe='')}": [rid],
        "/doctor": ["quarantine/collector-h1-000000000007.jsonl", "unsupported attribute value &lt;b&gt;kind&lt;/b&gt;"],
    }
    for path, needles in pages.items():
        mine, theirs = _get(local + path), _get(bucket + path)
        for needle in needles:
            assert needle in theirs, (path, needle)
        assert uri in theirs and str(local_store) not in theirs, path
        # the whole page is the same once each names its own store
        assert theirs.replace(uri, "STORE") == mine.replace(str(local_store), "STORE"), path
    # the selection file was read from the bucket: the round's staleness (on-policy: 0) is shown, not "–"
    est = manifest["settings"]["estimator"]
    assert re.search(rf'<td class="n">0\.00</td>\s*<td>{est}</td>', _get(bucket + "/rounds"))


def test_a_manifest_missing_from_the_bucket_is_read_from_the_rounds_checkpoint_path(real_store, local_store,
                                                                                     s3_store):
    """Against moto's S3 server (a stand-in for S3): a trainer that does not mirror its checkpoint into
    the bucket still has its settings shown when the viewer runs beside it (``checkpoint_path``)."""
    from ui import pages
    from ui.store import StoreReader

    upload(local_store, s3_store, skip="checkpoints/policy-000001")
    loc = parse_store(s3_store)
    assert loc.fs.get_file_info(loc.path("checkpoints", "policy-000001", MANIFEST)).type == pafs.FileType.NotFound
    reader = StoreReader(parse_store(s3_store))
    try:
        assert pages.rounds_data(reader)["rounds"][0]["settings"] == {}  # TRAINER_CACHE is not on this host
        # the bucket's row names a checkpoint directory this host holds: the demo's own
        row = read_rounds(parse_store(s3_store))[0]
        write_round_to(loc, {**row, "checkpoint_path": str(real_store / "checkpoints" / "policy-000001")})
        reader.refresh(wait_s=None)
        got = pages.rounds_data(reader)["rounds"][0]
        assert got["settings"] == read_manifest(real_store / "checkpoints" / "policy-000001")["settings"] != {}
        assert pages.estimators(reader)[0] == got["settings"]["estimator"]
    finally:
        reader.close()


def test_a_missing_bucket_is_a_clear_usage_error(s3_store):
    """Against moto's S3 server (a stand-in for S3): no traceback, the URI named, exit status 2."""
    missing = "s3://tracerl-no-such-bucket-4f1c/store"
    run = tracerl("ui", "--store", missing, "--listen", "127.0.0.1:0", check=False, timeout=60)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert missing in run.stderr and "Traceback" not in run.stderr
    empty = tracerl("ui", "--store", s3_store + "-empty", "--listen", "127.0.0.1:0", check=False, timeout=60)
    assert empty.returncode == 2 and "nothing is stored there" in empty.stderr and "Traceback" not in empty.stderr
