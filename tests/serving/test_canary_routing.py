"""Canary routing: a share of rollouts to the candidate, sticky per rollout, the arm on every span."""

from __future__ import annotations

import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.gateway.canary import (
    ARM_ATTRIBUTE,
    CANDIDATE,
    SERVING,
    arm_for,
    canary_route,
    parse_upstream_for,
    session_from_baggage,
)
from serving.gateway.proxy import Gateway, GatewayConfig

from .helpers import chat_answer, scripted_upstream, wait_for

MSGS = [{"role": "user", "content": "hi"}]


def within_binomial(hits: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(hits - n * p) <= z * math.sqrt(n * p * (1 - p))


def trace_ids(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def test_the_split_holds_within_binomial_tolerance_and_each_key_keeps_its_arm():
    keys = trace_ids(20000, 0)
    for fraction in (0.05, 0.2, 0.5):
        arms = [arm_for(k, fraction) for k in keys]
        assert within_binomial(arms.count(CANDIDATE), len(keys), fraction), (fraction, arms.count(CANDIDATE))
        assert arms == [arm_for(k, fraction) for k in keys]  # sticky: a pure function of the key
    # nested: raising the share only moves keys to the candidate
    small, large = ({k for k in keys if arm_for(k, f) == CANDIDATE} for f in (0.1, 0.3))
    assert small < large
    assert {arm_for(k, 0.0) for k in keys[:100]} == {SERVING} and {arm_for(k, 1.0) for k in keys[:100]} == {
        CANDIDATE
    }
    # no key: each call draws its own
    assert (
        arm_for(None, 0.5, rand=lambda: 0.1) == CANDIDATE and arm_for(None, 0.5, rand=lambda: 0.9) == SERVING
    )


def test_route_and_flags_parse_with_errors_that_name_the_fix():
    route = canary_route(parse_upstream_for(["policy@6=http://b", "policy@5=http://a"]), 0.2)
    assert (route.serving.version, route.candidate.version, route.base) == ("policy@5", "policy@6", "policy")
    assert (
        route.routes("policy")
        and route.for_model("policy") is None
        and route.for_model("policy@6") == CANDIDATE
    )
    assert not route.routes("other")
    with pytest.raises(ValueError, match="VERSION=URL"):
        parse_upstream_for(["policy=http://a"])
    with pytest.raises(ValueError, match="exactly two"):
        canary_route(parse_upstream_for(["policy@5=http://a"]), 0.2)
    with pytest.raises(ValueError, match="one name"):
        canary_route(parse_upstream_for(["a@5=http://a", "b@6=http://b"]), 0.2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        route.with_fraction(1.5)
    assert session_from_baggage("userId=1,session.id=s%201;p=1") == "s 1"
    assert session_from_baggage("gen_ai.conversation.id=c,session.id=s") == "c"
    assert session_from_baggage("userId=1") is None


def identifying_upstream(delay_s: float = 0.0):
    """A real HTTP upstream that records the trace id of each call it serves."""
    seen: list[str] = []
    lock = threading.Lock()

    def handle(h, body):
        time.sleep(delay_s)
        with lock:
            seen.append(h.headers["traceparent"].split("-")[1])
        h.send_json(200, chat_answer(body["model"]))

    server = scripted_upstream(handle)
    server.seen = seen  # type: ignore[attr-defined]
    return server


def traceparent(tid: str) -> str:
    return f"00-{tid}-{secrets.token_hex(8)}-01"


def canary_gateway(spans, a, b, fraction: float) -> Gateway:
    cfg = GatewayConfig(canary=fraction, upstream_for={"policy@5": a.url, "policy@6": b.url})
    return Gateway(("127.0.0.1", 0), cfg, spans.provider).start_background()


def test_gateway_splits_rollouts_sticks_every_call_of_a_trace_and_labels_arm_and_version(spans):
    a, b = identifying_upstream(), identifying_upstream()
    gw = canary_gateway(spans, a, b, 0.3)
    tids = trace_ids(240, 1)
    try:
        with httpx.Client(timeout=30) as c:

            def rollout(tid: str) -> None:
                for _ in range(3):  # a multi-call rollout: one trace
                    r = c.post(
                        gw.url + "/v1/chat/completions",
                        json={"model": "policy", "messages": MSGS},
                        headers={"traceparent": traceparent(tid)},
                    )
                    assert r.status_code == 200, r.text

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(rollout, tids))
        n_calls = 3 * len(tids)
        got = wait_for(lambda: len(spans.get_finished_spans()) >= n_calls and spans.get_finished_spans())
    finally:
        gw.stop()
        a.shutdown()
        b.shutdown()
    on_a, on_b = set(a.seen), set(b.seen)
    assert not on_a & on_b  # sticky: no trace was served by both arms
    assert len(a.seen) + len(b.seen) == n_calls and len(on_a | on_b) == len(tids)
    assert within_binomial(len(on_b), len(tids), 0.3), len(on_b)
    assert on_b == {t for t in tids if arm_for(t, 0.3) == CANDIDATE}
    for s in got:
        arm, up, v = (
            s.attributes[ARM_ATTRIBUTE],
            s.attributes["tracerl.upstream"],
            s.attributes["tracerl.policy_version"],
        )
        assert (arm, up, v) in ((SERVING, a.url, 5), (CANDIDATE, b.url, 6))
        assert (format(s.context.trace_id, "032x") in on_b) == (arm == CANDIDATE)


def test_a_promote_in_the_middle_of_calls_loses_none_and_labels_each_where_it_ran(spans):
    a, b = identifying_upstream(0.3), identifying_upstream(0.3)
    gw = canary_gateway(spans, a, b, 0.2)
    tids = trace_ids(40, 2)
    try:
        with httpx.Client(timeout=30) as c, ThreadPoolExecutor(40) as pool:
            post = lambda tid: c.post(  # noqa: E731
                gw.url + "/v1/chat/completions",
                json={"model": "policy", "messages": MSGS},
                headers={"traceparent": traceparent(tid)},
            )
            first = [pool.submit(post, t) for t in tids]
            time.sleep(0.1)  # in flight on both arms
            r = c.post(gw.url + "/v1/canary", json={"fraction": 1.0})
            assert r.status_code == 200 and r.json()["fraction"] == 1.0
            after = list(pool.map(post, tids))
            assert all(f.result().status_code == 200 for f in first) and all(
                x.status_code == 200 for x in after
            )
            assert c.post(gw.url + "/v1/canary", json={"fraction": "x"}).status_code == 400
        got = wait_for(lambda: len(spans.get_finished_spans()) >= 80 and spans.get_finished_spans())
    finally:
        gw.stop()
        a.shutdown()
        b.shutdown()
    assert len(a.seen) + len(b.seen) == 80  # none lost
    before_promote = {t for t in tids if arm_for(t, 0.2) == SERVING}
    assert before_promote and set(a.seen) == before_promote  # the serving arm got only calls sent before
    for s in got:  # and every span says where its call actually ran
        arm, up = s.attributes[ARM_ATTRIBUTE], s.attributes["tracerl.upstream"]
        assert (arm, up, s.attributes["tracerl.policy_version"]) in (
            (SERVING, a.url, 5),
            (CANDIDATE, b.url, 6),
        )


def test_a_conversation_of_many_traces_stays_on_one_arm(spans):
    a, b = identifying_upstream(), identifying_upstream()
    gw = canary_gateway(spans, a, b, 0.5)
    sessions = [f"conv-{i}" for i in range(30)]
    session_of = {tid: sid for i, sid in enumerate(sessions) for tid in trace_ids(3, 100 + i)}
    try:
        with httpx.Client(timeout=30) as c:
            for tid, sid in session_of.items():  # each turn its own trace
                r = c.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"traceparent": traceparent(tid), "baggage": f"session.id={sid}"},
                )
                assert r.status_code == 200
        got = wait_for(lambda: len(spans.get_finished_spans()) >= 90 and spans.get_finished_spans())
    finally:
        gw.stop()
        a.shutdown()
        b.shutdown()
    arms: dict[str, set[str]] = {}
    for span in got:
        arms.setdefault(session_of[format(span.context.trace_id, "032x")], set()).add(
            span.attributes[ARM_ATTRIBUTE]
        )
    assert arms == {sid: {arm_for(sid, 0.5)} for sid in sessions}  # one arm per conversation, by its id


