"""Transitions -> samples -> packed batches, against a real Parquet store, DuckDB and a tiny model."""

from __future__ import annotations

import pytest

from store.location import parse_store
from store.views import connect_readonly
from trainer.dataset import DatasetConfig, build_samples, load_transitions


def _ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 200 for i in range(n)]


def test_load_filters_versions_trainable_agents_and_dedupes_replays(tmp_path, make_row, write_rows):
    rows = [
        make_row("r1", version=1, reward=1.0, prompt_ids=_ids(3), response_ids=_ids(2), transition_id="t1"),
        make_row("r2", version=1, reward=0.0, prompt_ids=_ids(3), response_ids=_ids(2), agent="critic"),
        make_row("r3", version=1, reward=0.0, prompt_ids=_ids(3), response_ids=_ids(2), trainable=False),
        make_row("r4", version=2, reward=1.0, prompt_ids=_ids(3), response_ids=_ids(2)),
    ]
    write_rows(tmp_path, rows)
    write_rows(tmp_path, [rows[0]])  # the converter replayed r1's call: same transition_id
    con = connect_readonly(parse_store(tmp_path))
    got = load_transitions(con, (1, 1))
    assert sorted(got.column("rollout_id").to_pylist()) == ["r1", "r2"]
    got = load_transitions(con, (1, 1), agents="^solver$")
    assert got.column("rollout_id").to_pylist() == ["r1"]
    got = load_transitions(con, (1, 2), trainable_only=False)
    assert sorted(got.column("rollout_id").to_pylist()) == ["r1", "r2", "r3", "r4"]


def test_a_tasks_regex_keeps_held_out_tasks_out_of_training(tmp_path, make_row, write_rows):
    ids = {"r1": "train-a", "r2": "heldout-a", "r3": "train-b"}
    write_rows(tmp_path, [make_row(rid, task_id=task, version=0, reward=1.0, prompt_ids=_ids(3),
                                   response_ids=_ids(2)) for rid, task in ids.items()])
    con = connect_readonly(parse_store(tmp_path))
    assert sorted(load_transitions(con, (0, 0), tasks="^train-").column("rollout_id").to_pylist()) == ["r1", "r3"]
    assert len(load_transitions(con, (0, 0))) == 3


@pytest.mark.slow
def test_incomplete_rollouts_are_skipped_and_rollout_reward_is_copied_to_every_call(
        tmp_path, make_row, write_rows, tokenizer):
    rows = [
        # r1: two calls, the last marks the rollout complete
        make_row("r1", task_id="t", step=0, reward=1.0, is_last=False, prompt_ids=_ids(4), response_ids=_ids(6)),
        make_row("r1", task_id="t", step=1, reward=1.0, is_last=True, prompt_ids=_ids(4), response_ids=_ids(2)),
        make_row("r2", task_id="t", reward=0.0, prompt_ids=_ids(3), response_ids=_ids(4)),
        make_row("r3", task_id="t", reward=1.0, is_last=False, prompt_ids=_ids(3), response_ids=_ids(4)),
    ]
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig(estimator="reinforce_baseline"))
    assert stats.n_rollouts == 3 and stats.n_rollouts_incomplete == 1
    assert [(s.rollout_id, s.advantage) for s in samples] == [("r1", 0.5), ("r1", 0.5), ("r2", -0.5)]
    # per-rollout normalisation: r1 (8 tokens) and r2 (4 tokens) each carry half the loss weight
    per_rollout = {}
    for s in samples:
        per_rollout[s.rollout_id] = per_rollout.get(s.rollout_id, 0.0) + s.weight * len(s.response_ids)
    assert per_rollout == pytest.approx({"r1": 0.5, "r2": 0.5})


