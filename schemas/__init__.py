"""Contracts between the stages: Arrow schemas, atomic Parquet I/O, DuckDB views.

Nothing here imports another tracerl package; every stage imports this one.
"""

from schemas.parquet import read_table, write_table_atomic
from schemas.tables import (
    LOGS_SCHEMA,
    REWARDS_SCHEMA,
    ROUNDS_SCHEMA,
    SCHEMA_VERSION,
    SPANS_SCHEMA,
    TABLES,
    TRANSITIONS_SCHEMA,
)

__all__ = [
    "LOGS_SCHEMA",
    "REWARDS_SCHEMA",
    "ROUNDS_SCHEMA",
    "SCHEMA_VERSION",
    "SPANS_SCHEMA",
    "TABLES",
    "TRANSITIONS_SCHEMA",
    "read_table",
    "write_table_atomic",
]