@pytest.mark.slow  # loads the tiny model into two servers
def test_two_real_model_servers_behind_the_canary_each_call_labelled_with_the_weights_that_served_it(
    spans, tiny_model_dir
):
    from serving.embedded.server import EmbeddedServer

    servers = [EmbeddedServer.start(str(tiny_model_dir)) for _ in range(2)]
    a, b = servers
    for server, version in ((a, "5"), (b, "6")):  # what the publisher sets after a full-weight reload
        assert (
            httpx.post(server.url + "/update_weight_version", json={"new_version": version}).status_code
            == 200
        )
    cfg = GatewayConfig(canary=0.3, upstream_for={"policy@5": a.url, "policy@6": b.url})
    gw = Gateway(("127.0.0.1", 0), cfg, spans.provider).start_background()
    tids = trace_ids(80, 3)
    try:
        with httpx.Client(timeout=60) as c:

            def rollout(tid: str) -> None:
                for turn in range(2):
                    r = c.post(
                        gw.url + "/v1/chat/completions",
                        headers={"traceparent": traceparent(tid)},
                        json={
                            "model": "policy",
                            "max_tokens": 3,
                            "stream": turn == 1,
                            "messages": [{"role": "user", "content": f"turn {turn}"}],
                        },
                    )
                    assert r.status_code == 200, r.text

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(rollout, tids))
            got = list(
                wait_for(lambda: len(spans.get_finished_spans()) >= 160 and spans.get_finished_spans(), 30)
            )
            # the label is the server's own weight version, not the map's: re-tag b, call a candidate trace
            httpx.post(b.url + "/update_weight_version", json={"new_version": "9"})
            time.sleep(0.3)  # past the gateway's version cache (version_max_age_s)
            tid = next(t for t in tids if arm_for(t, 0.3) == CANDIDATE)
            c.post(
                gw.url + "/v1/chat/completions",
                headers={"traceparent": traceparent(tid)},
                json={"model": "policy", "max_tokens": 2, "messages": MSGS},
            )
            last = wait_for(lambda: len(spans.get_finished_spans()) >= 161 and spans.get_finished_spans()[-1])
            assert (last.attributes[ARM_ATTRIBUTE], last.attributes["tracerl.policy_version"]) == (
                CANDIDATE,
                9,
            )
    finally:
        gw.stop()
        for s in servers:
            s.stop()
    by_trace: dict[str, set[tuple]] = {}
    for s in got:
        at = s.attributes
        seen = (at[ARM_ATTRIBUTE], at["tracerl.upstream"], at["tracerl.policy_version"])
        assert seen in ((SERVING, a.url, 5), (CANDIDATE, b.url, 6)), (
            seen
        )  # exact version from the server itself
        by_trace.setdefault(format(s.context.trace_id, "032x"), set()).add(seen)
    assert set(by_trace) == set(tids) and all(len(v) == 1 for v in by_trace.values())  # sticky
    on_candidate = sum(next(iter(v))[0] == CANDIDATE for v in by_trace.values())
    assert within_binomial(on_candidate, len(tids), 0.3), on_candidate


