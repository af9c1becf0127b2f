"""The SQL of the store's views: what users see in the README, `tracerl sql` and the trainer alike.

Plain text only; the connections that run it over a store's files are ``store/views.py``.
"""

from __future__ import annotations

# Derived views, defined over the base table views; stages add theirs here so that the SQL
# users see in the README, `tracerl sql` and the trainer are the same text.
DERIVED_VIEWS: dict[str, str] = {
    # span_to_transition: one row per converted rollout (see span_to_transition/README.md).
    "rollouts": """
        SELECT rollout_id,
               any_value(task_id) AS task_id,
               max(rollout_reward) AS reward,
               any_value(reward_source) AS reward_source,
               count(*) AS n_calls,
               count(*) FILTER (WHERE trainable) AS n_trainable,
               list_sort(list_distinct(list(agent_name) FILTER (WHERE agent_name IS NOT NULL))) AS agents,
               min(policy_version) AS policy_version,
               max(policy_version) AS max_policy_version,
               avg(CASE WHEN token_source IN ('gateway', 'span') THEN 1.0 ELSE 0.0 END) AS token_coverage,
               min(started_at) AS started_at,
               max(ended_at) AS ended_at
        FROM transitions
        GROUP BY rollout_id
    """,
}


LATEST_ONLY: dict[str, str] = {
    # span_to_transition: a rollout converted again (a late reward, --rebuild) keeps its older rows in
    # older files until they are compacted; only its latest conversion is visible
    "transitions": "QUALIFY conversion IS NOT DISTINCT FROM max(conversion) OVER (PARTITION BY rollout_id)",
}
"""Base tables whose rows can be superseded, and the clause that hides the superseded ones."""
