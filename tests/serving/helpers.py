"""Small helpers for the serving tests (recomputing logprobs, chat prompts, waiting)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def recompute_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """Raw logprob of each response token under ``model``, from one full forward pass."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(response_ids).view(-1, 1)).view(-1).tolist()


def chat_prompt_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def scripted_upstream(handle: Callable[[Any, dict], None]):
    """A real HTTP upstream on 127.0.0.1 whose POST behaviour is ``handle(handler, body)``.

    Used where the embedded model cannot misbehave on demand: slow, erroring, identifying itself.
    """
    from scripted_server import Handler, Server

    class Scripted(Handler):
        seen_headers: ClassVar[list[dict]] = []
        bodies: ClassVar[list[dict]] = []

        def do_POST(self) -> None:
            body = self.read_json()
            type(self).seen_headers.append(dict(self.headers))
            type(self).bodies.append(body)
            handle(self, body)

        def do_GET(self) -> None:
            self.send_json(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    server = Server(("127.0.0.1", 0), Scripted).start_background()
    server.handler_class = Scripted  # type: ignore[attr-defined]
    return server


def chat_answer(model: str, content: str = "ok", rid: str = "chatcmpl-scripted") -> dict:
    """A vLLM-shaped chat answer with token ids and logprobs (for scripted upstreams)."""
    return {"id": rid, "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": {"content": [{"token": content, "logprob": -0.5, "bytes": [],
                                                   "top_logprobs": []}]},
                         "finish_reason": "stop", "stop_reason": None, "token_ids": [42]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "prompt_token_ids": [1, 2, 3]}
