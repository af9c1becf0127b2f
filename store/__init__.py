"""Every byte the stages persist: layout, the one atomic writer, Parquet writes, DuckDB views, listing.

A store is a local directory or an object-storage prefix (``s3://bucket/prefix``); both are reached
through ``pyarrow.fs``, so a stage that writes through this package runs unchanged on either.
This package knows file names and bytes, never what a span means.

Where object storage stands: ``collect`` (WAL local, tables to the bucket), ``sql`` and ``status``
take ``s3://bucket/prefix``; ``convert``, ``train``, ``doctor``, ``report`` and ``ui`` still need a
local store (``StoreLayout.at`` refuses a URI). The converter's lock is ``flock`` on local disk;
on a bucket it needs a conditional put (``If-None-Match``), which ``pyarrow.fs`` does not expose,
so a lease there waits for another client (or an expiring lease accepted as best effort).
"""
