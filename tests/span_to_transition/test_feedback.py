"""Feedback as production gives it: keyed by what a client holds (rollout, trace or response id),
corrected by a later row with the same ``reward_id``, and counted, never dropped, when it matches no
rollout. Pure functions for the join rules; real Parquet stores through ``convert_store`` for the pass."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from schemas.tables import REWARDS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.feedback import RewardRow, latest_rows, target, unjoined
from span_to_transition.ledger import Ledger
from span_to_transition.records import Reward
from span_to_transition.store import convert_store
from store.location import parse_store
from tracerl.commands.status import collect_status

from .factory import TraceBuilder, spans_table, user
from .test_store import put, transitions
from .test_tokens import gateway_attrs

S = 1_000_000_000
LATER = 2_000_000_000 * S


def row(
    value: float,
    reward_id: str | None,
    at: int | None,
    *,
    order: int = 0,
    new: bool = False,
    rollout_id: str | None = "r1",
    trace_id: str | None = None,
    response_id: str | None = None,
) -> RewardRow:
    return RewardRow(
        rollout_id,
        trace_id,
        Reward(value, "side_channel", None, None, response_id, None, reward_id),
        at,
        (order, 0),
        new,
    )


def test_a_later_row_with_the_same_reward_id_replaces_the_earlier_one() -> None:
    rows = [
        row(1.0, "fb-7", 10),
        row(0.0, "fb-7", 20, order=1),
        row(0.5, "other", 15),
        row(0.25, None, None),
        row(0.25, None, None),
    ]
    kept = latest_rows(rows)
    assert [(r.reward.reward_id, r.reward.value) for r in kept] == [
        ("fb-7", 0.0),
        ("other", 0.5),
        (None, 0.25),
        (None, 0.25),
    ]
    # received order decides, not read order; a row without a time (offline) is older than any posted one
    assert [
        r.reward.value for r in latest_rows([row(0.0, "x", 20, order=0), row(1.0, "x", 10, order=1)])
    ] == [0.0]
    assert [r.reward.value for r in latest_rows([row(0.0, "x", None, order=5), row(1.0, "x", 1)])] == [1.0]
    # same time (one POST with the id twice): the later row in the read wins
    assert [r.reward.value for r in latest_rows([row(0.0, "x", 5, order=0), row(1.0, "x", 5, order=1)])] == [
        1.0
    ]


def test_a_reward_id_touched_by_a_new_row_is_news_even_when_an_old_row_wins() -> None:
    [kept] = latest_rows([row(1.0, "x", 30), row(1.0, "x", 20, order=1, new=True)])  # a retry of an old post
    assert kept.reward.value == 1.0 and kept.new


def test_targets_and_unjoined_rows_by_each_key() -> None:
    traces, responses = {"t-gw": "conv-1"}, {"chatcmpl-1": "conv-2"}
    by_rollout, by_trace = (
        row(1, "a", 1, rollout_id="conv-3"),
        row(1, "b", 1, rollout_id=None, trace_id="t-gw"),
    )
    by_response = row(1, "c", 1, rollout_id=None, response_id="chatcmpl-1")
    nowhere = row(1, "d", 1, rollout_id=None, response_id="chatcmpl-unknown")
    assert [target(r, traces, responses) for r in (by_rollout, by_trace, by_response, nowhere)] == [
        "conv-3",
        "conv-1",
        "conv-2",
        None,
    ]
    u = unjoined([by_rollout, by_trace, by_response, nowhere], {"conv-1", "conv-2"}, traces, responses)
    assert (u.count, u.samples) == (2, ["rollout_id=conv-3", "response_id=chatcmpl-unknown"])


# ---------------------------------------------------------------------------------------------
# The conversion pass on real Parquet


def side(reward_id: str, value: float, at_s: int, **keys: str) -> pa.Table:
    base = {
        "reward_id": reward_id,
        "rollout_id": None,
        "trace_id": None,
        "span_id": None,
        "response_id": None,
        "name": "feedback",
        "value": value,
        "source": "side_channel",
        "at": at_s * S,
    }
    return pa.Table.from_pylist([{**base, **keys}], schema=REWARDS_SCHEMA)


def service_request(trace_id: str, response_id: str, *, gateway_trace: str | None = None) -> list:
    """One request of a deployed service: an HTTP server span, one chat call, no in-band reward. With
    ``gateway_trace`` the gateway's span is in a trace of its own (the client sent no traceparent)."""
    t = TraceBuilder(trace_id, received_at_ns=100 * S)
    root = t.span("POST /ask")
    t.chat(root, [user(f"question {trace_id[:4]}")], "SELECT 1", response_id=response_id)
    spans = t.spans
    if gateway_trace:
        g = TraceBuilder(gateway_trace, received_at_ns=100 * S)
        g.span("gateway chat", None, gateway_attrs(response_id, [1, 2], [3, 4]))
        spans += g.spans
    return spans


