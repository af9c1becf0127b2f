"""The gateway's upstream client (serving/gateway/upstream.py): TLS only where an upstream speaks https, with
certifi's trust store, and an https upstream whose certificate is not trusted refused, never used unverified."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import pytest

from httpshell import ServerOptions
from serving.asgi import ShellServer, json_response
from serving.gateway.upstream import UpstreamClient

from .test_gateway import MSGS, gateway, one_span


def test_plain_http_builds_no_tls_context_and_https_gets_one_verifying_context():
    client = UpstreamClient(timeout_s=5, connect_timeout_s=1, max_connections=4)
    assert client.tls("http://127.0.0.1:8000/v1/chat/completions") is True
    assert client._tls is None, "a local http engine never pays for reading the CA bundle"
    ctx = client.tls("https://engine.example:8443/v1/chat/completions")
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 10, "certifi's bundle is loaded"
    assert client.tls("https://other.example/v1/models") is ctx, "built once"


class _Answers(ShellServer):
    """An https upstream that would answer every request (it must never be reached unverified)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await json_response(200, {"object": "list", "data": []})(scope, receive, send)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_an_https_upstream_with_an_untrusted_certificate_is_refused_with_a_502(spans, tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1"
    subprocess.run([*cmd.split(), "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    up = _Answers(ServerOptions(tls_cert=str(crt), tls_key=str(key), name="tls-upstream")).start_background()
    try:
        assert up.url.startswith("https://")
        with gateway(spans, up.url) as gw:
            r = httpx.post(
                gw.url + "/v1/chat/completions", json={"model": "policy", "messages": MSGS}, timeout=30
            )
    finally:
        up.stop()
    assert r.status_code == 502
    assert "certificate" in r.json()["error"]["message"].lower()
    assert one_span(spans).attributes["error.type"] == "ConnectError"


def _cycle_freed(timeout_s: float = 5.0, extra: int = 0) -> bool:
    """Make one garbage reference cycle (plus ``extra`` tracked objects that stay alive meanwhile) and wait
    for the collector to free it: True when it did within ``timeout_s``."""
    import time
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    alive = [[] for _ in range(extra)]
    deadline = time.monotonic() + timeout_s
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    del alive
    return gone() is None


def test_a_gateway_process_hands_the_gil_back_quickly_and_collects_garbage_off_the_serving_path():
    """``tune_for_relaying`` (what ``tracerl gateway`` calls once serving): the switch interval bounds how long
    the serving loop waits for the GIL while the span exporter encodes; no automatic GC pass stalls the loop,
    and garbage cycles are still freed by calm_gc's thread: on its timer (here every 50 ms), and before it once
    the tracked objects grew past its threshold."""
    import gc
    import sys

    from serving.gateway.workers import GIL_SWITCH_S, calm_gc, tune_for_relaying

    before = sys.getswitchinterval()
    stops = []
    try:
        stops.append(tune_for_relaying())
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S) and before > GIL_SWITCH_S
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        assert not _cycle_freed(timeout_s=1.5), "a cycle was collected while no collection was due"
        stops[-1].set()
        stops.append(calm_gc(every_s=0.05))
        assert _cycle_freed(), "the timer's collection did not free a garbage cycle"
        stops[-1].set()
        stops.append(calm_gc(every_s=3600, at_objects=20_000))
        assert _cycle_freed(extra=30_000), "growth past at_objects did not start a collection"
    finally:
        for stop in stops:
            stop.set()
        sys.setswitchinterval(before)
        gc.unfreeze()
        gc.enable()


def test_a_cookie_the_upstream_sets_for_one_client_is_not_sent_with_the_next_clients_call(spans):
    from .helpers import chat_answer, scripted_upstream

    def handle(h, body):
        h.send_json(200, chat_answer(body["model"]), headers={"Set-Cookie": "session=client-a; Path=/"})

    up = scripted_upstream(handle)
    try:
        # by name: aiohttp's default jar keeps no cookie from an IP address, so 127.0.0.1 would hide a shared jar
        with gateway(spans, up.url.replace("127.0.0.1", "localhost")) as gw:
            for who in ("a", "b"):
                r = httpx.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": "policy", "messages": MSGS},
                    headers={"X-Request-Id": who},
                    timeout=30,
                )
                assert r.status_code == 200
    finally:
        up.stop()
    assert [h.get("X-Request-Id") for h in up.handler_class.seen_headers] == ["a", "b"]
    assert all("Cookie" not in h for h in up.handler_class.seen_headers), up.handler_class.seen_headers


def test_the_upstreams_model_list_is_renewed_before_it_expires_so_no_call_waits_for_it(spans):
    """Each call looks up the served names (``models_ttl_s`` cache); at one stream every fifth call waited for
    the two reads. Past 80 % of its time the state is read again in the background while still served."""
    import asyncio
    import time

    from serving.gateway.proxy import Gateway, GatewayConfig

    gets: list[str] = []

    class SlowUpstream:  # the gateway's upstream client, answering each GET after 100 ms
        async def get(self, url, headers):
            gets.append(url.rsplit("/", 1)[1])
            await asyncio.sleep(0.1)
            if url.endswith("/v1/models"):
                return 200, "application/json", b'{"data": [{"id": "policy@%d"}]}' % len(gets)
            return 200, "application/json", b'{"weight_version": "3"}'

    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=["http://up:1"], models_ttl_s=1.0), spans.provider)
    gw.states.client = SlowUpstream()

    async def timed() -> tuple[float, list[str]]:
        t = time.monotonic()
        state = await gw.states.get("http://up:1", {})
        return time.monotonic() - t, state.names

    async def main() -> list[tuple[float, list[str]]]:
        first = await timed()  # nothing cached: this call waits for both reads
        await asyncio.sleep(0.9)  # 90 % of models_ttl_s
        served_while_renewing = await timed()
        await asyncio.sleep(
            0.35
        )  # past the first state's 1 s (the renewal took 0.2 s): the renewed one is served
        return [first, served_while_renewing, await timed()]

    (w0, n0), (w1, n1), (w2, n2) = asyncio.run(main())
    assert w0 >= 0.2 and n0 == ["policy@1"]
    assert w1 < 0.05 and n1 == ["policy@1"], "the aging state is served at once"
    assert w2 < 0.05 and n2 == ["policy@3"], f"the call after expiry waited {w2 * 1e3:.0f} ms"
    assert gets == ["models", "weight_info", "models", "weight_info"]
