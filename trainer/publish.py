"""Announce a new checkpoint to the serving engine, behind one small callable (``rounds.Publisher``).

The trainer only knows ``Publisher = Callable[[PublishRequest], None]``: it raises when the
engine did not take the new policy, and the round then stays ``trained`` until a later run
publishes it. Tests inject a recording callable; ``tracerl train --server URL`` uses
``server_publisher``, which delegates to the serving package's vLLM client (``serving.publish``):
a LoRA checkpoint is loaded by name (vLLM ``POST /v1/load_lora_adapter``), a full one by a weight
reload (``collective_rpc reload_weights``), and the embedded server accepts the same calls.
Several replicas (``--server URL,URL``, the gateway's ``--upstream`` list) each get the new
policy; the round counts as published only when every replica took it, and publishing again is
safe (a replica that already has ``policy@k`` answers as vLLM does and is skipped).
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer.rounds import Publisher, PublishRequest, TrainError


def server_urls(value: str) -> list[str]:
    """``--server URL[,URL...]`` -> the replica URLs, in order, without blanks or duplicates."""
    urls = list(dict.fromkeys(u.strip().rstrip("/") for u in value.split(",") if u.strip()))
    if not urls:
        raise TrainError(f"--server {value!r} names no URL; give e.g. --server http://127.0.0.1:8000")
    return urls


def server_publisher(url: str) -> Publisher:
    """A publisher for the server(s) at ``url`` (comma-separated replicas), built on ``serving.publish``
    (imported lazily)."""
    try:
        client_mod: Any = importlib.import_module("serving.publish")
    except ImportError as e:
        raise TrainError(f"--server {url} needs serving.publish, which is not importable ({e}); "
                         "train without --server and publish later, or install the serving package") from e
    fn = getattr(client_mod, "publish_policy", None)
    if fn is None:
        raise TrainError("serving.publish has no publish_policy(url, name, path, *, adapter, base_model); "
                         "the trainer's publisher adapter (trainer/publish.py) needs updating")

    urls = server_urls(url)

    def publish(req: PublishRequest) -> None:
        for u in urls:  # a failure leaves the round `trained`; the next run publishes to every replica again
            fn(u, req.name, str(req.checkpoint_path), adapter=req.adapter, base_model=str(req.base_model))

    return publish
