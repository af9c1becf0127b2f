"""Flattened attributes back into lists: ``prefix.{i}.rest = v`` -> ``[{rest: v}]``.

OpenLLMetry (<= 0.47), AgentOps, LiteLLM and OpenInference cannot put a list in an attribute, so they spell
each message, tool call and tool definition as indexed keys; ``unflatten`` rebuilds the lists they flattened.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

FLAT_TOOL_PREFIXES = ("llm.request.functions.", "gen_ai.request.functions.")
"""Flattened tool definitions: OpenLLMetry <= 0.47 and LiteLLM spell them ``llm.*``, AgentOps 0.4.x ``gen_ai.*``."""
FLAT_TOOL_KEYS = frozenset(p + "0.name" for p in FLAT_TOOL_PREFIXES)

_INDEXED = re.compile(r"^(\d+)\.(.+)$")


def unflatten(attrs: Mapping[str, str], prefix: str) -> list[dict[str, Any]]:
    """``{prefix}{i}.a.{j}.b = v`` into ``[{"a": [{"b": v}]}]``, ordered by the integer indices."""
    root: dict[int, dict[str, Any]] = {}
    n = len(prefix)
    for key, value in attrs.items():
        if not key.startswith(prefix):
            continue
        m = _INDEXED.match(key[n:])
        if not m:
            continue
        node = root.setdefault(int(m.group(1)), {})
        parts = m.group(2).split(".")
        i = 0
        while i < len(parts) - 1:
            if i + 1 < len(parts) - 1 and parts[i + 1].isdigit():
                lst = node.setdefault(parts[i], {})
                node = lst.setdefault(int(parts[i + 1]), {})
                i += 2
            else:
                node = node.setdefault(parts[i], {})
                i += 1
        node[parts[-1]] = value

    def freeze(obj: Any) -> Any:
        if isinstance(obj, dict):
            if obj and all(isinstance(k, int) for k in obj):
                return [freeze(obj[k]) for k in sorted(obj)]
            return {k: freeze(v) for k, v in obj.items()}
        return obj

    return [freeze(root[i]) for i in sorted(root)]


def flat_tools(attrs: Mapping[str, str]) -> list[dict[str, Any]]:
    """The tool definitions under the first ``FLAT_TOOL_PREFIXES`` spelling that has any."""
    tools: list[dict[str, Any]] = []
    for prefix in FLAT_TOOL_PREFIXES:
        tools = tools or unflatten(attrs, prefix)
    return tools
