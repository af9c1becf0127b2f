"""The environment an unchanged agent runs in: the three variables that point it at tracerl.

``OTEL_RESOURCE_ATTRIBUTES`` gains ``tracerl.rollout_id`` / ``tracerl.task_id`` (merged with the
user's own), ``OTEL_EXPORTER_OTLP_ENDPOINT`` names the collector, ``OPENAI_BASE_URL`` the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, unquote

from schemas.attributes import ROLLOUT_ID, TASK_ID

TASK_VIA = ("stdin", "arg", "env")
# Keys of OTEL_RESOURCE_ATTRIBUTES the driver owns; a value already in the environment is replaced.
ROLLOUT_KEY, TASK_KEY = ROLLOUT_ID, TASK_ID


def merge_resource_attributes(existing: str | None, extra: Mapping[str, str]) -> str:
    """Merge into an ``OTEL_RESOURCE_ATTRIBUTES`` value: keep the user's keys, ours win on conflict.

    Values are percent-encoded, as the OTel spec (and the Python SDK's decoder) expects, so a task
    id with ``,`` or ``=`` survives the trip.
    """
    pairs: list[tuple[str, str]] = []
    for item in (existing or "").split(","):
        if "=" not in item:
            continue
        key, value = item.split("=", 1)
        key = key.strip()
        if key and key not in extra:
            pairs.append((key, value.strip()))
    pairs += [(k, quote(v, safe="")) for k, v in extra.items()]
    return ",".join(f"{k}={v}" for k, v in pairs)


def parse_resource_attributes(value: str) -> dict[str, str]:
    """The inverse of ``merge_resource_attributes`` (as the SDK decodes it), for checks and tests."""
    out = {}
    for item in value.split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = unquote(v.strip())
    return out


def agent_env(base: Mapping[str, str], *, rollout_id: str, task_id: str, task_json: str,
              otlp: str, gateway: str, otlp_protocol: str = "grpc") -> dict[str, str]:
    """The complete environment of one agent run: the driver's own, plus what points it at tracerl.

    The OTLP protocol is set with the endpoint (``--otlp`` is the collector's gRPC port, or its HTTP
    port for ``http/*``), never left to the SDK's default, which differs by language (Python: grpc,
    JavaScript: http/protobuf); a signal-specific traces endpoint or protocol in the parent
    environment would override ours, so they are dropped.
    """
    env = dict(base)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_EXPORTER_OTLP_PROTOCOL": otlp_protocol,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_RESOURCE_ATTRIBUTES": merge_resource_attributes(
            base.get("OTEL_RESOURCE_ATTRIBUTES"), {ROLLOUT_KEY: rollout_id, TASK_KEY: task_id}),
        "TRACERL_TASK": task_json,
    })
    if gateway:
        env["OPENAI_BASE_URL"] = gateway
    env.setdefault("OPENAI_API_KEY", "tracerl")  # the openai client refuses to start without one
    return env


def agent_argv(command: list[str], task_json: str, task_via: str) -> list[str]:
    """The agent's command line: unchanged, or with the task JSON appended for ``--task-via arg``."""
    return [*command, task_json] if task_via == "arg" else list(command)

