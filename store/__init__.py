"""Every byte the stages persist: layout, the one atomic writer, Parquet writes, DuckDB views, listing.

A store is a local directory or an object-storage prefix (``s3://bucket/prefix``); both are reached
through ``pyarrow.fs``, so a stage that writes through this package runs unchanged on either.
This package knows file names and bytes, never what a span means.
"""
