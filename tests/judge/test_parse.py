"""Recorded judge answers -> all scores or a failure with its reason; never a made-up score."""

from __future__ import annotations

import json

import pytest

from judge.parse import parse_answer, response_format

IDS = ["1", "2", "3"]
GOOD = {
    "scores": {
        "1": {"explanation": "right", "score": 1.0},
        "2": {"explanation": "wrong table", "score": 0.2},
        "3": {"explanation": "no SQL", "score": 0},
    }
}


def test_the_asked_for_shape_parses() -> None:
    got = parse_answer(json.dumps(GOOD), IDS)
    assert got.ok and {k: v.score for k, v in got.scores.items()} == {"1": 1.0, "2": 0.2, "3": 0.0}
    assert got.scores["2"].explanation == "wrong table"


@pytest.mark.parametrize(
    "answer",
    [
        "Sure! Here are my scores:\n" + json.dumps(GOOD) + "\nLet me know if you need more.",
        "```json\n" + json.dumps(GOOD, indent=2) + "\n```",
        "Thinking... {not json} then " + json.dumps(GOOD),
        json.dumps(
            {
                "scores": [
                    {"trajectory_id": i, "explanation": e["explanation"], "score": e["score"]}
                    for i, e in GOOD["scores"].items()
                ]
            }
        ),  # RULER's list shape
        json.dumps(
            {
                "scores": [
                    {"trajectory_id": int(i), "explanation": "", "score": e["score"]}
                    for i, e in GOOD["scores"].items()
                ]
            }
        ),  # ids as numbers
    ],
)
def test_json_in_prose_fences_or_the_list_shape_parses(answer: str) -> None:
    got = parse_answer(answer, IDS)
    assert got.ok, got.error
    assert [got.scores[i].score for i in IDS] == [1.0, 0.2, 0.0]


def test_a_single_trajectory_may_answer_without_the_scores_wrapper() -> None:
    got = parse_answer('{"explanation": "fine", "score": 0.5}', ["1"])
    assert got.ok and got.scores["1"].score == 0.5
    assert parse_answer('{"explanation": "fine", "score": 0.5}', IDS).kind == "bad_shape"


@pytest.mark.parametrize(
    ("answer", "kind", "says"),
    [
        ("", "empty", "empty"),
        ("I prefer trajectory 1.", "no_json", "no JSON"),
        ('{"scores": {"1": {"score": 1}, "2": {"score": 0.5}}}', "missing_ids", "['3'] (2 of 3 scored)"),
        (
            '{"scores": [{"trajectory_id": "1", "score": 1}]}',
            "missing_ids",
            "['2', '3'] (1 of 3",
        ),  # fewer scores than trajectories
        (
            '{"scores": {"1": {"score": 1}, "2": {"score": 0}, "3": {"score": 0}, "9": {"score": 1}}}',
            "unknown_ids",
            "'9'",
        ),
        ('{"scores": {"1": {"score": 7}, "2": {"score": 0}, "3": {"score": 0}}}', "out_of_range", "7"),
        ('{"scores": {"1": {"score": -0.1}, "2": {"score": 0}, "3": {"score": 0}}}', "out_of_range", "-0.1"),
        (
            '{"scores": {"1": {"score": "high"}, "2": {"score": 0}, "3": {"score": 0}}}',
            "not_numeric",
            '"high"',
        ),
        ('{"scores": {"1": {"score": "0.5"}, "2": {"score": 0}, "3": {"score": 0}}}', "not_numeric", '"0.5"'),
        ('{"scores": {"1": {"score": true}, "2": {"score": 0}, "3": {"score": 0}}}', "not_numeric", "true"),
        (
            '{"scores": {"1": {"explanation": "x"}, "2": {"score": 0}, "3": {"score": 0}}}',
            "not_numeric",
            "null",
        ),
        (
            '{"scores": [{"trajectory_id": "1", "score": 1}, {"trajectory_id": "1", "score": 0}, '
            '{"trajectory_id": "2", "score": 0}]}',
            "duplicate_ids",
            "twice",
        ),
        ('{"verdict": "good"}', "bad_shape", "no 'scores'"),
        ('Scores: {"verdict": "good"}', "no_json", "no JSON object with scores"),
        ('{"scores": [{"score": 1}]}', "bad_shape", "trajectory_id"),
        (
            '{"scores": {"1": {"explanation": "ok", "score": 0.9}, "2": {"explanation": "tru',
            "no_json",
            "cut off",
        ),
    ],
)
def test_unusable_answers_fail_the_group_with_a_reason(answer: str, kind: str, says: str) -> None:
    got = parse_answer(answer, IDS)
    assert not got.ok and got.scores is None
    assert got.kind == kind and says in got.error


def test_the_response_format_pins_every_id_and_the_score_range() -> None:
    rf = response_format(IDS)
    assert rf["type"] == "json_schema"
    scores = rf["json_schema"]["schema"]["properties"]["scores"]
    assert scores["required"] == IDS and scores["additionalProperties"] is False
    assert scores["properties"]["2"]["properties"]["score"] == {"type": "number", "minimum": 0, "maximum": 1}
    assert scores["properties"]["2"]["required"] == ["explanation", "score"]  # the reason before the score
    assert parse_answer(json.dumps(GOOD), IDS).ok  # what the schema admits, the parser accepts


# Recorded from vLLM (CPU) serving SmolLM2-135M-Instruct with the schema's guided decoding and a budget of
# 224 answer tokens (finish_reason "length"; the first 300 characters): a degenerate explanation ran the
# budget out before the JSON could close. The cap is now 160 characters under 200 tokens per trajectory.
SMOLLM2_CUT_OFF = '{"scores":{"1":{"explanation": "1.0.0.0.1.1' + ".1" * 128


def test_a_recorded_answer_cut_off_by_the_token_budget_is_a_failure_not_a_score() -> None:
    got = parse_answer(SMOLLM2_CUT_OFF, ["1"])
    assert (got.ok, got.kind) == (False, "no_json") and "cut off" in got.error