@pytest.mark.slow  # starts the bench's upstream and gateway processes
def test_the_gateway_bench_measures_canary_routing_against_plain_proxying():
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--calls",
            "0",
            "--sweep",
            "8",
            "--canary",
            "0.5",
            "--seconds",
            "1",
            "--tokens",
            "2",
            "--token-ms",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "routing decision:" in out and "us CPU per call" in out
    ab = next(
        line
        for line in out.splitlines()
        if line.strip().startswith("8 clients: plain p50") and "err)" in line
    )
    assert " 0 err)" in ab and ab.count(" 0 err") == 2, ab
    one = next(
        line
        for line in out.splitlines()
        if line.strip().startswith("8 clients: plain p50") and "routed" in line
    )
    assert one.count(" 0 err)") == 2, one  # routed and plain calls in one gateway process


def test_an_arm_whose_upstream_serves_other_versions_but_not_its_own_is_refused_not_mislabelled(spans):
    def handle(h, body):
        h.send_json(200, chat_answer(body["model"]))

    up = scripted_upstream(handle)
    up.handler_class.do_GET = lambda h: h.send_json(  # lists policy@6 only (policy@5 unloaded)
        200,
        {
            "object": "list",
            "data": [{"id": "policy", "object": "model"}, {"id": "policy@6", "object": "model"}],
        },
    )
    gw = canary_gateway(spans, up, up, 0.0)  # everything to the serving arm, policy@5
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions", json={"model": "policy", "messages": MSGS}, timeout=30
        )
        assert r.status_code == 502 and "policy@5" in r.json()["error"]["message"]
        ok = httpx.post(
            gw.url + "/v1/chat/completions", json={"model": "policy@6", "messages": MSGS}, timeout=30
        )
        assert ok.status_code == 200 and up.handler_class.bodies[-1]["model"] == "policy@6"
        got = wait_for(lambda: len(spans.get_finished_spans()) >= 2 and spans.get_finished_spans())
    finally:
        gw.stop()
        up.shutdown()
    assert got[0].attributes["error.type"] == "canary_version_missing"
    assert (got[1].attributes[ARM_ATTRIBUTE], got[1].attributes["tracerl.policy_version"]) == (CANDIDATE, 6)


