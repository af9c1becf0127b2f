"""The driver's pure logic, without processes: task parsing, env construction, retry policy, summary."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import pytest

from options import UsageError
from rollout.agent_env import agent_argv, agent_env, merge_resource_attributes, parse_resource_attributes
from rollout.driver import Driver, should_retry, validate
from rollout.records import RolloutRecord, format_summary, summarize
from rollout.rewards import compute_reward, post_reward, reward_post_delays
from rollout.tasks import Task, new_run_id, parse_tasks, plan_jobs, rollout_id_for, task_id_for


def test_tasks_keep_their_ids_and_get_stable_generated_ones():
    tasks = parse_tasks(['{"id": "a", "q": 1}', "", '{"q": 2, "z": [1]}', '{"id": 7}'], "t.jsonl")
    assert [(t.id, t.line) for t in tasks] == [("a", 1), (task_id_for({"q": 2, "z": [1]}), 3), ("7", 4)]
    assert tasks[1].id == task_id_for({"z": [1], "q": 2}), "key order must not change the id"
    assert tasks[1].id != task_id_for({"q": 3, "z": [1]})


def test_every_bad_line_is_named_with_file_and_line_number():
    with pytest.raises(UsageError) as e:
        parse_tasks(['{"id": "a"}', '{"id": "b"', "[1, 2]", '{"id": "a"}', '{"id": true}'], "tasks.jsonl")
    msg = str(e.value)
    assert "4 bad line(s) in tasks.jsonl" in msg
    assert "tasks.jsonl:2: not valid JSON" in msg
    assert "tasks.jsonl:3: expected a JSON object, got list" in msg
    assert "tasks.jsonl:4: task id 'a' repeats line 1" in msg
    assert "tasks.jsonl:5: 'id' must be a non-empty string or integer" in msg


def test_an_empty_tasks_file_is_a_usage_error():
    with pytest.raises(UsageError, match="holds no tasks"):
        parse_tasks(["", "  "], "empty.jsonl")


def test_plan_is_task_major_and_rollout_ids_are_unique_per_attempt():
    tasks = [Task("a", {}, 1), Task("b", {}, 2)]
    jobs = plan_jobs(tasks, 3)
    assert [(j.task.id, j.sample, j.index) for j in jobs] == [
        ("a", 0, 0), ("a", 1, 1), ("a", 2, 2), ("b", 0, 3), ("b", 1, 4), ("b", 2, 5)]
    ids = {rollout_id_for("R", j, a) for j in jobs for a in range(3)}
    assert len(ids) == 18
    assert rollout_id_for("R", jobs[4], 0) == "R-00004" and rollout_id_for("R", jobs[4], 2) == "R-00004-a2"
    run = new_run_id(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    assert run.startswith("20260102T030405Z-") and new_run_id() != new_run_id()


def test_resource_attributes_merge_keeps_user_keys_and_replaces_ours():
    merged = merge_resource_attributes("team=rl, tracerl.task_id=old,bogus,service.version=1%2C2",
                                       {"tracerl.rollout_id": "r,1=x", "tracerl.task_id": "t 1"})
    assert parse_resource_attributes(merged) == {
        "team": "rl", "service.version": "1,2", "tracerl.rollout_id": "r,1=x", "tracerl.task_id": "t 1"}
    assert merge_resource_attributes(None, {"k": "v"}) == "k=v"


def test_agent_env_points_the_agent_at_tracerl_and_keeps_the_rest():
    base = {"PATH": "/bin", "OTEL_RESOURCE_ATTRIBUTES": "team=rl", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x",
            "OPENAI_BASE_URL": "https://api.openai.com/v1"}
    env = agent_env(base, rollout_id="r1", task_id="t1", task_json='{"q": 1}',
                    otlp="http://127.0.0.1:4317", gateway="http://127.0.0.1:8100/v1")
    assert env["PATH"] == "/bin" and "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in env
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    assert (env["OTEL_EXPORTER_OTLP_INSECURE"], env["OTEL_TRACES_EXPORTER"]) == ("true", "otlp")
    assert parse_resource_attributes(env["OTEL_RESOURCE_ATTRIBUTES"]) == {
        "team": "rl", "tracerl.rollout_id": "r1", "tracerl.task_id": "t1"}
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8100/v1" and env["OPENAI_API_KEY"] == "tracerl"
    assert env["TRACERL_TASK"] == '{"q": 1}'
    assert base["OPENAI_BASE_URL"] == "https://api.openai.com/v1", "the driver's own env is not mutated"
    kept = agent_env({"OPENAI_API_KEY": "sk-1", "OPENAI_BASE_URL": "http://mine"}, rollout_id="r", task_id="t",
                     task_json="{}", otlp="http://o", gateway="")
    assert (kept["OPENAI_API_KEY"], kept["OPENAI_BASE_URL"]) == ("sk-1", "http://mine")
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"


def test_agent_env_sets_the_otlp_protocol_with_the_endpoint():
    """The JS SDK defaults to http/protobuf and Python's to grpc: the driver always says which."""
    base = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    env = agent_env(base, rollout_id="r", task_id="t", task_json="{}", otlp="http://127.0.0.1:4318",
                    gateway="", otlp_protocol="http/protobuf")
    assert (env["OTEL_EXPORTER_OTLP_ENDPOINT"], env["OTEL_EXPORTER_OTLP_PROTOCOL"]) == (
        "http://127.0.0.1:4318", "http/protobuf")
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env


