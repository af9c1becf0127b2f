"""``loop.watch.round_complete``: when a round's spans, rewards and gateway spans are all stored."""

from __future__ import annotations

import time

from loop.watch import new_data_sleep, round_complete, wait_for_change
from store.location import StoreLocation, parse_store


def _status(roots: int = 4, rewards: int = 4, calls: int = 8, gateway_spans: int = 8) -> dict[str, int]:
    return {
        "roots": roots,
        "traces": roots,
        "calls": calls,
        "gateway_spans": gateway_spans,
        "rewards": rewards,
        "converted": 0,
    }


def test_a_round_is_complete_with_every_root_reward_and_a_gateway_span_per_call():
    assert round_complete(_status(), rollouts=4, rewarded=4)


def test_a_missing_root_reward_or_gateway_span_keeps_the_loop_waiting():
    assert not round_complete(_status(roots=3), rollouts=4, rewarded=4)
    assert not round_complete(_status(rewards=3), rollouts=4, rewarded=4)
    assert not round_complete(_status(gateway_spans=7), rollouts=4, rewarded=4)


def test_a_round_with_no_llm_call_stored_yet_is_not_complete():
    # the agents' own spans may arrive before their LLM-call spans: zero calls is not "all calls"
    assert not round_complete(_status(calls=0, gateway_spans=0), rollouts=4, rewarded=4)


def test_rewards_are_counted_against_those_posted_not_the_rollouts():
    assert round_complete(_status(rewards=3), rollouts=4, rewarded=3)  # one reward could not be computed


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_the_watch_wait_ends_at_the_first_look_that_sees_new_data():
    clock = _Clock()
    answers = iter(["a", "a", "a", "b"])
    assert wait_for_change(lambda: next(answers), 10.0, tick_s=0.5, sleep=clock.sleep, clock=clock)
    assert clock.t == 1.5  # three ticks: the third look saw "b"


def test_the_watch_wait_without_new_data_lasts_the_whole_poll():
    clock = _Clock()
    assert not wait_for_change(lambda: "same", 2.2, tick_s=0.5, sleep=clock.sleep, clock=clock)
    assert clock.t == 2.2  # the last tick is cut to the poll's end


def test_on_a_local_store_a_new_transitions_file_wakes_the_trainer(tmp_path):
    """Real files: a conversion's Parquet file written 0.3 s into a 30 s wait ends the wait."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    loc = parse_store(tmp_path / "store")
    part = tmp_path / "store" / "transitions" / "date=2026-11-27"
    part.mkdir(parents=True)
    pq.write_table(pa.table({"transition_id": ["t0"]}), part / "a.parquet")

    def convert() -> None:
        pq.write_table(pa.table({"transition_id": ["t1"]}), part / "b.parquet")

    timer = threading.Timer(0.3, convert)
    timer.start()
    t0 = time.monotonic()
    new_data_sleep(loc)(30.0)
    timer.join()
    assert time.monotonic() - t0 < 10.0


def test_on_object_storage_the_watch_sleeps_plainly():
    from pyarrow import fs

    remote = StoreLocation(
        fs.SubTreeFileSystem("/tmp", fs.LocalFileSystem()), "bucket/prefix", "s3://bucket/prefix"
    )
    assert new_data_sleep(remote) is time.sleep


def test_a_look_since_the_batch_started_reads_only_the_files_stored_from_then_on(tmp_path):
    """``round_status(..., since)``: a file written before the batch started cannot hold its rows, so it is
    not read (a look over every file of a growing store took longer each round)."""
    import os

    import pyarrow as pa

    from loop.watch import round_status
    from schemas.tables import TRANSITIONS_SCHEMA
    from store.layout import StoreLayout
    from store.parquet import write_table_atomic

    layout = StoreLayout.at(tmp_path)

    def stored(name: str, rollout_id: str, at: float) -> None:
        table = pa.Table.from_pylist([{"rollout_id": rollout_id, "transition_id": name}], schema=TRANSITIONS_SCHEMA)
        path = write_table_atomic(table, layout.partition("transitions", "2026-11-28") / f"{name}.parquet", "transitions")
        os.utime(path, (at, at))

    now = time.time()
    stored("old", "r-old", now - 3600)
    stored("new", "r-new", now)
    loc = parse_store(tmp_path)
    assert loc.files("transitions", since=now - 60) == [str(layout.partition("transitions", "2026-11-28") / "new.parquet")]
    assert len(loc.files("transitions")) == 2
    assert round_status(loc, ["r-old", "r-new"])["converted"] == 2
    assert round_status(loc, ["r-old", "r-new"], since=now - 60)["converted"] == 1
