"""``--store`` names a local directory or an object-storage prefix, reached through ``pyarrow.fs``."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from store.layout import StoreLayout
from store.location import parse_store


def test_a_local_path_is_the_directory_store_layout_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = parse_store("./st")
    assert loc.is_local and loc.root == str(StoreLayout.at("./st").root) == str(tmp_path / "st")
    assert loc.table("spans") == str(tmp_path / "st" / "spans")
    assert not loc.exists()


@pytest.mark.slow
def test_an_s3_uri_uses_the_standard_aws_variables(s3_store):
    """The endpoint and keys come only from AWS_ENDPOINT_URL etc. (set by the fixture), as for a user."""
    loc = parse_store(s3_store + "/")
    assert isinstance(loc.fs, pafs.S3FileSystem) and not loc.is_local
    bucket = s3_store.removeprefix("s3://").split("/")[0]
    assert loc.root == f"{bucket}/store" and loc.path("spans", "date=x") == f"{bucket}/store/spans/date=x"
    assert not loc.exists()
    with loc.fs.open_output_stream(loc.path("hello.txt")) as f:
        f.write(b"hi")
    assert loc.exists()
