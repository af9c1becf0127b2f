"""Run by ``tracerl check`` with the AGENT's Python (``python check_probe.py``), never imported by tracerl: what
its environment holds that decides what ``opentelemetry-instrument`` records. Prints one JSON object.

``installed``: every distribution's name (for the framework hints). ``instrumentors``: every entry point in
``opentelemetry_instrumentor``, with its distribution, the libraries its ``[instruments]`` / ``[instruments-any]``
extras name and the version of each found here, and the dependency conflict that ``opentelemetry-instrument``
itself computes (``opentelemetry.instrumentation.dependencies.get_dist_dependency_conflicts``): an instrumentor
with a conflict is skipped at startup with only a debug log. ``auto_instrumentation``: whether
``opentelemetry-instrumentation`` is importable at all. Standard library only, besides that package and its
``packaging``: the agent's environment is not ours.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import sys

EXTRAS = ("instruments", "instruments-any")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _targets(dist: metadata.Distribution) -> list[dict]:
    """The libraries an instrumentor instruments (its requirements under the two extras), each with the version
    installed here (None: not installed)."""
    out = []
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        extra = next((e for e in EXTRAS if re.search(rf"extra\s*==\s*['\"]{e}['\"]", marker)), None)
        if extra is None:
            continue
        name = re.split(r"[\s\[<>=!~;(]", spec.strip(), maxsplit=1)[0]
        out.append({"requirement": spec.strip(), "name": name, "extra": extra, "installed": _version(name)})
    return out


def _conflict(dist: metadata.Distribution) -> dict | None:
    try:
        from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts
    except ImportError:
        return None
    conflict = get_dist_dependency_conflicts(dist)
    if conflict is None:
        return None
    return {
        "required": None if conflict.required is None else str(conflict.required),  # a Requirement or text
        "found": None if conflict.found is None else str(conflict.found),
        "required_any": [str(r) for r in conflict.required_any or []],
        "found_any": [str(f) for f in conflict.found_any or []],
        "message": str(conflict),
    }


def probe() -> dict:
    """The facts, as JSON-ready data."""
    try:
        import opentelemetry.instrumentation.auto_instrumentation  # noqa: F401

        auto = True
    except ImportError:
        auto = False
    instrumentors = []
    for ep in metadata.entry_points(group="opentelemetry_instrumentor"):
        dist = ep.dist
        if dist is None:
            continue
        instrumentors.append(
            {
                "name": ep.name,
                "dist": dist.metadata["Name"],
                "version": dist.version,
                "targets": _targets(dist),
                "conflict": _conflict(dist),
            }
        )
    installed = sorted({(d.metadata["Name"] or "").lower() for d in metadata.distributions()} - {""})
    return {
        "python": sys.executable,
        "auto_instrumentation": auto,
        "installed": installed,
        "instrumentors": instrumentors,
    }


if __name__ == "__main__":
    print(json.dumps(probe()))
