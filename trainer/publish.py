"""Announce a new checkpoint to the serving engine, behind one small callable (``rounds.Publisher``).

The trainer only knows ``Publisher = Callable[[PublishRequest], None]``: it raises when the
engine did not take the new policy, and the round then stays ``trained`` until a later run
publishes it. Tests inject a recording callable; ``tracerl train --server URL`` uses
``server_publisher``, which delegates the HTTP to the serving package's vLLM client
(``serving.vllm.publish``: httpx only, no torch and no vLLM).

How a checkpoint is published (``--publish``):

* ``lora``: a LoRA checkpoint is loaded by name (vLLM ``POST /v1/load_lora_adapter``); a full one
  by a weight reload (``collective_rpc reload_weights``);
* ``full``: a LoRA checkpoint is merged into the base weights first (``trainer.merge``), then
  reloaded in place like a full one: the served name stays ``policy`` and the gateway reads the
  version from ``/weight_info``;
* ``auto`` (default): ``full`` for a vLLM that says it runs on a CPU (``/server_info``), where an
  adapter costs about 4x the decode speed and a reload under a second; ``lora`` elsewhere.

A full reload that fails restores the weights that were serving (``PublishRequest.previous``).
Several replicas (``--server URL,URL``, the gateway's ``--upstream`` list) each get the new
policy; the round counts as published only when every replica took it, and publishing again is
safe (a replica that already has ``policy@k`` answers as vLLM does and is skipped).
"""

from __future__ import annotations

from serving.vllm.publish import VLLMPublisher, publish_policy
from trainer.choices import PUBLISH_MODES as MODES
from trainer.merge import merge_adapter
from trainer.rounds import Publisher, PublishRequest, TrainError


def server_urls(value: str) -> list[str]:
    """``--server URL[,URL...]`` -> the replica URLs, in order, without blanks or duplicates."""
    urls = list(dict.fromkeys(u.strip().rstrip("/") for u in value.split(",") if u.strip()))
    if not urls:
        raise TrainError(f"--server {value!r} names no URL; give e.g. --server http://127.0.0.1:8000")
    return urls


def choose_mode(mode: str, adapter: bool, device: str | None) -> str:
    """``lora`` or ``full`` for one replica: a full checkpoint is always reloaded whole; an adapter
    follows ``mode``, and ``auto`` merges it where the engine runs on a CPU."""
    if mode not in MODES:
        raise TrainError(f"--publish {mode!r} is not one of {', '.join(MODES)}")
    if not adapter:
        return "full"
    if mode == "auto":
        return "full" if device == "cpu" else "lora"
    return mode


def server_publisher(url: str, mode: str = "auto") -> Publisher:
    """A publisher for the server(s) at ``url`` (comma-separated replicas)."""
    urls = server_urls(url)
    choose_mode(mode, adapter=True, device=None)  # a bad mode fails before the first round trains

    def publish(req: PublishRequest) -> None:
        for u in urls:  # a failure leaves the round `trained`; the next run publishes to every replica again
            device = VLLMPublisher(u).device() if req.adapter and mode == "auto" else None
            how = choose_mode(mode, req.adapter, device)
            path = req.checkpoint_path
            if how == "full" and req.adapter:
                path = merge_adapter(req.base_model, req.checkpoint_path)
            publish_policy(u, req.name, str(path), adapter=how == "lora", base_model=str(req.base_model),
                           restore_from=str(req.previous) if req.previous else None)

    return publish

