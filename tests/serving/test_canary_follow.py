"""The gateway follows the canary round after round with no restart: POST /v1/canary names the new
pair of versions, the gateway finds them on its two servers (which trade places), calls in flight
end where they began and every span says where that was."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from weights_rig import weights_server

from serving.gateway.canary import (
    ARM_ATTRIBUTE,
    CANDIDATE,
    SERVING,
    arm_for,
    parse_canary_post,
    resolve_route,
    serves,
)
from serving.gateway.proxy import Gateway, GatewayConfig

from .helpers import chat_answer, scripted_upstream, wait_for
from .test_canary_routing import trace_ids, traceparent

MSGS = [{"role": "user", "content": "hi"}]


def test_a_server_serves_a_version_by_adapter_name_by_weight_tag_or_as_the_untouched_base():
    assert serves("policy@7", ["policy", "policy@7"], None)  # LoRA adapter by name
    assert serves("policy@7", ["policy"], "7") and not serves("policy@7", ["policy"], "6")
    assert serves("policy@0", ["policy"], None) and not serves("policy@1", ["policy"], None)
    assert serves("policy@0", ["policy"], "default") and not serves(
        "policy@1", [], "default"
    )  # vLLM, unreloaded


def test_resolve_puts_each_version_on_the_server_that_serves_it_and_shares_one_only_for_lora():
    a, b = "http://a", "http://b"
    r = resolve_route({a: (["policy"], "7"), b: (["policy"], "6")}, "policy@6", "policy@7", 0.2)
    assert (r.serving.upstream, r.candidate.upstream, r.fraction) == (b, a, 0.2)
    # both untouched at the start: serving keeps the first, the candidate is looked for apart from it
    r = resolve_route({a: (["policy"], None), b: (["policy"], "1")}, "policy@0", "policy@1", 0.2)
    assert (r.serving.upstream, r.candidate.upstream) == (a, b)
    # one vLLM with both adapters: the same server for both arms
    lora = {a: (["policy", "policy@3", "policy@4"], None)}
    r = resolve_route(lora, "policy@3", "policy@4", 0.5)
    assert r.serving.upstream == r.candidate.upstream == a
    with pytest.raises(LookupError, match=r"no canary server serves policy@9 .*http://a: names"):
        resolve_route({a: (["policy"], "7")}, "policy@7", "policy@9", 0.2)
    with pytest.raises(ValueError, match="higher version"):
        resolve_route({a: (["policy"], "7"), b: (["policy"], "6")}, "policy@7", "policy@6", 0.2)


def test_canary_post_bodies_parse_and_bad_ones_name_the_fix():
    assert parse_canary_post({"fraction": 1}) == (1.0, None)
    assert parse_canary_post({"serving": "policy@6", "candidate": "policy@7"}) == (
        None,
        ("policy@6", "policy@7"),
    )
    for bad, why in (
        ({}, "nothing to change"),
        ([1], "JSON object"),
        ({"fraction": "x"}, "fraction 'x'"),
        ({"fraction": 2}, r"\[0, 1\]"),
        ({"serving": "policy", "candidate": "policy@7"}, "NAME@k"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_canary_post(bad)


def test_promote_then_a_new_round_then_rollback_the_gateway_follows_without_a_restart(spans):
    a, b = weights_server("5", 0.2), weights_server("6", 0.2)
    cfg = GatewayConfig(canary=0.2, upstream_for={"policy@5": a.url, "policy@6": b.url})
    gw = Gateway(("127.0.0.1", 0), cfg, spans.provider).start_background()
    tids = trace_ids(30, 7)
    sent = [0]
    try:
        with httpx.Client(timeout=30) as c, ThreadPoolExecutor(30) as pool:

            def post(tid: str) -> int:
                r = c.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"traceparent": traceparent(tid)},
                )
                return r.status_code

            def switch(body: dict) -> dict:
                """Calls in flight on both arms while the gateway is told ``body``."""
                flying = [pool.submit(post, t) for t in tids]
                time.sleep(0.05)
                r = c.post(gw.url + "/v1/canary", json=body)
                assert r.status_code == 200, r.text
                assert all(f.result() == 200 for f in flying)  # none lost
                sent[0] += len(tids)
                # every span ended (its version read after the call) before a test "reload" re-tags
                wait_for(lambda: len(spans.get_finished_spans()) >= sent[0])
                return r.json()

            got = switch({"fraction": 1.0})  # round 5 promoted: policy@6 on b takes every rollout
            assert (got["candidate"]["upstream"], got["fraction"]) == (b.url, 1.0)
            a.weights.tag = "7"  # the next round reloads the server not serving (a) with policy@7
            # a real reload pauses the server, which the gateway waits out; this stand-in re-tags at once, so
            # wait until no call can be sent on a version read from before it (reads are reused this long)
            time.sleep(2 * cfg.version_max_age_s)
            got = switch({"serving": "policy@6", "candidate": "policy@7"})
            assert (got["serving"]["upstream"], got["candidate"]["upstream"]) == (b.url, a.url)
            assert got["fraction"] == 0.2  # a new candidate starts at --canary's share
            got = switch({"fraction": 0.0})  # policy@7 rolled back: b keeps serving policy@6
            assert got["fraction"] == 0.0
            a.weights.tag = "8"  # the round after trains from policy@6 and reloads a again
            time.sleep(2 * cfg.version_max_age_s)
            got = switch({"serving": "policy@6", "candidate": "policy@8"})
            assert (got["serving"]["version"], got["candidate"]["upstream"]) == ("policy@6", a.url)
            assert all(post(t) == 200 for t in tids)
            nowhere = c.post(gw.url + "/v1/canary", json={"serving": "policy@6", "candidate": "policy@9"})
            assert nowhere.status_code == 409 and "no canary server serves policy@9" in nowhere.text
            assert c.get(gw.url + "/v1/canary").json()["candidate"]["version"] == "policy@8"  # unchanged
        n = 5 * len(tids)
        done = wait_for(lambda: len(spans.get_finished_spans()) >= n and spans.get_finished_spans())
    finally:
        gw.stop()
        a.stop()
        b.stop()
    ran = {"a": a.weights.ran, "b": b.weights.ran}
    assert sum(map(len, ran.values())) == n  # every call ran exactly once
    tag_of = {a.url: a.weights, b.url: b.weights}
    for s in done:  # each span's arm, upstream and version are where the call ran, with its weights
        at = s.attributes
        arm, up, v = at[ARM_ATTRIBUTE], at["tracerl.upstream"], at["tracerl.policy_version"]
        tid = format(s.context.trace_id, "032x")
        assert up in tag_of and arm in (SERVING, CANDIDATE)
        assert (tid, str(v)) in tag_of[up].ran  # the version label is the weights that served it
    # the last batch (share 0.2 of the new pair): its candidate rollouts ran on a as policy@8
    on_a_8 = {t for t, tag in a.weights.ran if tag == "8"}
    assert on_a_8 == {t for t in tids if arm_for(t, 0.2) == CANDIDATE}


def test_serve_refuses_a_second_server_on_the_same_or_an_unfixed_port(tmp_path, capsys):
    from tracerl.cli import main

    (tmp_path / "config.json").write_text("{}")
    for second in ("127.0.0.1:8000", "127.0.0.1:0"):
        args = ["serve", "--engine", "embedded", "--model", str(tmp_path), "--second-listen", second]
        assert main(args) == 2
        assert "--second-listen" in capsys.readouterr().err


def test_one_lora_server_serves_the_untouched_base_as_policy_0_beside_the_candidate_adapter(spans):
    def handle(h, body):
        h.send_json(200, chat_answer(body["model"]))

    up = scripted_upstream(handle)  # the base model plus the policy@1 adapter, no weight tag
    listing = {"object": "list", "data": [{"id": "policy"}, {"id": "policy@1"}]}
    up.handler_class.do_GET = lambda h: h.send_json(200, listing)
    cfg = GatewayConfig(canary=0.5, upstream_for={"policy@0": up.url, "policy@1": up.url})
    gw = Gateway(("127.0.0.1", 0), cfg, spans.provider).start_background()
    tids = trace_ids(20, 21)
    try:
        with httpx.Client(timeout=30) as c:
            for tid in tids:
                r = c.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"traceparent": traceparent(tid)},
                )
                assert r.status_code == 200, r.text
        got = wait_for(lambda: len(spans.get_finished_spans()) >= 20 and spans.get_finished_spans())
    finally:
        gw.stop()
        up.shutdown()
    sent = [b["model"] for b in up.handler_class.bodies]
    assert sent == ["policy@1" if arm_for(t, 0.5) == CANDIDATE else "policy" for t in tids]
    for s in got:
        arm = s.attributes[ARM_ATTRIBUTE]
        assert s.attributes["tracerl.policy_version"] == (1 if arm == CANDIDATE else 0)
