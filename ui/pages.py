"""What each page shows, read from the store: plain dicts and dataclasses for the templates.

Every query is a constant string with parameters; the only user input that reaches SQL goes through
``ui.filters`` (the rollouts table) or is a bound parameter (a rollout or task id from the URL).
Advantages come from ``trainer.advantages.rollout_advantages``, the function the trainer uses, over
the same group (task × policy version) with the estimator of the round that trained on it; for a
group-free estimator (REINFORCE++) the group is the version's whole batch of each agent (the trainer's
batch is the round's selection, which asynchronous rounds widen to older versions too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collector_exporter.quarantine import quarantine_records
from schemas.attributes import GATEWAY_FLAG
from schemas.views import LATEST_ONLY
from span_to_transition.credit import CREDIT
from span_to_transition.doctor import GATEWAY_FIX, diagnose
from span_to_transition.ledger import Ledger
from trainer.advantages import GROUP_FREE, RolloutReward, rollout_advantages
from trainer.checkpoint import MANIFEST
from ui import messages as msg
from ui.charts import Series, line_chart
from ui.filters import RolloutQuery, rollouts_sql
from ui.store import StoreReader, read_local_json
from ui.timeline import layout, ticks
from ui.tokens import load_decoder, token_views

WHY_NOT_GATEWAY = {
    "span": "the token ids come from the agent's own call span (an instrumentation that records them, e.g. "
    "Agent Lightning or LiteLLM's hosted_vllm), not from the gateway: exact, but no gateway version tag",
    "retokenized": "no gateway span joined this call (the agent did not call through the gateway, or its call "
    "span did not propagate traceparent and the response ids did not match), so the trainer re-renders the "
    "messages with the chat template: the ids may differ from what the model sampled, and there are no "
    "sampling logprobs. Fix: " + GATEWAY_FIX,
}
"""Why a call's ``token_source`` is not ``gateway``, and what to do about it."""


# -- rounds ------------------------------------------------------------------------------------------


def manifest_of(reader: StoreReader, round_k: int, checkpoint_path: str | None) -> dict[str, Any]:
    """The checkpoint's self-description (settings, git sha, selection), or {} without one.

    Round k publishes ``policy@k+1``: its manifest is read from the store first
    (``checkpoints/policy-<k+1>/tracerl_checkpoint.json``, where the trainer writes it on a local store
    and mirrors it on a bucket), then from ``checkpoint_path`` as a path on this host (on a bucket, the
    trainer's local copy, readable when the viewer runs beside the trainer). A round without a checkpoint
    yet (``checkpoint_path`` empty) has none. Kept per store version: on a bucket each read is a request.
    """
    if not checkpoint_path:
        return {}

    def read() -> dict[str, Any]:
        return (reader.read_json("checkpoints", f"policy-{round_k + 1:06d}", MANIFEST)
                or read_local_json(Path(checkpoint_path) / MANIFEST) or {})

    return reader.memo(f"manifest:{round_k}:{checkpoint_path}", read)


