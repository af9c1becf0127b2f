"""Arrow schemas of every table in the store (DESIGN.md "Data contracts").

Attribute maps are ``map<string, string>`` so DuckDB reads them without UDFs
(``attributes['gen_ai.request.model']``). Value encoding, one rule for every map:
an OTLP string is stored as-is; every other value (int, double, bool, array, kvlist)
is stored as its JSON text (``42``, ``0.5``, ``true``, ``[1, 2]``, ``{"k": "v"}``);
bytes are stored base64. Readers that expect structure ``json.loads`` the text.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1"
"""Bumped on any incompatible change to any table; written into every Parquet file's metadata."""

ATTRS = pa.map_(pa.string(), pa.string())
TS = pa.timestamp("ns", tz="UTC")

SPANS_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),  # 32 lowercase hex chars
        pa.field("span_id", pa.string(), nullable=False),  # 16 lowercase hex chars
        pa.field("parent_span_id", pa.string()),  # null for a root span
        pa.field("trace_state", pa.string()),
        pa.field("name", pa.string()),
        pa.field("kind", pa.string()),  # unspecified|internal|server|client|producer|consumer
        pa.field("start_time_ns", pa.int64()),
        pa.field("end_time_ns", pa.int64()),
        pa.field("status_code", pa.string()),  # unset|ok|error
        pa.field("status_message", pa.string()),
        pa.field("attributes", ATTRS),
        pa.field("resource_attributes", ATTRS),
        pa.field("scope_name", pa.string()),
        pa.field("scope_version", pa.string()),
        pa.field(
            "events",
            pa.list_(
                pa.struct(
                    [
                        pa.field("name", pa.string()),
                        pa.field("time_ns", pa.int64()),
                        pa.field("attributes", ATTRS),
                    ]
                )
            ),
        ),
        pa.field(
            "links",
            pa.list_(
                pa.struct(
                    [
                        pa.field("trace_id", pa.string()),
                        pa.field("span_id", pa.string()),
                        pa.field("trace_state", pa.string()),
                        pa.field("attributes", ATTRS),
                    ]
                )
            ),
        ),
        pa.field("dropped_attributes_count", pa.int32()),
        pa.field("dropped_events_count", pa.int32()),
        pa.field("dropped_links_count", pa.int32()),
        pa.field("received_at", TS),
        # tracerl.rollout_id from span, then resource attributes; else the trace id.
        pa.field("rollout_id", pa.string()),
    ]
)

