"""Every byte the stages persist: layout, the one atomic writer, Parquet writes, DuckDB views, listing, locks.

A store is a local directory or an object-storage prefix (``s3://bucket/prefix``); both are reached
through ``pyarrow.fs``, so a stage that writes through this package runs unchanged on either.
This package knows file names and bytes, never what a span means.

Where object storage stands: ``collect`` (WAL local, tables to the bucket), ``convert``, ``train``
(checkpoints written locally and copied into the bucket, ``trainer/checkpoint_store.py``), ``sql``,
``status``, ``doctor``, ``report``, ``ui`` and ``rollout`` (its records through ``jsonl.py``) take
``s3://bucket/prefix``, and so does the in-process exporter (``TRACERL_STORE``, its WAL in ``TRACERL_WAL``). The converter's and the trainer's
locks (``lease.py``) are ``flock`` on local disk and, on a bucket, a lease object written with S3's
conditional PUTs (``If-None-Match`` / ``If-Match``) through boto3, since ``pyarrow.fs`` exposes no
conditional put. ``collect --convert`` runs the converter in the bucket too, under that lease.
"""