def by_rollout(store: Path) -> dict[str, dict]:
    return {r["rollout_id"]: r for r in transitions(store)}


def test_feedback_keyed_by_the_response_id_joins_the_rollout_that_recorded_it(store: Path) -> None:
    put(
        store,
        "spans",
        spans_table(service_request("a" * 32, "chatcmpl-A") + service_request("b" * 32, "chatcmpl-B")),
        "a",
    )
    put(store, "rewards", side("fb-a", 1.0, 200, response_id="chatcmpl-A"), "r1")
    first = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert (first.rollouts_converted, first.rollouts_excluded_no_reward, first.rewards_unjoined) == (1, 1, 0)
    assert by_rollout(store)["a" * 32]["rollout_reward"] == 1.0
    # late feedback for the other request, by response id only: the excluded rollout is converted now
    put(store, "rewards", side("fb-b", 0.0, 300, response_id="chatcmpl-B"), "r2")
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert again.rollouts_converted == 1
    assert {r: t["rollout_reward"] for r, t in by_rollout(store).items()} == {"a" * 32: 1.0, "b" * 32: 0.0}
    assert Ledger.load(parse_store(store)).responses == {"chatcmpl-A": "a" * 32, "chatcmpl-B": "b" * 32}


def test_a_response_id_recorded_by_a_gateway_in_its_own_trace_joins_the_agents_rollout(store: Path) -> None:
    put(store, "spans", spans_table(service_request("c" * 32, "chatcmpl-C", gateway_trace="9" * 32)), "a")
    put(store, "rewards", side("fb-c", 1.0, 200, response_id="chatcmpl-C"), "r1")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.rewards_unjoined == 0
    [(rid, t)] = by_rollout(store).items()
    assert rid == "c" * 32 and t["rollout_reward"] == 1.0 and t["token_source"] == "gateway"


def test_a_correction_replaces_the_reward_of_a_converted_rollout(store: Path) -> None:
    put(store, "spans", spans_table(service_request("d" * 32, "chatcmpl-D")), "a")
    put(store, "rewards", side("fb-d", 1.0, 200, trace_id="d" * 32), "r1")
    put(store, "rewards", side("thumb-d", 1.0, 201, trace_id="d" * 32), "r1b")  # another reward: it adds up
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert by_rollout(store)["d" * 32]["rollout_reward"] == 2.0
    put(store, "rewards", side("fb-d", -1.0, 500, trace_id="d" * 32), "r2")  # the user changed their mind
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert again.rollouts_reconverted == 1
    assert by_rollout(store)["d" * 32]["rollout_reward"] == 0.0  # -1 + 1, not 1 + 1 - 1
    put(store, "rewards", side("fb-d", -1.0, 500, trace_id="d" * 32), "r3")  # the correction retried
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert by_rollout(store)["d" * 32]["rollout_reward"] == 0.0


