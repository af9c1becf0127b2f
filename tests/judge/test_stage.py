"""``tracerl judge`` on a real store (Parquet, DuckDB views, the converter) with a scripted judge on
127.0.0.1: rows written, trained through the converter, idempotent; fallbacks, retries, failures, outage.
The real judge (vLLM serving SmolLM2) is tests/judge/test_real_judge.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from tracerl_testing import free_port

from judge.config import JudgeSettings, UsageError
from judge.doctor import judge_findings, judge_states
from judge.prompts import default_rubric, rubric_hash
from judge.rows import reward_id
from judge.stage import load_state, run_once
from schemas.tables import REWARDS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.lease import JUDGE_LOCK, hold
from store.location import parse_store
from store.parquet import write_table_atomic
from store.views import connect_readonly

from .helpers import DRAFTS
from .store_rig import LATER, answer, good_judge, grade, make_store, scripted_judge, user_prompt


def settings(store: Path, url: str, **kw) -> JudgeSettings:
    return JudgeSettings(store=str(store), judge_url=url, judge_model="judge-model", group_wait_s=0, **kw)


def rewards(store: Path) -> list[dict]:
    con = connect_readonly(parse_store(store))
    rows = (
        con.sql('SELECT * EXCLUDE (date, "at") FROM rewards ORDER BY rollout_id').to_arrow_table().to_pylist()
    )
    con.close()
    return rows


def test_a_group_pass_writes_judge_rows_that_the_converter_trains_and_a_second_pass_judges_nothing(tmp_path):
    drafts = make_store(tmp_path)
    with scripted_judge(good_judge) as (url, seen):
        stats = run_once(settings(tmp_path, url))
        assert (stats.requests, stats.groups_scored, stats.rows_written, stats.calls) == (2, 2, 6, 2)
        assert len(seen) == 2  # one call per task group, each with its 3 trajectories
        assert all(
            len(
                json.loads(json.dumps(b["response_format"]))["json_schema"]["schema"]["properties"]["scores"][
                    "required"
                ]
            )
            == 3
            for b in seen
        )
        again = run_once(settings(tmp_path, url))
        assert (again.candidates, again.requests, again.rows_written, len(seen)) == (0, 0, 0, 2)

    rows = rewards(tmp_path)
    h = rubric_hash(default_rubric(), "group", "judge-model")
    assert (
        len(rows) == 6 and {r["source"] for r in rows} == {"judge"} and {r["name"] for r in rows} == {"judge"}
    )
    for r in rows:
        right = drafts[r["rollout_id"]] == DRAFTS[0]
        assert r["value"] == (1.0 if right else 0.1)
        assert r["explanation"] == ("counts Madrid" if right else "wrong query")
        assert (r["judge_model"], r["rubric_hash"]) == ("judge-model", h)
        assert r["reward_id"] == reward_id(r["rollout_id"], "judge", h)
    assert sum(r["judge_prompt_tokens"] for r in rows) == 200  # each call's 100 tokens split over its group
    assert sum(r["judge_completion_tokens"] for r in rows) == 40

    # the converter converts the judged rollouts again, with the judge's reward
    before = (
        connect_readonly(parse_store(tmp_path))
        .execute("SELECT count(*) FROM transitions WHERE reward IS NULL")
        .fetchone()
    )
    assert before == (12,)
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="keep", workers=1), now_ns=LATER)
    assert stats.rollouts_reconverted == 6
    con = connect_readonly(parse_store(tmp_path))
    got = con.execute(
        "SELECT rollout_id, any_value(rollout_reward), any_value(reward_source), count(*) "
        "FROM transitions GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert [(r, v, s, n) for r, v, s, n in got] == [
        (r, 1.0 if drafts[r] == DRAFTS[0] else 0.1, "judge", 2) for r in sorted(drafts)
    ]


def test_pointwise_asks_once_per_rollout_with_the_whole_trajectory(tmp_path):
    make_store(tmp_path, tasks=1, per_task=3)
    with scripted_judge(good_judge) as (url, seen):
        stats = run_once(settings(tmp_path, url, mode="pointwise"))
    assert (stats.requests, stats.rows_written, len(seen)) == (3, 3, 3)
    assert all(
        "<shared>" not in user_prompt(b) and "[system] You write SQLite" in user_prompt(b) for b in seen
    )
    assert {r["rubric_hash"] for r in rewards(tmp_path)} == {
        rubric_hash(default_rubric(), "pointwise", "judge-model")
    }


def test_an_endpoint_that_refuses_response_format_is_asked_in_plain_text(tmp_path):
    make_store(tmp_path, tasks=1)

    def no_schema(body, n):
        if "response_format" in body:
            return 400, {"error": {"message": "response_format json_schema is not supported"}}
        return 200, answer("Here you go:\n```json\n" + json.dumps(grade(user_prompt(body))) + "\n```")

    with scripted_judge(no_schema) as (url, seen):
        stats = run_once(settings(tmp_path, url))
    assert (stats.structured_fallbacks, stats.rows_written, len(seen)) == (1, 3, 2)
    assert "refused response_format" in stats.summary()


def test_a_bad_answer_is_retried_once_quoting_the_error_then_the_group_fails_and_is_not_paid_again(tmp_path):
    make_store(tmp_path, tasks=1)
    with scripted_judge(
        lambda body, n: (200, answer('{"scores": {"1": {"explanation": "ok", "score": 0.9}}}'))
    ) as (url, seen):
        stats = run_once(settings(tmp_path, url))
        assert (stats.calls, stats.rows_written, stats.failures) == (2, 0, {"missing_ids": 1})
        retry = seen[1]["messages"]
        assert (
            retry[-2]["role"] == "assistant"
            and "no score for trajectories ['2', '3']" in retry[-1]["content"]
        )
        state = load_state(parse_store(str(tmp_path)), "judge")
        assert state["failures"] == {"missing_ids": 1} and len(next(iter(state["failed"].values()))) == 3

        later = run_once(settings(tmp_path, url))  # the failed group is not asked again
        assert (later.candidates, later.skipped_failed, later.requests, len(seen)) == (3, 3, 0, 2)
        assert run_once(settings(tmp_path, url, retry_failed=True)).requests == 1
    assert rewards(tmp_path) == []

    with scripted_judge(good_judge) as (url, _):  # a fixed judge, asked with --retry-failed, scores them
        assert run_once(settings(tmp_path, url, retry_failed=True)).rows_written == 3


def test_a_judge_outage_writes_nothing_and_leaves_the_rollouts_waiting(tmp_path):
    make_store(tmp_path)
    closed = f"http://127.0.0.1:{free_port()}/v1"
    stats = run_once(settings(tmp_path, closed))
    assert (stats.rows_written, stats.unavailable, stats.rollouts_waiting_for_judge) == (
        0,
        {"unreachable": 2},
        6,
    )
    assert "wait for the next pass" in stats.summary()
    assert rewards(tmp_path) == [] and load_state(parse_store(str(tmp_path)), "judge")["failed"] == {}

    with scripted_judge(lambda body, n: (503, {"error": {"message": "overloaded"}})) as (url, _):
        busy = run_once(settings(tmp_path, url))
    assert (busy.unavailable, busy.rows_written) == ({"http_503": 2}, 0)

    with scripted_judge(good_judge) as (url, _):  # back up: every waiting rollout is judged
        assert run_once(settings(tmp_path, url)).rows_written == 6


def test_a_task_still_growing_waits_and_a_held_lock_skips_the_pass(tmp_path):
    make_store(tmp_path, tasks=1)
    with scripted_judge(good_judge) as (url, seen):
        s = settings(tmp_path, url)
        s.group_wait_s = 10**12  # the rollouts "ended" at their fixture time, far less than this ago
        waiting = run_once(s)
        assert (waiting.waiting, waiting.requests) == (3, 0)
        with hold(parse_store(str(tmp_path)), JUDGE_LOCK):
            assert run_once(settings(tmp_path, url)).locked
        assert seen == []


def test_settings_errors_name_the_fix(tmp_path):
    with pytest.raises(UsageError, match="--judge-model is required"):
        JudgeSettings(store=str(tmp_path)).validate()
    with pytest.raises(UsageError, match="http:// or https://"):
        JudgeSettings(store=str(tmp_path), judge_model="m", judge_url="localhost:8000").validate()
    with pytest.raises(UsageError, match="no such file"):
        JudgeSettings(store=str(tmp_path), judge_model="m", rubric=str(tmp_path / "nope.md")).validate()


def test_doctor_names_the_failed_judge_groups_and_the_fix(tmp_path):
    make_store(tmp_path, tasks=1)
    with scripted_judge(lambda body, n: (200, answer("Trajectory 1 is the best."))) as (url, _):
        assert run_once(settings(tmp_path, url)).failures == {"no_json": 1}
    [(problem, saw, _, fix)] = judge_findings(judge_states(parse_store(tmp_path)))
    assert "judge answers that could not be used" in problem and "no_json 1" in saw
    assert "3 rollouts are not asked about again" in saw and "--retry-failed" in fix
    assert judge_findings({"judge": {"failed": {}, "failures": {}}}) == []  # no failures: nothing to say


@pytest.mark.parametrize("concurrency", [1, 3])
def test_requests_in_flight_never_exceed_the_concurrency(tmp_path, concurrency):
    import threading
    import time

    make_store(tmp_path, tasks=3, per_task=2)
    lock, now, peak = threading.Lock(), [0], [0]

    def slow(body, n):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.3)
        with lock:
            now[0] -= 1
        return good_judge(body, n)

    with scripted_judge(slow) as (url, seen):
        stats = run_once(settings(tmp_path, url, judge_concurrency=concurrency))
    assert (stats.requests, stats.rows_written, len(seen)) == (3, 6, 3)
    assert peak[0] == concurrency  # 3 groups: one at a time, or all three at once


@pytest.mark.slow  # starts moto's S3 server
def test_a_bucket_store_is_judged_like_a_local_one(s3_store):
    drafts = make_store(s3_store, tasks=1, per_task=3)
    with scripted_judge(good_judge) as (url, seen):
        stats = run_once(settings(s3_store, url))
        assert (stats.rows_written, run_once(settings(s3_store, url)).requests, len(seen)) == (3, 0, 1)
    con = connect_readonly(parse_store(s3_store))
    got = dict(con.execute("SELECT rollout_id, value FROM rewards WHERE source = 'judge'").fetchall())
    assert got == {r: 1.0 if d == DRAFTS[0] else 0.1 for r, d in drafts.items()}


def test_a_request_refused_both_ways_fails_its_group_without_giving_up_structured_output(tmp_path):
    make_store(tmp_path, tasks=1)
    with scripted_judge(
        lambda body, n: (400, {"error": {"message": "maximum context length is 2048 tokens"}})
    ) as (
        url,
        seen,
    ):
        stats = run_once(settings(tmp_path, url))
    assert (stats.failures, stats.structured_fallbacks, stats.rows_written, len(seen)) == (
        {"rejected": 1},
        0,
        0,
        2,
    )
    assert "response_format" in seen[0] and "response_format" not in seen[1]
    [failed] = load_state(parse_store(str(tmp_path)), "judge")["failed"].values()
    assert all("maximum context length" in why for why in failed.values()) and len(failed) == 3


def test_the_api_key_comes_from_the_environment(tmp_path, monkeypatch):
    make_store(tmp_path, tasks=1)
    monkeypatch.delenv("TRACERL_JUDGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with scripted_judge(good_judge, token="sk-judge") as (url, _):
        refused = run_once(settings(tmp_path, url))
        assert (refused.unavailable, refused.rows_written) == ({"http_401": 1}, 0)  # waits: a config problem
        monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
        monkeypatch.setenv("TRACERL_JUDGE_API_KEY", "sk-judge")  # the judge's own key wins
        assert run_once(settings(tmp_path, url)).rows_written == 3


def test_a_reward_of_the_judges_name_keyed_by_trace_id_counts_as_judged(tmp_path):
    drafts = make_store(tmp_path, tasks=1)
    first = sorted(drafts)[0]  # the rig's rollout id is its trace id
    row = {
        "reward_id": "by-trace",
        "trace_id": first,
        "name": "judge",
        "value": 0.5,
        "source": "side_channel",
    }
    write_table_atomic(
        pa.Table.from_pylist([row], schema=REWARDS_SCHEMA),
        StoreLayout.at(tmp_path).partition("rewards", "2026-11-27") / "part-x.parquet",
        "rewards",
    )
    with scripted_judge(good_judge) as (url, seen):
        stats = run_once(settings(tmp_path, url))
    assert (stats.candidates, stats.rows_written) == (2, 2)
    assert len(seen) == 1 and len(user_prompt(seen[0]).split("<trajectory id=")) == 3  # the other two only
    assert {r["rollout_id"] for r in rewards(tmp_path) if r["source"] == "judge"} == set(drafts) - {first}


def test_unrewarded_only_leaves_rollouts_a_grader_rewarded_alone(tmp_path):
    drafts = make_store(tmp_path, tasks=1, per_task=3)
    graded = sorted(drafts)[0]
    row = {"reward_id": "g", "rollout_id": graded, "name": "reward", "value": 1.0, "source": "side_channel"}
    write_table_atomic(
        pa.Table.from_pylist([row], schema=REWARDS_SCHEMA),
        StoreLayout.at(tmp_path).partition("rewards", "2026-11-27") / "part-g.parquet",
        "rewards",
    )
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="keep", workers=1), now_ns=LATER)
    with scripted_judge(good_judge) as (url, _):
        only = run_once(settings(tmp_path, url, unrewarded_only=True))
        assert (only.candidates, only.rows_written) == (2, 2)
        assert {r["rollout_id"] for r in rewards(tmp_path) if r["source"] == "judge"} == set(drafts) - {
            graded
        }
        every = run_once(settings(tmp_path, url))  # by default: every rollout without a judge reward
        assert (every.candidates, every.rows_written) == (1, 1)
