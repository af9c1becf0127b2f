"""tracerl/stack.py: the one way the demo, the examples and the tests start collect, serve and gateway."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tracerl_testing import tracerl

from schemas.attributes import RESPONSE_TOKEN_IDS
from store.location import parse_store
from store.views import connect_readonly
from tracerl.stack import StackConfig, StackPorts, resolve_ports, running_stack, stack_argvs
from tracerl.supervisor import BIN, ChildError

TRACERL = str(BIN / "tracerl")


def test_the_gateway_fronts_the_started_server_and_exports_to_the_collectors_grpc_port(tmp_path):
    cfg = StackConfig(
        store="s3://b/p",
        logs=tmp_path,
        model="/m",
        collect_args=("--convert",),
        serve_args=("--threads", "1"),
        gateway_args=("--models-ttl-s", "0.5"),
    )
    argvs = stack_argvs(cfg, StackPorts(grpc=1001, http=1002, serve=1003, gateway=1004))
    assert list(argvs) == ["collect", "serve", "gateway"]  # start order; stopped in reverse
    assert argvs["collect"] == [
        TRACERL,
        "collect",
        "--store",
        "s3://b/p",
        "--grpc",
        "127.0.0.1:1001",
        "--http",
        "127.0.0.1:1002",
        "--convert",
    ]
    assert argvs["serve"] == [
        TRACERL,
        "serve",
        "--engine",
        "embedded",
        "--model",
        "/m",
        "--listen",
        "127.0.0.1:1003",
        "--threads",
        "1",
    ]
    assert argvs["gateway"] == [
        TRACERL,
        "gateway",
        "--upstream",
        "http://127.0.0.1:1003",
        "--listen",
        "127.0.0.1:1004",
        "--otlp",
        "http://127.0.0.1:1001",
        "--models-ttl-s",
        "0.5",
    ]


def test_a_running_server_is_fronted_not_started(tmp_path):
    cfg = StackConfig(store="st", logs=tmp_path, server="http://10.0.0.7:8000/", engine="vllm")
    argvs = stack_argvs(cfg, StackPorts(grpc=1, http=2, gateway=4))
    assert "serve" not in argvs
    assert argvs["gateway"][argvs["gateway"].index("--upstream") + 1] == "http://10.0.0.7:8000"


def test_a_stack_with_neither_model_nor_server_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model to serve, or the URL of a running server"):
        stack_argvs(StackConfig(store="st", logs=tmp_path), StackPorts(1, 2, 3, 4))


def test_free_ports_fill_only_the_zeros_and_never_repeat():
    got = resolve_ports(StackPorts(grpc=0, http=0, serve=0, gateway=0), with_server=True)
    assert len({got.grpc, got.http, got.serve, got.gateway}) == 4 and 0 not in (got.grpc, got.serve)
    kept = resolve_ports(StackPorts(grpc=0, http=5555, serve=0, gateway=0), with_server=False)
    assert kept.http == 5555 and kept.serve == 0 and kept.grpc not in (0, 5555)


@pytest.mark.slow
def test_init_model_then_the_stack_answers_a_first_chat_and_stores_its_token_span(tmp_path: Path):
    """The newcomer's path: ``tracerl init-model DIR`` (tiny, random weights) then ``tracerl serve --engine
    embedded`` behind the gateway; the first chat request is answered (a past review saw it crash), its exact
    token ids reach the store through the collector, and every process exits cleanly on the stack's SIGTERM."""
    model = tmp_path / "tiny"
    tracerl("init-model", str(model))
    cfg = StackConfig(
        store=str(tmp_path / "store"),
        logs=tmp_path / "logs",
        model=str(model),
        collect_args=("--segment-age-s", "0.2"),
        serve_args=("--threads", "1"),
        serve_timeout_s=120,
    )
    with running_stack(cfg) as stack:
        chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        direct = httpx.post(f"{stack.urls.server}/v1/chat/completions", json=chat, timeout=60)
        assert direct.status_code == 200, direct.text
        assert direct.json()["choices"][0]["finish_reason"] in ("length", "stop")
        via = httpx.post(f"{stack.urls.gateway}/v1/chat/completions", json=chat, timeout=60)
        assert via.status_code == 200, via.text
        assert via.json()["usage"]["completion_tokens"] >= 1
    assert {n: c.proc.returncode for n, c in stack.started.items()} == {
        "collect": 0,
        "serve": 0,
        "gateway": 0,
    }
    con = connect_readonly(parse_store(tmp_path / "store"))
    ids = con.execute(
        f"SELECT attributes['{RESPONSE_TOKEN_IDS}'] FROM spans "
        f"WHERE attributes['{RESPONSE_TOKEN_IDS}'] IS NOT NULL"
    ).fetchall()
    assert len(ids) == 1 and len(json.loads(ids[0][0])) == via.json()["usage"]["completion_tokens"]


@pytest.mark.slow
def test_a_server_that_cannot_start_names_itself_and_leaves_nothing_running(tmp_path: Path):
    cfg = StackConfig(
        store=str(tmp_path / "store"),
        logs=tmp_path / "logs",
        model=str(tmp_path / "no-model"),
        serve_timeout_s=120,
    )
    ran = False
    with pytest.raises(ChildError, match="`tracerl serve` exited with code 2") as err, running_stack(cfg):
        ran = True
    assert not ran  # start_stack raised before the block
    assert "no-model has no config.json" in str(err.value)  # the log's tail: serve's own message and fix
    # the collector, started first, was stopped (and waited for) on the way out, cleanly: nothing orphaned
    assert "tracerl collect: stopped" in (tmp_path / "logs" / "collect.log").read_text()