def test_task_is_appended_as_the_last_argument_only_for_task_via_arg():
    assert agent_argv(["python", "a.py"], "{}", "arg") == ["python", "a.py", "{}"]
    assert agent_argv(["python", "a.py"], "{}", "stdin") == ["python", "a.py"]
    assert agent_argv(["python", "a.py"], "{}", "env") == ["python", "a.py"]


def test_retry_policy_retries_failures_and_timeouts_until_attempts_run_out():
    assert should_retry("failed", 0, 1) and should_retry("timeout", 0, 1)
    assert not should_retry("failed", 1, 1) and not should_retry("ok", 0, 5) and not should_retry("failed", 0, 0)
    assert reward_post_delays(5, 0.5, 2.0) == [0.5, 1.0, 2.0, 2.0]


def test_reward_function_errors_and_non_finite_values_are_reported_not_raised():
    assert compute_reward(lambda t, s: 1, {}, "") == (1.0, None)
    assert compute_reward(lambda t, s: 1 / 0, {}, "")[1].startswith("reward function raised ZeroDivisionError")
    assert "finite float" in compute_reward(lambda t, s: float("nan"), {}, "")[1]
    assert "finite float" in compute_reward(lambda t, s: "1", {}, "")[1]


def test_reward_post_retries_503_then_succeeds_and_gives_up_on_400():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        return httpx.Response(503 if len(calls) < 3 else 200, headers={"Retry-After": "0"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        assert post_reward(client, "http://c:4318", "r1", 0.5, "reward", delays=[0, 0, 0]) is None
    assert len(calls) == 3 and calls[0] == {"rollout_id": "r1", "value": 0.5, "name": "reward", "reward_id": "r1:reward"}
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(400, text="bad"))) as client:
        assert "refused" in post_reward(client, "http://c:4318", "r1", 0.5, "reward", delays=[0, 0])


def _rec(status: str, reward: float | None = None, posted: bool | None = None, error: str | None = None) -> RolloutRecord:
    return RolloutRecord("r", "t", 0, status, 0, 1.0, 1, reward=reward, reward_posted=posted, error=error)


def test_summary_counts_statuses_and_averages_rewards():
    s = summarize([_rec("ok", 1.0, True), _rec("ok", 0.0, False, "could not post"), _rec("failed"),
                   _rec("timeout"), _rec("ok", None, None, "reward function raised X")])
    assert (s.total, s.ok, s.failed, s.timeout, s.rewarded) == (5, 3, 1, 1, 2)
    assert s.mean_reward == 0.5 and s.reward_errors == 1 and s.unposted_rewards == 1
    text = format_summary(s, "/s/rollouts/x.jsonl")
    assert "5 rollouts: 3 ok, 1 failed, 1 timeout; mean reward 0.500 over 2" in text
    assert "1 reward(s) not posted" in text and "1 reward function error(s)" in text
    assert summarize([]).mean_reward is None



def test_an_http_otlp_protocol_with_the_grpc_default_endpoint_is_a_usage_error_naming_the_fix():
    with pytest.raises(UsageError, match=r"--otlp http://127\.0\.0\.1:4318"):
        validate(Driver(command=["node", "agent.mjs"], tasks=[], otlp_protocol="http/protobuf",
                        collector="http://127.0.0.1:4318"))
    with pytest.raises(UsageError, match="--otlp-protocol must be one of grpc, http/protobuf, http/json"):
        validate(Driver(command=["node", "agent.mjs"], tasks=[], otlp_protocol="http"))
    validate(Driver(command=["node", "agent.mjs"], tasks=[], otlp="http://127.0.0.1:4318",
                    otlp_protocol="http/protobuf"))


def test_a_continuous_plan_cycles_the_tasks_keeping_each_group_together():
    from rollout.tasks import job_stream

    tasks = parse_tasks(['{"id": "a"}', '{"id": "b"}'], "t.jsonl")
    jobs = list(job_stream(tasks, 2, max_rollouts=7))
    assert [(j.index, j.task.id, j.sample) for j in jobs] == [
        (0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1), (4, "a", 2), (5, "a", 3), (6, "b", 2)]
    assert len({rollout_id_for("run", j, 0) for j in jobs}) == 7
    endless = job_stream(tasks, 3)
    assert [next(endless).sample for _ in range(12)][-3:] == [3, 4, 5]  # no limit: cycle 1 of task b
    assert list(job_stream([], 3)) == []


def test_max_rollouts_belongs_to_continuous_runs():
    with pytest.raises(UsageError, match="--max-rollouts applies to --continuous"):
        validate(Driver(command=["x"], tasks=parse_tasks(['{"id": "a"}']), max_rollouts=3))
    validate(Driver(command=["x"], tasks=parse_tasks(['{"id": "a"}']), max_rollouts=3, continuous=True))