def test_feedback_for_no_known_rollout_is_counted_then_joined_when_its_spans_arrive(store: Path) -> None:
    put(store, "spans", spans_table(service_request("e" * 32, "chatcmpl-E")), "a")
    put(store, "rewards", side("fb-e", 1.0, 200, trace_id="e" * 32), "r1")
    put(store, "rewards", side("fb-f", 1.0, 200, trace_id="f" * 32), "r2")  # its trace is not here (yet)
    put(store, "rewards", side("fb-g", 0.0, 200, response_id="chatcmpl-G"), "r3")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.rewards_unjoined == 2 and "feedback matching no rollout" in stats.summary()
    assert Ledger.load(parse_store(store)).unjoined == {
        "count": 2,
        "samples": ["trace_id=" + "f" * 32, "response_id=chatcmpl-G"],
    }
    assert collect_status(parse_store(store))["rewards_unjoined"]["count"] == 2  # what `tracerl status` prints
    put(
        store,
        "spans",
        spans_table(service_request("f" * 32, "chatcmpl-F") + service_request("7" * 32, "chatcmpl-G")),
        "b",
    )
    later = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert later.rewards_unjoined == 0 and Ledger.load(parse_store(store)).unjoined["count"] == 0
    assert {r: t["rollout_reward"] for r, t in by_rollout(store).items()} == {
        "e" * 32: 1.0,
        "f" * 32: 1.0,
        "7" * 32: 0.0,
    }


# ---------------------------------------------------------------------------------------------
# Through a real collector: OTLP/HTTP spans from the OTel SDK, feedback over POST /v1/rewards


def _service_spans(n: int) -> tuple[bytes, list[str], list[str]]:
    """``n`` requests of a service (a server span and one semconv chat call each, real SDK spans) as an
    OTLP/HTTP protobuf body, with each request's trace id and the response id its app got back."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("service")
    traces, responses = [], []
    for i in range(n):
        with tracer.start_as_current_span("POST /ask") as root:
            with tracer.start_as_current_span("chat policy@0") as call:
                call.set_attributes(
                    {
                        "gen_ai.operation.name": "chat",
                        "gen_ai.request.model": "policy@0",
                        "gen_ai.response.id": f"chatcmpl-{i}",
                        "gen_ai.input.messages": json.dumps(
                            [{"role": "user", "parts": [{"type": "text", "content": f"question {i}?"}]}]
                        ),
                        "gen_ai.output.messages": json.dumps(
                            [
                                {
                                    "role": "assistant",
                                    "finish_reason": "stop",
                                    "parts": [{"type": "text", "content": "SELECT 1"}],
                                }
                            ]
                        ),
                    }
                )
            traces.append(format(root.get_span_context().trace_id, "032x"))
            responses.append(f"chatcmpl-{i}")
    tp.shutdown()
    return encode_spans(mem.get_finished_spans()).SerializeToString(), traces, responses


def test_feedback_posted_to_a_real_collector_joins_by_response_and_trace_id(store: Path) -> None:
    import httpx

    from collector_exporter.testing import running_collector

    body, traces, responses = _service_spans(4)
    with running_collector(store) as c:
        r = httpx.post(
            c.http_endpoint + "/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"}
        )
        assert r.status_code == 200, r.text
        feedback = [
            {"response_id": responses[0], "thumbs": "up"},
            {"trace_id": traces[1], "value": False, "reward_id": "user-1"},
            {"response_id": responses[3], "value": 0.25},
            {"response_id": "chatcmpl-never-served", "thumbs": "down"},
        ]
        assert httpx.post(c.http_endpoint + "/v1/rewards", json=feedback).status_code == 200
        c.flush()
        stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
        assert (stats.rollouts_converted, stats.rollouts_excluded_no_reward, stats.rewards_unjoined) == (
            3,
            1,
            1,
        )
        # the user of request 1 changes their mind: the same reward_id, a later value replaces the first
        assert (
            httpx.post(
                c.http_endpoint + "/v1/rewards",
                json={"trace_id": traces[1], "value": True, "reward_id": "user-1"},
            ).status_code
            == 200
        )
        c.flush()
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert again.rollouts_reconverted == 1
    got = {t["trace_id"]: t["rollout_reward"] for t in transitions(store)}
    assert got == {traces[0]: 1.0, traces[1]: 1.0, traces[3]: 0.25}
    assert collect_status(parse_store(store))["rewards_unjoined"] == {
        "count": 1,
        "samples": ["response_id=chatcmpl-never-served"],
    }
