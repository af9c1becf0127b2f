"""``POST /v1/rewards`` as a production feedback widget uses it, on a real collector over HTTP:
keyed by a response id, thumbs up/down, ``true``/``false``, corrections stored beside the original,
feedback for ids no span has is accepted and stored, and a bad field is named in the 400."""

from __future__ import annotations

import httpx
import pytest

from collector_exporter.rewards import THUMBS
from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly


@pytest.fixture
def collector(store):
    with running_collector(store) as c:
        yield c


def test_feedback_by_response_id_thumbs_and_booleans_is_stored(collector, store):
    url = collector.http_endpoint + "/v1/rewards"
    body = [
        {"response_id": "chatcmpl-abc", "thumbs": "up"},
        {"trace_id": "cd" * 16, "thumbs": "Down"},
        {"rollout_id": "conv-9", "value": True, "reward_id": "fb-1"},
        {"rollout_id": "conv-9", "value": False, "reward_id": "fb-1"},  # a correction: stored as well
        {"response_id": "chatcmpl-nobody-has", "value": 0.5},  # matches no span: accepted all the same
    ]
    r = httpx.post(url, json=body)
    assert r.status_code == 200 and r.json()["accepted"] == 5
    assert r.json()["reward_ids"][2:4] == ["fb-1", "fb-1"]
    assert httpx.post(url, json=body).json()["reward_ids"] == r.json()["reward_ids"]  # a retry: idempotent
    collector.flush()
    rows = (
        connect_readonly(parse_store(store))
        .execute(
            "SELECT rollout_id, trace_id, response_id, value FROM rewards ORDER BY value, coalesce(response_id, '')"
        )
        .fetchall()
    )
    assert sorted(rows, key=repr) == sorted(
        [
            (None, None, "chatcmpl-abc", THUMBS["up"]),
            (None, "cd" * 16, None, THUMBS["down"]),
            ("conv-9", None, None, 1.0),
            ("conv-9", None, None, 0.0),
            (None, None, "chatcmpl-nobody-has", 0.5),
        ],
        key=repr,
    )
    assert (THUMBS["up"], THUMBS["down"]) == (1.0, 0.0)


@pytest.mark.parametrize(
    "item, named",
    [
        ({"response_id": "chatcmpl-1", "thumbs": "sideways"}, "'thumbs'"),
        ({"response_id": "chatcmpl-1", "thumbs": 1}, "'thumbs'"),
        ({"response_id": "chatcmpl-1", "thumbs": "up", "value": 1}, "not both"),
        ({"response_id": "chatcmpl-1"}, "'value' is missing"),
        ({"response_id": "chatcmpl-1", "value": "good"}, "'value'"),
        ({"response_id": "", "value": 1}, "'response_id'"),
        ({"thumbs": "up"}, "'response_id'"),
        ({"response_id": "chatcmpl-1", "value": 1, "stars": 5}, "stars"),
        ({"trace_id": "xyz", "value": 1}, "trace_id"),
    ],
)
def test_malformed_feedback_gets_a_400_naming_the_field(collector, item, named):
    r = httpx.post(collector.http_endpoint + "/v1/rewards", json=item)
    assert r.status_code == 400 and named in r.json()["message"], r.text