@pytest.mark.slow
def test_missing_token_ids_are_retokenized_with_the_chat_template_and_counted(
        tmp_path, make_row, write_rows, tokenizer):
    rows = [make_row("a", reward=1.0, prompt="what is 2+2?", response="4"),
            make_row("b", reward=0.0, prompt="what is 2+2?", response="5")]
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig())
    assert stats.n_retokenized == 2 and all(s.retokenized and s.rollout_logprobs is None for s in samples)
    a = samples[0]
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False)
    assert tokenizer.decode(a.prompt_ids + a.response_ids) + "\n" == full
    assert tokenizer.decode(a.response_ids) == "4<|im_end|>"


@pytest.mark.slow
def test_truncation_keeps_the_end_of_the_prompt_and_the_start_of_the_response(
        tmp_path, make_row, write_rows, tokenizer):
    rows = [make_row("a", reward=1.0, prompt_ids=list(range(10, 30)), response_ids=list(range(50, 60)),
                     logprobs=[-0.1 * i for i in range(10)]),
            make_row("b", reward=0.0, prompt_ids=list(range(10, 13)), response_ids=list(range(50, 53)))]
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig(max_prompt_tokens=5, max_response_tokens=4))
    a = next(s for s in samples if s.rollout_id == "a")
    assert a.prompt_ids == list(range(25, 30))
    assert a.response_ids == [50, 51, 52, 53]
    assert a.rollout_logprobs == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert stats.n_truncated_prompt == 1 and stats.n_truncated_response == 1


@pytest.mark.slow
def test_zero_variance_groups_are_dropped_and_counted(tmp_path, make_row, write_rows, tokenizer):
    rows = [make_row(f"r{i}", task_id="same", reward=1.0, prompt_ids=_ids(3), response_ids=_ids(3))
            for i in range(3)]
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig())
    assert samples == [] and stats.n_groups_zero_variance == 1 and stats.n_rollouts_zero_variance == 3


@pytest.mark.slow
def test_retokenized_rows_render_tools_with_the_chat_template(tmp_path, make_row, write_rows, tokenizer):
    import json

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    rows = [make_row("a", reward=1.0, prompt="weather?"), make_row("b", reward=0.0, prompt="weather?")]
    rows[0]["tools"] = rows[1]["tools"] = json.dumps(tools)
    rows[0]["response_message"] = json.dumps(call)
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig())
    assert stats.n_retokenized == 2
    a = next(s for s in samples if s.rollout_id == "a")
    assert "<tools>" in tokenizer.decode(a.prompt_ids) and "get_weather" in tokenizer.decode(a.prompt_ids)
    assert tokenizer.decode(a.response_ids) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')


def test_calls_without_a_version_count_as_the_base_model(tmp_path, make_row, write_rows):
    rows = [make_row("base", version=0, prompt_ids=_ids(3), response_ids=_ids(2)),
            make_row("v1", version=1, prompt_ids=_ids(3), response_ids=_ids(2))]
    rows[0]["policy_version"] = None  # served as plain "policy" before anything was published
    rows[0]["model"] = "policy"
    write_rows(tmp_path, rows)
    con = connect_readonly(parse_store(tmp_path))
    assert load_transitions(con, (0, 0)).column("rollout_id").to_pylist() == ["base"]
    assert load_transitions(con, (0, 0), unversioned=-1).num_rows == 0
    assert load_transitions(con, (1, 1)).column("rollout_id").to_pylist() == ["v1"]


@pytest.mark.slow
def test_rows_with_nanosecond_timestamps_build_samples(tmp_path, make_row, write_rows, tokenizer):
    # real transitions carry span times in ns, most not a whole microsecond (datetime cannot hold them)
    t0 = 1_795_269_159_352_905_647
    rows = [make_row(f"r{i}", task_id="t", reward=float(i), prompt_ids=_ids(3), response_ids=_ids(2)) for i in range(2)]
    for i, r in enumerate(rows):
        r["started_at"], r["ended_at"] = t0 + i, t0 + 1000 + i
    write_rows(tmp_path, rows)
    table = load_transitions(connect_readonly(parse_store(tmp_path)), (0, 0))
    samples, stats = build_samples(table, tokenizer, DatasetConfig())
    assert stats.n_rollouts == 2 and sorted(s.rollout_id for s in samples) == ["r0", "r1"]