def staleness(reader: StoreReader, rounds: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Round -> mean and max versions behind of the rollouts it trained on (its selection file)."""
    pairs: list[tuple[int, str]] = []
    for k in rounds:
        sel = reader.read_json("checkpoints", f"round-{k:06d}.json") or {}
        pairs += [(k, rid) for rid in sel.get("rollout_ids", [])]
    if not pairs:
        return {}
    rows = reader.rows(STALENESS_SQL, {"rounds": [p[0] for p in pairs], "ids": [p[1] for p in pairs]})
    return {s["round"]: s for s in rows}


def rounds_data(reader: StoreReader) -> dict[str, Any]:
    rounds = reader.rows("SELECT * EXCLUDE (date) FROM rounds ORDER BY round")
    tasks_re = None
    for r in rounds:
        man = manifest_of(reader, r["round"], r["checkpoint_path"])
        settings = man.get("settings") or {}
        r["settings"], r["git_sha"] = settings, man.get("git_sha")
        # the estimator the round used (``--estimator auto`` resolved); rounds from before the column: its setting
        r["estimator"] = r.get("estimator") or settings.get("estimator", "grpo")
        r["seconds"] = sum(json.loads(r["timings"] or "{}").values())
        r["settings_json"] = json.dumps(settings, indent=1, sort_keys=True) if settings else ""
        # the canary decision and its numbers (tracerl promote), null for rounds published without one
        r["canary_info"] = json.loads(r["canary"]) if r.get("canary") else None
        tasks_re = tasks_re or settings.get("tasks")
    ks = tuple(r["round"] for r in rounds)
    stale = reader.memo(f"staleness{ks}", lambda: staleness(reader, ks))
    for r in rounds:
        r["staleness"] = stale.get(r["round"], {}).get("mean_staleness")
        r["max_staleness"] = stale.get(r["round"], {}).get("max_staleness")
    heldout = reader.rows(HELDOUT_SQL, {"re": tasks_re}) if tasks_re else []

    def pts(key: str) -> list[tuple[float, float | None]]:
        return [(r["round"], r[key]) for r in rounds]

    reward = [Series("mean reward (trained rollouts)", pts("mean_reward"), "s0")]
    if heldout:
        reward += [Series("held-out success", [(h["version"], h["success"]) for h in heldout], "s1"),
                   Series("held-out mean reward", [(h["version"], h["mean_reward"]) for h in heldout], "s2")]
    charts = [
        line_chart("Reward", reward),
        line_chart("Loss", [Series("loss", pts("loss"))]),
        line_chart("KL to reference", [Series("KL", pts("kl"))]),
        line_chart("Clip fraction", [Series("clip fraction", pts("clip_fraction"))]),
        line_chart("Staleness (versions behind)", [Series("mean", pts("staleness")),
                                                   Series("max", pts("max_staleness"), "s1")]),
    ]
    return {"rounds": rounds, "charts": charts, "heldout": heldout, "tasks_re": tasks_re}


STALENESS_SQL = """
WITH sel AS (SELECT unnest($rounds) AS round, unnest($ids) AS rollout_id)
SELECT round, avg(round - version) AS mean_staleness, max(round - version) AS max_staleness
FROM sel JOIN ui_rollouts USING (rollout_id) GROUP BY round
"""
"""How many versions behind the trained policy each round's rollouts were (0: on-policy)."""

HELDOUT_SQL = """
SELECT version, count(*) AS n, avg(reward) AS mean_reward, avg(CASE WHEN reward >= 1 THEN 1.0 ELSE 0.0 END) AS success
FROM ui_rollouts WHERE NOT regexp_matches(coalesce(task_id, ''), $re) AND reward IS NOT NULL
GROUP BY 1 ORDER BY 1
"""
"""Rollouts of tasks the trainer's ``--tasks`` regex leaves out (never trained on), per version;
success is the share with reward ≥ 1 (the demo's gold result)."""


# -- rollouts ----------------------------------------------------------------------------------------


def rollouts_data(reader: StoreReader, q: RolloutQuery) -> dict[str, Any]:
    sql, params = rollouts_sql(q)
    rows = reader.rows(sql, params)
    totals = {k: rows[0][k] if rows else 0 for k in ("total", "no_reward", "inexact_tokens", "no_agent", "untrainable")}
    page = [r for r in rows if r["rollout_id"] is not None]
    pages = max(1, -(-totals["total"] // q.page_size))
    return {"rows": page, "totals": totals, "q": q, "pages": pages}


# -- advantages --------------------------------------------------------------------------------------

GROUP_SQL = """
SELECT rollout_id, task_id, version, reward_used, complete, n_calls, started_at, last_response, agents
FROM ui_rollouts WHERE task_id = $task ORDER BY version, started_at, rollout_id
"""
"""A task's rollouts as the trainer's dataset sees them (``trainer/dataset.py`` TRANSITIONS_SQL: the
reward used is the rollout reward, else the sum of the calls' rewards; complete = it has a last call)."""


def estimators(reader: StoreReader) -> dict[int, str]:
    """Policy version -> the estimator of the round that trained on it (the manifest's ``estimator``;
    for rounds written before that column, its checkpoint's settings); kept per store version (it reads
    every round's checkpoint manifest)."""

    def read() -> dict[int, str]:
        out = {}
        for r in reader.rows("SELECT round, policy_version, checkpoint_path, estimator FROM rounds"):
            settings = manifest_of(reader, r["round"], r["checkpoint_path"]).get("settings") or {}
            out[int(r["policy_version"] or 0)] = str(r["estimator"] or settings.get("estimator", "grpo"))
        return out

    return reader.memo("estimators", read)


BATCH_SQL = """
SELECT rollout_id, task_id, version, reward_used, complete, agents FROM ui_rollouts WHERE version = $version
"""
"""A version's whole batch: what a group-free estimator normalises over (each agent's part of it)."""


def version_batch(reader: StoreReader) -> Any:
    """``version -> its rollouts`` for ``with_advantages``, each version read once per store version."""
    return lambda v: reader.memo(f"batch:{v}", lambda: reader.rows(BATCH_SQL, {"version": v}))


def _usable(rows: Sequence[dict[str, Any]]) -> list[RolloutReward]:
    return [RolloutReward(r["rollout_id"], r["task_id"] or r["rollout_id"], float(r["reward_used"]),
                          (r.get("agents") or [""])[0] or "")
            for r in rows if r["complete"] and r["reward_used"] is not None]


def with_advantages(rows: Sequence[dict[str, Any]], estimator_of: dict[int, str],
                    batch_of: Any = None) -> None:
    """Set ``advantage`` (None: the estimator dropped it) on each rollout row, per (task, version) group,
    with ``trainer.advantages.rollout_advantages``: zero-variance and single-rollout groups get none.
    Under a group-free estimator the advantage comes from the version's batch (``batch_of(version)``)."""
    by_version: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_version.setdefault(r["version"], []).append(r)
    for version, group in by_version.items():
        est = estimator_of.get(version, "grpo")
        free = est in GROUP_FREE and batch_of is not None
        adv = rollout_advantages(_usable(batch_of(version) if free else group), est).advantages
        for r in group:
            r["advantage"], r["estimator"] = adv.get(r["rollout_id"]), est


GROUP_JUDGED_SQL = """
SELECT rollout_id, name, value, explanation FROM rewards
WHERE source = 'judge' AND rollout_id IN (SELECT rollout_id FROM ui_rollouts WHERE task_id = $task)
ORDER BY rollout_id, "at", name
"""
"""The judge's rows for a task's rollouts (``tracerl judge``): each card shows the judge's score and reason."""


def group_data(reader: StoreReader, task_id: str) -> dict[str, Any]:
    rows = reader.rows(GROUP_SQL, {"task": task_id})
    with_advantages(rows, estimators(reader), version_batch(reader))
    judged: dict[str, list[dict[str, Any]]] = {}
    for j in reader.rows(GROUP_JUDGED_SQL, {"task": task_id}):
        judged.setdefault(j["rollout_id"], []).append(j)
    versions: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        last = msg.load(r["last_response"], None)
        r["answer"] = msg.message_view(last).text if last is not None else ""
        r["judged"] = judged.get(r["rollout_id"], [])
        versions.setdefault(r["version"], []).append(r)
    summary = []
    for v, group in versions.items():
        rewards = [r["reward_used"] for r in group if r["reward_used"] is not None]
        summary.append({"version": v, "n": len(group), "estimator": group[0]["estimator"],
                        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                        "dropped": all(r["advantage"] is None for r in group)})
    return {"task_id": task_id, "versions": versions, "summary": summary}


# -- one rollout -------------------------------------------------------------------------------------

CALLS_SQL = f"""
SELECT transition_id, step, agent_name, trainable, model, policy_version, prompt_messages, tools,
       response_message, finish_reason, response_token_ids, response_logprobs,
       len(prompt_token_ids) AS n_prompt_tokens, token_source, reward, rollout_reward, reward_source, is_last,
       started_at, ended_at, span_id, trace_id, input_tokens, output_tokens
FROM _transitions_data WHERE rollout_id = $id {LATEST_ONLY["transitions"]}
ORDER BY step, transition_id
"""
"""One rollout's calls: the ``transitions`` view's own rows and rule (``schemas.views.LATEST_ONLY``: the
latest conversion of the rollout), with the rollout filter applied *before* the rule's window, which
DuckDB does not push it through; the window is per rollout, so the rows are the same. On a 1M-call
store this reads one file instead of windowing every row (bench/ui.py)."""
SPANS_SQL = f"""
SELECT span_id, parent_span_id, name, start_time_ns, end_time_ns, status_code, status_message,
       map_from_entries(list_filter(map_entries(attributes), lambda e: e.key IN
           ('gen_ai.operation.name', 'gen_ai.tool.name', 'gen_ai.agent.name', '{GATEWAY_FLAG}'))) AS attributes
FROM spans WHERE rollout_id = $id OR trace_id IN (SELECT unnest($traces::VARCHAR[]))
ORDER BY start_time_ns
"""


def credit_note(strategy: str | None) -> str:
    """How the converter shared the rollout's reward among its calls (the strategy's own docstring)."""
    fn = CREDIT.get(strategy or "identical")
    doc = (fn.__doc__ or "").strip().splitlines()[0] if fn else ""
    return f"{strategy or 'identical'}: {doc}" if doc else str(strategy)


def tokenizer_dir(reader: StoreReader, override: str | None) -> str | None:
    """``--tokenizer``, else the base model of the newest round (its tokenizer decodes every version)."""
    if override:
        return override
    rows = reader.rows("SELECT base_model FROM rounds WHERE base_model IS NOT NULL ORDER BY round DESC LIMIT 1")
    return rows[0]["base_model"] if rows else None


JUDGED_SQL = """
SELECT name, value, judge_model, rubric_hash, explanation FROM rewards
WHERE source = 'judge' AND rollout_id = $id ORDER BY "at", name
"""
"""The judge's rows for one rollout (``tracerl judge``): shown beside its reward, with the judge's reason."""


def rollout_data(reader: StoreReader, rollout_id: str, tokenizer: str | None = None) -> dict[str, Any] | None:
    head = reader.rows("SELECT * EXCLUDE (last_response) FROM ui_rollouts WHERE rollout_id = $id", {"id": rollout_id})
    if not head:
        return None
    rollout = head[0]
    calls = reader.rows(CALLS_SQL, {"id": rollout_id})
    traces = sorted({c["trace_id"] for c in calls if c["trace_id"]})
    spans = reader.rows(SPANS_SQL, {"id": rollout_id, "traces": traces})
    rows = layout(spans, {c["span_id"]: c["transition_id"] for c in calls if c["span_id"]})
    total_ms = max((r.start_ms + r.duration_ms for r in rows), default=0.0)
    group = reader.rows(GROUP_SQL, {"task": rollout["task_id"]}) if rollout["task_id"] else []
    with_advantages(group, estimators(reader), version_batch(reader))
    mine = next((g for g in group if g["rollout_id"] == rollout_id), {})
    advantage = mine.get("advantage")
    decode = load_decoder(reader.memo(f"tokenizer:{tokenizer}", lambda: tokenizer_dir(reader, tokenizer)))
    # the converter's ledger lists every converted rollout (large on a large store): read once per version
    settings = reader.memo("convert-settings", lambda: Ledger.load(reader.loc).settings)
    for c in calls:
        c["messages"] = msg.messages(c["prompt_messages"])
        c["tool_names"] = msg.tool_names(c["tools"])
        c["response"] = msg.message_view(msg.load(c["response_message"], {"role": "assistant",
                                                                          "content": c["response_message"]}))
        c["tokens"] = token_views(c["response_token_ids"], c["response_logprobs"], advantage, decode)
        c["why_not_gateway"] = WHY_NOT_GATEWAY.get(c["token_source"] or "", "")
    return {
        "rollout": rollout,
        "calls": calls,
        "timeline": rows,
        "ticks": ticks(total_ms),
        "total_ms": total_ms,
        "advantage": advantage,
        "estimator": mine.get("estimator", "grpo"),
        "group_size": sum(1 for g in group if g["version"] == mine.get("version")),
        "group_free": mine.get("estimator") in GROUP_FREE,
        "credit": credit_note(str(settings.get("credit")) if settings.get("credit") else None),
        "decoded": decode is not None,
        "judged": reader.rows(JUDGED_SQL, {"id": rollout_id}),
    }


# -- doctor and quarantine ---------------------------------------------------------------------------


def quarantined(reader: StoreReader, limit: int = 200) -> list[dict[str, Any]]:
    """The newest quarantined records (what the collector could not turn into rows), without payloads;
    listed by ``collector_exporter.quarantine`` (what ``tracerl status`` counts), on disk or in a bucket."""
    out: list[dict[str, Any]] = []
    for name, item in quarantine_records(reader.loc):
        out.append({"file": name, "table": item.get("table"), "reason": item.get("reason"),
                    "received_at_ns": item.get("received_at_ns"), "bytes": len(item.get("payload_b64", "")) * 3 // 4})
        if len(out) >= limit:
            break
    return out


def doctor_data(reader: StoreReader) -> dict[str, Any]:
    from span_to_transition.survey import gather

    findings = diagnose(gather(reader.loc))
    return {"findings": findings, "quarantine": quarantined(reader),
            "excluded": sorted(Ledger.load(reader.loc).excluded)[:200]}
