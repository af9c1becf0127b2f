"""``FakeVLLM``: the publish-related HTTP endpoints of a vLLM server, for ``httpx.MockTransport``.

vLLM cannot be installed on these machines, so the publish client is checked against this fake
and, for real, against ``tracerl serve``. Every answer below follows the vLLM source it cites;
nothing else about vLLM is faked.

* Route registration (vLLM 0.11, ``vllm/entrypoints/openai/api_server.py``): the LoRA routes
  exist only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; ``/collective_rpc``,
  ``/reset_prefix_cache`` only with ``VLLM_SERVER_DEV_MODE``; ``/pause``, ``/resume``,
  ``/is_paused`` (vLLM 0.12+, ``vllm/entrypoints/serve/dev/rlhf/api_router.py``) likewise.
  An unregistered route is FastAPI's 404 ``{"detail": "Not Found"}``.
* ``POST /v1/load_lora_adapter`` (vLLM 0.11, ``vllm/entrypoints/dynamic_lora.py`` +
  ``serving_models.py``): 200 ``text/plain`` "Success: LoRA adapter '{name}' added
  successfully."; 400 ``InvalidUserInput`` "Both 'lora_name' and 'lora_path' must be provided.";
  400 "The lora adapter '{name}' has already been loaded. If you want to load the adapter in
  place, set 'load_inplace' to True."; 404 ``NotFoundError`` "Loading lora {name} failed: No
  adapter found for {path}"; without ``--enable-lora`` the engine's ``add_lora`` raises
  ``RuntimeError("LoRA is not enabled.")`` (``vllm/v1/worker/lora_model_runner_mixin.py``),
  answered as 500 ``InternalServerError``.
* ``POST /v1/unload_lora_adapter``: 200 "Success: LoRA adapter '{name}' removed successfully.";
  404 ``NotFoundError`` "The lora adapter '{name}' cannot be found.".
* ``GET /v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "root",
  "parent", ...}]}``, base model first, then adapters.
* ``POST /collective_rpc`` (vLLM 0.10+): 400 "Missing 'method' in request body";
  ``{"results": [null, ...]}`` per worker when the method returns None.
* ``POST /pause?mode=`` -> ``{"status": "paused"}``; ``POST /resume`` -> ``{"status":
  "resumed"}``; ``GET /is_paused`` -> ``{"is_paused": bool}``; ``POST /reset_prefix_cache`` ->
  200 with an empty body.
* ``POST /update_weight_version {"new_version": str}`` -> ``{"success": true, "new_version"}``
  and ``GET /weight_info`` -> ``{"weight_version"}`` (vLLM main after 0.12, same rlhf router).
* Errors use ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse`` since 0.10.2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class FakeVLLM:
    """State and flags of one fake server; ``handler`` is the MockTransport callable."""

    served_model_name: str = "policy"
    model_path: str = "/models/base"
    allow_runtime_lora_updating: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    enable_lora: bool = True  # --enable-lora
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1
    has_pause: bool = True  # vLLM >= 0.12
    has_weight_version: bool = True  # vLLM main after 0.12: /update_weight_version, /weight_info
    world_size: int = 1
    timeout_paths: dict[str, int] = field(default_factory=dict)  # path -> how many calls time out first
    unavailable_paths: dict[str, int] = field(default_factory=dict)  # path -> how many calls get 503 first
    lost_response_paths: dict[str, int] = field(default_factory=dict)  # path -> calls that run, then time out
    loras: dict[str, str] = field(default_factory=dict)
    paused: bool = False
    weights_path: str | None = None
    weight_version: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.method, path))
        if self.timeout_paths.get(path, 0) > 0:
            self.timeout_paths[path] -= 1
            raise httpx.ReadTimeout("timed out", request=request)
        if self.unavailable_paths.get(path, 0) > 0:
            self.unavailable_paths[path] -= 1
            return _err(503, "Service Unavailable", "ServiceUnavailable")
        routes = {("GET", "/v1/models"): self._models}
        if self.allow_runtime_lora_updating:
            routes[("POST", "/v1/load_lora_adapter")] = self._load
            routes[("POST", "/v1/unload_lora_adapter")] = self._unload
        if self.dev_mode:
            routes[("POST", "/collective_rpc")] = self._rpc
            routes[("POST", "/reset_prefix_cache")] = lambda r: httpx.Response(200)
            if self.has_pause:
                routes[("POST", "/pause")] = self._pause
                routes[("POST", "/resume")] = self._resume
                routes[("GET", "/is_paused")] = lambda r: httpx.Response(200, json={"is_paused": self.paused})
            if self.has_weight_version:
                routes[("POST", "/update_weight_version")] = self._update_weight_version
                routes[("GET", "/weight_info")] = lambda r: httpx.Response(
                    200, json={"weight_version": self.weight_version})
        fn = routes.get((request.method, path))
        if fn is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        response = fn(request)
        if self.lost_response_paths.get(path, 0) > 0:  # the server did the work; the answer was lost
            self.lost_response_paths[path] -= 1
            raise httpx.ReadTimeout("timed out", request=request)
        return response

    def _models(self, _r: httpx.Request) -> httpx.Response:
        data = [{"id": self.served_model_name, "object": "model", "owned_by": "vllm", "root": self.model_path,
                 "parent": None, "max_model_len": 32768}]
        data += [{"id": n, "object": "model", "owned_by": "vllm", "root": p, "parent": self.served_model_name}
                 for n, p in self.loras.items()]
        return httpx.Response(200, json={"object": "list", "data": data})

    def _load(self, r: httpx.Request) -> httpx.Response:
        body = json.loads(r.content)
        name, path, inplace = body.get("lora_name"), body.get("lora_path"), body.get("load_inplace", False)
        if not name or not path:
            return _err(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if not inplace and name in self.loras:
            return _err(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                             "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not self.enable_lora:
            return _err(500, "LoRA is not enabled.", "InternalServerError")
        if not (Path(path) / "adapter_config.json").is_file():
            return _err(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.loras[name] = path
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")

    def _unload(self, r: httpx.Request) -> httpx.Response:
        name = json.loads(r.content).get("lora_name")
        if not name:
            return _err(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.loras:
            return _err(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loras[name]
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _rpc(self, r: httpx.Request) -> httpx.Response:
        body = json.loads(r.content)
        if body.get("method") is None:
            return httpx.Response(400, json={"error": {"message": "Missing 'method' in request body",
                                                       "type": "Bad Request", "param": None, "code": 400}})
        if body["method"] != "reload_weights":
            return _err(500, f"'Worker' object has no attribute '{body['method']}'", "Internal Server Error")
        self.weights_path = (body.get("kwargs") or {}).get("weights_path")
        return httpx.Response(200, json={"results": [None] * self.world_size})

    def _pause(self, r: httpx.Request) -> httpx.Response:
        mode = r.url.params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return httpx.Response(400, json={"error": f"invalid mode {mode}"})
        self.paused = True
        return httpx.Response(200, json={"status": "paused"})

    def _update_weight_version(self, r: httpx.Request) -> httpx.Response:
        version = json.loads(r.content).get("new_version")
        if not isinstance(version, str):
            return httpx.Response(422, json={"detail": [{"loc": ["body", "new_version"], "msg": "Field required"}]})
        self.weight_version = version
        return httpx.Response(200, json={"success": True, "new_version": version})

    def _resume(self, _r: httpx.Request) -> httpx.Response:
        self.paused = False
        return httpx.Response(200, json={"status": "resumed"})


def _err(status: int, message: str, err_type: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": err_type, "param": None,
                                                  "code": status}})
