"""A full-weights model server stand-in for canary tests: real HTTP on 127.0.0.1 that says its weight
version on ``/weight_info`` as vLLM's dev mode does, and records which version served each call.

Where the embedded model server would cost a model load, this answers at once; the tests that need
real weights use ``EmbeddedServer`` (tests/serving/test_canary_routing.py, tests/loop)."""

from __future__ import annotations

import time


def answer(model: str) -> dict:
    """A vLLM-shaped chat answer with token ids and logprobs."""
    return {
        "id": "chatcmpl-weights",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": {"content": [{"token": "ok", "logprob": -0.5, "bytes": [], "top_logprobs": []}]},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [42],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "prompt_token_ids": [1, 2, 3],
    }


def weights_server(version: str | None, delay_s: float = 0.0):
    """A real HTTP server that serves full weights tagged ``version`` (mutable: a reload re-tags it),
    says so on /weight_info like vLLM's dev mode, and records the version each call ran on."""
    from scripted_server import Handler, Server

    class Weights(Handler):
        tag: str | None = version
        ran: list[tuple[str, str | None]] = []  # noqa: RUF012 (one class per server)

        def do_GET(self) -> None:
            path = self.path.rstrip("/")
            if path == "/weight_info":
                self.send_json(200, {"weight_version": type(self).tag})
            elif path == "/is_paused":
                self.send_json(200, {"is_paused": False})
            else:
                self.send_json(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

        def do_POST(self) -> None:
            body = self.read_json()
            tag = type(self).tag
            time.sleep(delay_s)
            type(self).ran.append((self.headers.get("traceparent", "00-none-").split("-")[1], tag))
            self.send_json(200, answer(body["model"]))

    server = Server(("127.0.0.1", 0), Weights).start_background()
    server.weights = Weights  # type: ignore[attr-defined]
    return server
