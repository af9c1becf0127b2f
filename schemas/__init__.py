"""Contracts between the stages: Arrow schemas, the schema version, view SQL, and (``schemas.attributes``)
every ``tracerl.*`` span attribute name with the ``name@k`` version rule.

Nothing here imports another tracerl package; every stage imports this one.
"""

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
]
