"""Pure functions for the OpenAI/vLLM wire format, shared by the gateway and the embedded server.

Nothing here does I/O, so every rule (which fields the gateway adds and strips, how an upstream is
picked, how events and tool calls are parsed) is tested without a server. How a call becomes one
record and the span's attributes is ``gateway/record.py``.

vLLM facts this module relies on (each checked against the vllm-project/vllm sources):

* ``return_token_ids`` is a request field of ``ChatCompletionRequest`` and ``CompletionRequest``
  since vLLM 0.10.2 (``vllm/entrypoints/openai/protocol.py``). Chat responses then carry
  ``prompt_token_ids`` at the top level (``ChatCompletionResponse`` and the first
  ``ChatCompletionStreamResponse``) and ``token_ids`` per choice; completions carry both per
  choice (``CompletionResponseChoice`` / ``CompletionResponseStreamChoice`` have
  ``prompt_token_ids`` and ``token_ids``). When streaming, ``prompt_token_ids`` comes only in
  the first chunk and ``token_ids`` holds each chunk's delta tokens.
* Chat ``logprobs: true`` (+ ``top_logprobs``) returns ``choice.logprobs.content`` as a list of
  ``{token, logprob, bytes, top_logprobs}``; completions ``logprobs: N`` returns
  ``{tokens, token_logprobs, top_logprobs, text_offset}``. Values are of the *raw* model
  distribution by default (``ModelConfig.logprobs_mode = "raw_logprobs"``, vLLM ≥ 0.10.2,
  ``vllm/config/model.py``): before temperature and top-p.
* Errors are ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``/``ErrorInfo``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from schemas.attributes import (
    ROLLOUT_ID,
    base_name,
    parse_policy_version,
)

CHAT = "chat"
TEXT_COMPLETION = "text_completion"
# URL path -> gen_ai.operation.name
OPERATIONS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT_COMPLETION}


def latest_version_name(model: str | None, served: list[str]) -> str | None:
    """The newest ``{model}@k`` among served names, or None (then the request goes as it is).

    Unmodified agents ask for ``policy``; the trainer publishes ``policy@k``. The gateway uses
    this to send each call to the newest published version without the agent knowing.
    """
    if not model or parse_policy_version(model) is not None:
        return None
    best: tuple[int, str] | None = None
    for name in served:
        v = parse_policy_version(name)
        if base_name(name) == model and v is not None and (best is None or v > best[0]):
            best = (v, name)
    return best[1] if best else None


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object; the ``openai`` client raises ``APIStatusError`` subclasses from it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_message(body: Any) -> str:
    """The human message of an error body in any of the shapes OpenAI, vLLM and FastAPI use."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):  # vLLM < 0.10 flat ErrorResponse
            return str(body["message"])
        if "detail" in body:  # FastAPI HTTPException / unknown route
            return str(body["detail"])
    return str(body)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


# ---------------------------------------------------------------------------------------------
# What the gateway adds to a request, and strips from the answer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientWants:
    """What the client itself asked for, so the gateway returns exactly that and nothing more."""

    operation: str
    stream: bool
    token_ids: bool
    logprobs: bool
    usage_in_stream: bool


def prepare_upstream_body(body: Mapping[str, Any], operation: str) -> tuple[dict[str, Any], ClientWants]:
    """Copy the client's request and ask the engine for exact ids and logprobs of the sampled tokens.

    Chat takes ``logprobs: true`` (top_logprobs untouched); completions take ``logprobs: 0``
    (the sampled token only) unless the client asked for more. A stream also asks for a final
    usage chunk so the span can record token counts.
    """
    up = dict(body)
    stream = bool(body.get("stream"))
    if operation == CHAT:
        wants_lp = bool(body.get("logprobs"))
        up["logprobs"] = True
    else:
        wants_lp = body.get("logprobs") is not None
        if not wants_lp:
            up["logprobs"] = 0
    wants_ids = bool(body.get("return_token_ids"))
    up["return_token_ids"] = True
    opts = body.get("stream_options") or {}
    usage = bool(opts.get("include_usage"))
    if stream:
        up["stream_options"] = {**opts, "include_usage": True}
    return up, ClientWants(operation, stream, wants_ids, wants_lp, usage)


def strip_response(resp: dict[str, Any], wants: ClientWants) -> dict[str, Any]:
    """Remove what the gateway added (ids, logprobs) from a non-streaming response, in place."""
    if not wants.token_ids:
        resp.pop("prompt_token_ids", None)
    for choice in resp.get("choices") or []:
        if not wants.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return resp


def strip_chunk(chunk: dict[str, Any], wants: ClientWants) -> dict[str, Any] | None:
    """Clean one streamed chunk for the client; None means drop it (the usage chunk we added)."""
    if not wants.usage_in_stream:
        if not chunk.get("choices") and chunk.get("usage") is not None:
            return None
        chunk.pop("usage", None)
    return strip_response(chunk, wants)