LOGS_SCHEMA = pa.schema(
    [
        pa.field("time_ns", pa.int64()),
        pa.field("observed_time_ns", pa.int64()),
        pa.field("severity_number", pa.int32()),
        pa.field("severity_text", pa.string()),
        pa.field("event_name", pa.string()),
        pa.field("body", pa.string()),  # same encoding as attribute values
        pa.field("attributes", ATTRS),
        pa.field("resource_attributes", ATTRS),
        pa.field("scope_name", pa.string()),
        pa.field("scope_version", pa.string()),
        pa.field("trace_id", pa.string()),  # null when the record is not in a span
        pa.field("span_id", pa.string()),
        pa.field("flags", pa.int32()),
        pa.field("dropped_attributes_count", pa.int32()),
        pa.field("received_at", TS),
        # Log records have no stable id: the collector assigns one (hash of record bytes) to dedupe retries.
        pa.field("log_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string()),
    ]
)

REWARDS_SCHEMA = pa.schema(
    [
        pa.field("reward_id", pa.string(), nullable=False),  # idempotency key: retries never double a reward
        pa.field("rollout_id", pa.string()),  # one of rollout_id / trace_id is set
        pa.field("trace_id", pa.string()),
        pa.field("span_id", pa.string()),  # optional target call
        pa.field("response_id", pa.string()),  # optional target call, by gen_ai.response.id
        pa.field("name", pa.string()),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("source", pa.string()),  # side_channel|span|event|offline|judge
        pa.field("at", TS),
        # Who gave a judge's reward and why (``tracerl judge``); null for every other source. Appended
        # last and nullable, so files written before them still read (as nulls) everywhere.
        pa.field("judge_model", pa.string()),
        pa.field("rubric_hash", pa.string()),  # rubric text + mode + judge model + prompt version
        pa.field("explanation", pa.string()),  # the judge's reason for this score
        pa.field("judge_prompt_tokens", pa.int64()),  # this rollout's share of the judge call's tokens
        pa.field("judge_completion_tokens", pa.int64()),
    ]
)

TRANSITIONS_SCHEMA = pa.schema(
    [
        pa.field("transition_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("task_id", pa.string()),
        pa.field("trace_id", pa.string()),
        pa.field("span_id", pa.string()),
        pa.field("step", pa.int32()),  # order of the call in its rollout, from 0
        pa.field("agent_name", pa.string()),
        pa.field("trainable", pa.bool_()),
        pa.field("model", pa.string()),  # served model name, e.g. policy@3
        pa.field("policy_version", pa.int64()),  # 3 for policy@3; null when unknown
        pa.field("prompt_messages", pa.string()),  # JSON list of OpenAI-style chat messages
        pa.field("tools", pa.string()),  # JSON list of tool definitions, or null
        pa.field("response_message", pa.string()),  # JSON assistant message
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("response_token_ids", pa.list_(pa.int32())),
        pa.field("response_logprobs", pa.list_(pa.float32())),
        pa.field("token_source", pa.string()),  # gateway|span|retokenized
        pa.field("reward", pa.float64()),  # credited to this call
        pa.field("rollout_reward", pa.float64()),
        pa.field("reward_source", pa.string()),
        pa.field("is_last", pa.bool_()),
        pa.field("started_at", TS),
        pa.field("ended_at", TS),
        pa.field("input_tokens", pa.int64()),
        pa.field("output_tokens", pa.int64()),
        # the converter pass that wrote the row: a rollout converted again (a reward that arrived
        # later, ``tracerl convert --rebuild``) is read from its latest pass only (schemas.views)
        pa.field("conversion", pa.int64()),
        # why a call is never trained on although its agent was selected: "malformed chat (<dialect>): <problem>"
        # (span_to_transition.chat_messages.CHAT_PROBLEMS); null for a well-formed call, and in files written
        # before the column existed (readers fill in null)
        pa.field("untrainable_reason", pa.string()),
        # the names of the rewards summed into rollout_reward, comma-joined (``--reward-from`` chose them; an
        # unnamed reward is "reward"): "grade" or "judge" says whose score trained the call; null for no
        # reward or a --fill-reward, and in files written before the column existed (readers fill in null)
        pa.field("reward_names", pa.string()),
        # the canary arm the gateway routed the call's rollout to (``serving`` | ``candidate``, its span's
        # ``tracerl.canary.arm``, schemas/attributes.py); null for a call no canary routed, and in files
        # written before the column existed (readers fill in null). The arm is relative to the gateway's pair
        # at that moment; the version that served the call is policy_version
        pa.field("canary_arm", pa.string()),
    ]
)

ROUNDS_SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64()),  # version whose transitions this round trained on
        pa.field("base_model", pa.string()),
        pa.field("checkpoint_path", pa.string()),
        pa.field("adapter", pa.bool_()),
        pa.field("n_rollouts", pa.int64()),
        pa.field("n_transitions", pa.int64()),
        pa.field("mean_reward", pa.float64()),
        pa.field("loss", pa.float64()),
        pa.field("kl", pa.float64()),
        pa.field("clip_fraction", pa.float64()),
        pa.field("timings", pa.string()),  # JSON {phase: seconds}
        pa.field("published_at", TS),
        # started|trained|published|failed, and with a canary (tracerl train --canary, tracerl promote):
        # canary (policy@k+1 serves a share beside its parent) -> promoted | rolled_back
        pa.field("status", pa.string()),
        # JSON: the round's TrainMetrics + DatasetStats + tokens_per_s, nproc (trainer.round_metrics.metrics_json);
        # null while started/failed, and in files written before it existed (read_table fills in null)
        pa.field("metrics", pa.string()),
        # the advantage estimator the round used (--estimator auto resolved) and why; null in files
        # written before these columns existed (read_table fills in null), as for metrics
        pa.field("estimator", pa.string()),
        pa.field("estimator_reason", pa.string()),
        # the version the round started from and trained on: k, or after a rolled-back round the
        # version that kept serving (null in files written before it existed: read as k)
        pa.field("parent_version", pa.int64()),
        # JSON: the canary decision and its numbers (loop.canary.CanaryDecision + the rule), last look;
        # and/or the eval gate's (loop.gate.GateResult under "gate", tracerl train --gate-tasks)
        pa.field("canary", pa.string()),
    ]
)

PARTITION_SCHEMA = pa.schema([pa.field("date", pa.string())])
"""Every table is hive-partitioned by ``date=YYYY-MM-DD`` (UTC), never by trace id."""

TABLES: dict[str, pa.Schema] = {
    "spans": SPANS_SCHEMA,
    "logs": LOGS_SCHEMA,
    "rewards": REWARDS_SCHEMA,
    "transitions": TRANSITIONS_SCHEMA,
    "rounds": ROUNDS_SCHEMA,
}
