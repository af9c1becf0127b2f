"""A canary over two full-weight servers: each round reloads the server that is not serving the
version it trained from, so the serving arm never pauses and the two trade places round after round."""

from __future__ import annotations

from pathlib import Path

import pytest
from weights_rig import weights_server

from trainer.publish import canary_publisher, canary_target, weight_tag
from trainer.rounds import PublishRequest, TrainError

A, B = "http://a", "http://b"


def test_the_target_is_the_server_not_serving_the_parent_and_the_last_one_at_the_start():
    assert canary_target({A: None, B: None}, 0) == B  # both untouched: the gateway serves from A
    assert canary_target({A: "default", B: "default"}, 0) == B  # vLLM's tag before any reload
    assert canary_target({A: None, B: "1"}, 1) == A  # policy@1 promoted on B: reload A
    assert canary_target({A: "2", B: "1"}, 1) == A  # policy@2 rolled back on A: reload A again
    assert canary_target({A: "2", B: "1"}, 2) == B  # policy@2 promoted on A: reload B
    with pytest.raises(TrainError, match="no canary server serves policy@3"):
        canary_target({A: "2", B: "1"}, 3)


def request(version: int, serving: int, adapter: bool = False) -> PublishRequest:
    return PublishRequest(
        name=f"policy@{version}",
        version=version,
        checkpoint_path=Path("/ckpt"),
        adapter=adapter,
        base_model=Path("/base"),
        serving_version=serving,
    )


def test_rounds_alternate_between_two_real_servers_by_their_weight_tags():
    a, b = weights_server(None), weights_server(None)
    published: list[tuple[str, str, str]] = []

    def reload(url: str, req: PublishRequest, how: str) -> None:
        published.append((url, req.name, how))
        {a.url: a, b.url: b}[url].weights.tag = str(req.version)  # what the publisher's reload tags

    try:
        publish = canary_publisher(f"{a.url},{b.url}", "full", publish_one=reload)
        assert weight_tag(a.url) is None
        publish(request(1, 0))  # round 0 canary: b
        publish(request(2, 1))  # policy@1 promoted (serving on b): a
        publish(request(3, 1))  # policy@2 rolled back: round 2 trains from 1, reloads a again
        publish(request(4, 3))  # policy@3 promoted on a: b
    finally:
        a.stop()
        b.stop()
    assert [(u, n) for u, n, _ in published] == [
        (b.url, "policy@1"),
        (a.url, "policy@2"),
        (a.url, "policy@3"),
        (b.url, "policy@4"),
    ]
    with pytest.raises(TrainError, match="unreachable"):
        weight_tag(a.url)


def test_adapters_load_everywhere_and_one_server_cannot_hold_a_full_weight_canary():
    got: list[str] = []
    lora = canary_publisher(f"{A},{B}", "lora", publish_one=lambda u, r, h: got.append(f"{u} {h}"))
    lora(request(2, 1, adapter=True))
    assert got == [f"{A} lora", f"{B} lora"]
    one = canary_publisher(A, "full", publish_one=lambda *a: None, read_tag=lambda u: None)
    with pytest.raises(TrainError, match="needs two servers"):
        one(request(1, 0))
