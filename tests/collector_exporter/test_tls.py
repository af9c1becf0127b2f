"""TLS on both receivers, with the token on top: what a deployment off-loopback should run."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly

from .helpers import trace_request

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")]


@pytest.fixture
def cert(tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return crt, key


def test_tls_with_token_on_grpc_and_http(store, cert):
    crt, key = cert
    with running_collector(store, tls_cert=str(crt), tls_key=str(key), token="t0k") as c:
        assert c.grpc_endpoint.startswith("https://") and c.http_endpoint.startswith("https://")
        creds = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
        with grpc.secure_channel(c.grpc_endpoint.removeprefix("https://"), creds) as ch:
            export = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                    request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString)
            export(trace_request(2).SerializeToString(), metadata=(("authorization", "Bearer t0k"),), timeout=10)
        r = httpx.post(c.http_endpoint + "/v1/traces", content=trace_request(3).SerializeToString(), verify=ssl.create_default_context(cafile=str(crt)),
                       headers={"Content-Type": "application/x-protobuf", "Authorization": "Bearer t0k"})
        assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # plain HTTP to a TLS port, or an untrusted certificate
            httpx.post(c.http_endpoint + "/v1/traces", content=b"", verify=True)
        c.flush()
    assert connect_readonly(parse_store(store)).execute("SELECT count(*) FROM spans").fetchone()[0] == 5


def test_an_idle_connection_does_not_block_other_https_clients(store, cert):
    """The stdlib server ran the TLS handshake in its accept loop: one silent socket made every
    HTTPS client wait until it closed. Handshakes now run in the event loop, beside each other."""
    crt, key = cert
    with running_collector(store, tls_cert=str(crt), tls_key=str(key), grpc=None) as c:
        host, port = c.http_endpoint.removeprefix("https://").split(":")
        with socket.create_connection((host, int(port))), socket.create_connection((host, int(port))):
            # Two idle sockets, no handshake: the request below must not wait for them (the
            # stdlib server answered only after they closed, so this would time out).
            r = httpx.post(c.http_endpoint + "/v1/traces", content=trace_request(2).SerializeToString(),
                           verify=ssl.create_default_context(cafile=str(crt)), timeout=20,
                           headers={"Content-Type": "application/x-protobuf"})
            assert r.status_code == 200
