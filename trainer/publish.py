"""Announce a new checkpoint to the serving engine, behind one small callable (``publish_step.Publisher``).

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

A canary (``tracerl train --canary --server A,B``) is different: the two servers are its two arms,
not replicas. A full-weight round is reloaded only into the server that is not serving the version
it trained from (``canary_target``, from each server's ``/weight_info`` tag), so the serving arm
never pauses; round after round the two trade places, and ``tracerl promote`` tells the gateway
which now serves what. An adapter round is loaded by name everywhere (two adapters share a server).
"""

from __future__ import annotations

from collections.abc import Callable

from serving.gateway.canary import serves
from serving.vllm.publish import VLLMPublisher, publish_policy
from trainer.choices import PUBLISH_MODES as MODES
from trainer.merge import merge_adapter
from trainer.publish_step import GateVerdict, Publisher, PublishRequest
from trainer.rounds import TrainError


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


def mode_chooser(mode: str) -> Callable[[str, PublishRequest], str]:
    """``how(url, req)``: ``lora`` or ``full`` for one round on one replica (``choose_mode``), each replica's
    device asked once when known: vLLM's GET /server_info serializes its whole config, 0.6 s of every demo
    round's publish on 2 busy cores, for an answer that does not change. An unknown one is asked again."""
    devices: dict[str, str] = {}

    def how(url: str, req: PublishRequest) -> str:
        if req.adapter and mode == "auto":
            if url not in devices and (device := VLLMPublisher(url).device()) is not None:
                devices[url] = device
            return choose_mode(mode, True, devices.get(url))
        return choose_mode(mode, req.adapter, None)

    return how


def server_publisher(url: str, mode: str = "auto") -> Publisher:
    """A publisher for the server(s) at ``url`` (comma-separated replicas)."""
    urls = server_urls(url)
    choose_mode(mode, adapter=True, device=None)  # a bad mode fails before the first round trains
    how = mode_chooser(mode)

    def publish(req: PublishRequest) -> None:
        for u in urls:  # a failure leaves the round `trained`; the next run publishes to every replica again
            publish_to(u, req, how(u, req))

    return publish


def publish_to(url: str, req: PublishRequest, how: str) -> None:
    """Publish one round to one server: by name (``how`` lora) or by a weight reload (merged first if an
    adapter)."""
    path = req.checkpoint_path
    if how == "full" and req.adapter:
        path = merge_adapter(req.base_model, req.checkpoint_path)
    publish_policy(
        url,
        req.name,
        str(path),
        adapter=how == "lora",
        base_model=str(req.base_model),
        restore_from=str(req.previous) if req.previous else None,
    )


def weight_tag(url: str) -> str | None:
    """A server's full-weight version tag (``/weight_info``; None: untouched since it started)."""
    import httpx

    try:
        r = httpx.get(url + "/weight_info", timeout=10.0)
    except httpx.HTTPError as e:
        raise TrainError(
            f"canary server {url} unreachable ({type(e).__name__}: {e}); is `tracerl serve` up?"
        ) from e
    if r.status_code != 200:
        raise TrainError(
            f"canary server {url} answered {r.status_code} to /weight_info; a canary over two "
            "servers needs their version tags (vLLM: VLLM_SERVER_DEV_MODE=1, tracerl serve's default)"
        )
    v = r.json().get("weight_version")
    return None if v is None else str(v)


def canary_target(tags: dict[str, str | None], serving: int) -> str:
    """The server a canary round reloads: the first one not serving ``policy@serving`` (by its weight
    tag; an untouched server, tagged none or vLLM's ``"default"``, serves policy@0), or, when every one serves it (the start), the last one, so the gateway's
    serving arm (the first that serves it) keeps its server."""

    free = [u for u, tag in tags.items() if not serves(f"policy@{serving}", [], tag)]
    if len(free) == len(tags):
        raise TrainError(
            f"no canary server serves policy@{serving}, the version this round trained from "
            f"(tags {tags}); reloading one would leave the serving arm without its weights. "
            f"Publish policy@{serving} to one of them, or pass the servers the gateway uses"
        )
    return free[0] if free else list(tags)[-1]


def canary_publisher(
    url: str,
    mode: str = "auto",
    *,
    read_tag: Callable[[str], str | None] = weight_tag,
    publish_one: Callable[[str, PublishRequest, str], None] = publish_to,
) -> Publisher:
    """``--canary --server A,B``: each round goes to the server not serving its parent (module docstring)."""
    urls = server_urls(url)
    choose_mode(mode, adapter=True, device=None)
    chooser = mode_chooser(mode)

    def publish(req: PublishRequest) -> None:
        how = chooser(urls[0], req)
        if how == "lora":  # adapters by name: the serving one is untouched wherever the new one loads
            for u in urls:
                publish_one(u, req, how)
            return
        if len(urls) < 2:
            raise TrainError(
                "a canary of full weights needs two servers, one per arm: --server A,B "
                "(`tracerl serve --second-listen HOST:PORT` starts the second); one server "
                "would replace the serving weights"
            )
        serving = req.serving_version if req.serving_version is not None else req.version - 1
        publish_one(canary_target({u: read_tag(u) for u in urls}, serving), req, how)

    return publish


def gated(publisher: Publisher, gate: Callable[[PublishRequest], GateVerdict]) -> Publisher:
    """``--gate-tasks``: publish the candidate to its server, then run the eval gate (``loop.gate``) on both
    arms; the verdict decides whether the round becomes a canary or is rolled back (``rounds._publish``)."""

    def publish(req: PublishRequest) -> GateVerdict:
        publisher(req)
        try:
            return gate(req)
        except (ValueError, RuntimeError, OSError) as e:
            raise TrainError(
                f"the eval gate for {req.name} could not run ({e}); the round stays 'trained' and the "
                "next run publishes and gates it again"
            ) from e

    return publish
