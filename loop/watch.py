"""What the store holds of a round right now: the loop's view of its stages' output, by SQL.

The rollout driver returns once its agents exited, but their spans travel on (agent -> collector WAL
-> Parquet) and the gateway's spans on their own path; a round is complete only when the store
shows all of them. These queries read the store's views; they never parse a span.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from schemas.attributes import GATEWAY_FLAG

if TYPE_CHECKING:
    from store.location import StoreLocation

POLL_S = 0.1  # between two looks at the store while a round's spans arrive
WAKE_TICK_S = 0.5  # `train --watch` on a local store: between two listings of transitions/ while it waits


def round_status(store: StoreLocation, rollout_ids: list[str], since: float | None = None) -> dict[str, int]:
    """How much of a round's rollouts the store holds right now (spans and rewards are Parquet); ``since``
    (epoch seconds, before the round's first agent started): only the files stored from then on are read."""
    from store.views import connect_readonly

    con = connect_readonly(store, since)
    try:
        con.execute("CREATE TEMP TABLE ids AS SELECT unnest(?::VARCHAR[]) AS rollout_id", [rollout_ids])
        roots, traces = con.execute("""
            SELECT count(DISTINCT s.rollout_id) FILTER (WHERE s.parent_span_id IS NULL OR s.parent_span_id = ''),
                   count(DISTINCT s.trace_id)
            FROM spans s JOIN ids USING (rollout_id)""").fetchone()
        calls, gateway = con.execute(f"""
            WITH t AS (SELECT DISTINCT trace_id FROM spans JOIN ids USING (rollout_id))
            SELECT count(*) FILTER (WHERE coalesce(s.attributes['{GATEWAY_FLAG}'], '') <> 'true'
                                      AND coalesce(s.attributes['gen_ai.system'],
                                                   s.attributes['gen_ai.provider.name']) IS NOT NULL),
                   count(*) FILTER (WHERE s.attributes['{GATEWAY_FLAG}'] = 'true')
            FROM spans s JOIN t USING (trace_id)""").fetchone()
        rewards = con.execute(
            "SELECT count(DISTINCT r.rollout_id) FROM rewards r JOIN ids USING (rollout_id)"
        ).fetchone()[0]
        converted = con.execute(
            "SELECT count(DISTINCT t.rollout_id) FROM transitions t JOIN ids USING (rollout_id)"
        ).fetchone()[0]
    finally:
        con.close()
    return {
        "roots": roots,
        "traces": traces,
        "calls": calls,
        "gateway_spans": gateway,
        "rewards": rewards,
        "converted": converted,
    }


def round_complete(status: dict[str, int], rollouts: int, rewarded: int) -> bool:
    """Every rollout's root span and reward are stored, and a gateway span for each of its LLM calls."""
    return (
        status["roots"] >= rollouts
        and status["rewards"] >= rewarded
        and status["calls"] > 0
        and status["gateway_spans"] >= status["calls"]
    )


def wait_for_round(
    store: StoreLocation,
    rollout_ids: list[str],
    rewarded: int,
    timeout_s: float,
    alive: Callable[[], None],
    since: float | None = None,
) -> dict[str, int]:
    """Until every rollout's root span and reward, and a gateway span per LLM call, are queryable.

    ``alive()`` is called before each look: it raises when a process the round needs has died, so a
    dead collector is reported as such instead of as a timeout. ``since``: as ``round_status``'s."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive()
        st = round_status(store, rollout_ids, since)
        if round_complete(st, len(rollout_ids), rewarded):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the round's spans did not all reach the store within {timeout_s:.0f}s "
                f"(--wait-s): {len(rollout_ids)} rollouts, {st['roots']} root spans, {rewarded} "
                f"rewards posted / {st['rewards']} stored, {st['calls']} LLM calls / "
                f"{st['gateway_spans']} gateway spans; see the collector and gateway logs"
            )
        time.sleep(POLL_S)


def store_rewards(store: StoreLocation, rollout_ids: list[str]) -> dict[str, float]:
    """The reward the collector stored for each of these rollouts (the last value per rollout): the grader's,
    never a judge's (``source = judge``), so an evaluation stays graded by the grader whoever trains."""
    from store.views import connect_readonly

    con = connect_readonly(store)
    try:
        rows = con.execute(
            """SELECT rollout_id, arg_max(value, "at") FROM rewards
               WHERE rollout_id IN (SELECT unnest(?::VARCHAR[])) AND coalesce(source, '') <> 'judge'
               GROUP BY rollout_id""",
            [rollout_ids],
        ).fetchall()
    finally:
        con.close()
    return dict(rows)


def store_answers(
    store: StoreLocation, rollout_ids: list[str], attribute: str = "demo.answer"
) -> dict[str, str]:
    """Each rollout's answer, as its agent recorded it on a span (the SQL agent's final query)."""
    from store.views import connect_readonly

    con = connect_readonly(store)
    try:
        rows = con.execute(
            """SELECT rollout_id, any_value(attributes[?]) FROM spans
               WHERE attributes[?] IS NOT NULL AND rollout_id IN (SELECT unnest(?::VARCHAR[]))
               GROUP BY rollout_id""",
            [attribute, attribute, rollout_ids],
        ).fetchall()
    finally:
        con.close()
    return dict(rows)


def wait_for_change(
    probe: Callable[[], object],
    timeout_s: float,
    tick_s: float = WAKE_TICK_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Sleep up to ``timeout_s``; return True as soon as ``probe()`` answers other than it did first.

    ``train --watch`` slept its whole ``--poll-s`` (10 s) after a poll that found too little to train,
    even when the rollouts it waited for were converted a moment later: the trainer idled while data
    was ready. With this the wait ends at the first listing that shows the new data."""
    deadline = clock() + timeout_s
    first = probe()
    while True:
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(tick_s, left))
        if probe() != first:
            return True


def new_data_sleep(store: StoreLocation) -> Callable[[float], None]:
    """The ``sleep`` of ``trainer.rounds.watch``: on a local store, a wait that ends when a conversion
    adds a file to ``transitions/`` (every flush has its own name); on object storage the plain
    sleep, since listing a bucket every half second costs a request each time."""
    if not store.is_local:
        return time.sleep

    def wait(seconds: float) -> None:
        wait_for_change(lambda: store.files("transitions"), seconds)

    return wait
