"""What ``tracerl doctor`` says about the judge: groups whose answers could not be used, and the fix.

``judge_findings`` is pure (the judge's failure records in, findings as (problem, saw, means, fix) out);
``judge_states`` reads the records (``judge/<name>.json``) from the store.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from store.location import StoreLocation


def judge_states(loc: StoreLocation) -> dict[str, dict[str, Any]]:
    """Each judge name's failure record in the store (none when the judge never ran)."""
    return {PurePosixPath(p).stem: json.loads(loc.read_bytes(p)) for p in loc.files("judge", suffix=".json")}


def judge_findings(states: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """One finding per judge name with failed groups on record."""
    out = []
    for name, state in sorted(states.items()):
        counts = state.get("failures") or {}
        if not counts:
            continue
        waiting = sum(len(v) for v in (state.get("failed") or {}).values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        out.append(
            (
                f"judge answers that could not be used (reward name {name!r})",
                f"{sum(counts.values())} judge groups failed ({reasons}); {waiting} rollouts are not asked about again "
                "under the same rubric hash",
                "those rollouts have no judge reward (a failed judgment is never turned into a score), so they do not "
                "train unless another reward arrives",
                "use a stronger judge or one that honours response_format (vLLM does, by guided decoding); with "
                "missing_ids, lower --max-group; with rejected, check the judge's context length; then "
                f"tracerl judge --name {name} --retry-failed",
            )
        )
    return out