def test_gateway_command_refuses_a_half_configured_canary_with_the_fix(capsys):
    from tracerl.cli import main

    arms = ["--upstream-for", "policy@5=http://127.0.0.1:1", "policy@6=http://127.0.0.1:2"]
    assert main(["gateway", "--canary", "0.2", "--upstream-for", "policy@5=http://127.0.0.1:1"]) == 2
    assert "exactly two versions" in capsys.readouterr().err
    assert main(["gateway", *arms]) == 2
    assert "--canary FRACTION and --upstream-for" in capsys.readouterr().err
    assert main(["gateway", "--canary", "1.5", *arms]) == 2
    assert "[0, 1]" in capsys.readouterr().err
    assert main(["gateway", "--canary", "0.2", "--workers", "2", *arms]) == 2
    assert "--workers 1" in capsys.readouterr().err
    assert main(["gateway", "--canary", "0.2", "--upstream-for", "policy=http://127.0.0.1:1"]) == 2
    assert "NAME@k" in capsys.readouterr().err


@pytest.mark.slow  # starts `tracerl gateway` as a process
def test_the_gateway_command_routes_a_canary_and_takes_the_promote_from_its_endpoint():
    from tracerl_testing import free_port, start_tracerl

    a, b = identifying_upstream(), identifying_upstream()
    port = free_port()
    gw = start_tracerl(
        "gateway",
        "--listen",
        f"127.0.0.1:{port}",
        "--canary",
        "0.25",
        "--upstream-for",
        f"policy@5={a.url}",
        f"policy@6={b.url}",
        "--otlp",
        f"http://127.0.0.1:{free_port()}",
        health=f"http://127.0.0.1:{port}/health",
    )
    url = f"http://127.0.0.1:{port}"
    tids = trace_ids(120, 4)
    try:
        with httpx.Client(timeout=30) as c:
            for tid in tids:
                for _ in range(2):
                    r = c.post(
                        url + "/v1/chat/completions",
                        json={"model": "policy", "messages": MSGS},
                        headers={"traceparent": traceparent(tid)},
                    )
                    assert r.status_code == 200, r.text
            state = c.get(url + "/v1/canary").json()
            assert state["fraction"] == 0.25 and state["candidate"]["version"] == "policy@6"
            assert c.post(url + "/v1/canary", json={"fraction": 1.0}).json()["fraction"] == 1.0
            before = len(b.seen)
            for tid in tids[:10]:
                c.post(
                    url + "/v1/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"traceparent": traceparent(tid)},
                )
            assert len(b.seen) == before + 10  # promoted: every new call to the candidate
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        a.shutdown()
        b.shutdown()
    on_b = set(b.seen[:before])
    assert not on_b & set(a.seen) and on_b == {t for t in tids if arm_for(t, 0.25) == CANDIDATE}
    assert within_binomial(len(on_b), len(tids), 0.25)