# ---------------------------------------------------------------------------------------------
# Upstream choice: sticky per rollout / trace
# ---------------------------------------------------------------------------------------------


def pick_upstream(key: str | None, upstreams: list[str], fallback: int = 0) -> int:
    """Rendezvous hashing: the same key always lands on the same upstream while it is listed.

    Without a key (no rollout id, no traceparent) the caller's round-robin ``fallback`` decides.
    Adding or removing one upstream only moves the keys that hashed to it.
    """
    if not upstreams:
        raise ValueError("no upstreams configured; pass --upstream URL")
    if not key:
        return fallback % len(upstreams)
    import hashlib

    def score(i: int) -> bytes:
        return hashlib.blake2b(f"{key}|{upstreams[i]}".encode(), digest_size=8).digest()

    return max(range(len(upstreams)), key=score)


def rollout_from_baggage(value: str | None) -> str | None:
    """``tracerl.rollout_id`` from a W3C ``baggage`` header (set by the agent's OTel baggage), if any."""
    if not value:
        return None
    from urllib.parse import unquote

    for item in value.split(","):
        key, _, rest = item.partition("=")
        if key.strip() == ROLLOUT_ID and rest:
            return unquote(rest.split(";")[0].strip()) or None
    return None


def trace_id_from_traceparent(value: str | None) -> str | None:
    """The 32-hex trace id of a W3C ``traceparent`` header, or None when absent or malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1].lower()
    return None


# ---------------------------------------------------------------------------------------------
# Server-sent events
# ---------------------------------------------------------------------------------------------


def sse_data(obj: Any) -> bytes:
    """One SSE event as the OpenAI API frames it: ``data: <json>\\n\\n``."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


class SSEData:
    """Incremental reader of server-sent events: feed text lines, get each event's ``data`` payload."""

    def __init__(self) -> None:
        self._buf: list[str] = []

    def feed(self, raw: str) -> str | None:
        """Add one line; returns the event's payload when the line ends an event."""
        line = raw.rstrip("\r\n")
        if not line:
            if self._buf:
                data, self._buf = "\n".join(self._buf), []
                return data
            return None
        if line.startswith("data:"):
            self._buf.append(line[5:].lstrip(" "))
        return None

    def end(self) -> str | None:
        """The payload of an event the stream ended without a blank line after, if any."""
        return self.feed("")


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Yield the ``data`` payload of each event from an iterator of text lines (``[DONE]`` included)."""
    sse = SSEData()
    for raw in lines:
        data = sse.feed(raw)
        if data is not None:
            yield data
    data = sse.end()
    if data is not None:
        yield data


# ---------------------------------------------------------------------------------------------
# Hermes-style tool calls (Qwen2.5 / NousResearch format)
# ---------------------------------------------------------------------------------------------

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ParsedToolCalls:
    """Assistant text split into plain content and the tool calls it contains."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_hermes_tool_calls(text: str) -> ParsedToolCalls:
    """Parse ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of ``text``.

    Follows vLLM's ``hermes`` tool parser: content is the text before the first block (None
    when empty); arguments are re-serialised as a JSON string; a block that is not valid JSON
    with a ``name`` leaves the whole text as content, as vLLM does.
    """
    blocks = _TOOL_CALL_RE.findall(text)
    if not blocks:
        return ParsedToolCalls(content=text, tool_calls=[])
    calls = []
    for raw in blocks:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return ParsedToolCalls(content=text, tool_calls=[])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedToolCalls(content=text, tool_calls=[])
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"chatcmpl-tool-{secrets.token_hex(16)}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    content = text[: text.find("<tool_call>")]
    return ParsedToolCalls(content=content if content.strip() else None, tool_calls=calls)


def split_tool_stream(held: str, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]] | None]:
    """Streaming with tools: emit plain text at once, hold text from ``<tool_call>`` to the end.

    Returns (text to emit now, text still held, tool calls parsed at the end or None). A suffix
    that may be the start of ``<tool_call>`` is held until the next delta decides.
    """
    buf = held + text
    if final:
        parsed = parse_hermes_tool_calls(buf)
        if parsed.tool_calls:
            calls = [{"index": k, **tc} for k, tc in enumerate(parsed.tool_calls)]
            return parsed.content or "", "", calls
        return buf, "", None
    cut = buf.find("<tool_call>")
    if cut != -1:
        return buf[:cut], buf[cut:], None
    tag = "<tool_call>"
    keep = next((k for k in range(min(len(tag) - 1, len(buf)), 0, -1) if buf.endswith(tag[:k])), 0)
    return buf[: len(buf) - keep], buf[len(buf) - keep :], None
