"""The embedded server's answers in vLLM's shapes: choices, logprobs, usage and stream chunks.

Pure functions of the engine's output (the tokenizer only decodes token text), so the HTTP side
stays a thin shell. Shapes follow vLLM 0.10.2+ ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

from typing import Any

from serving.embedded.engine import Completion, Delta, ModelEngine
from serving.protocol import parse_hermes_tool_calls, split_tool_stream, sse_data


def usage(prompt_ids: list[int], outs: list[Completion]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in outs)
    return {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


def chat_logprobs(
    eng: ModelEngine, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
) -> dict:
    content = []
    for tok, lp, top in zip(ids, lps, tops, strict=True):
        s = eng.decode_token(tok)
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := eng.decode_token(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                    for i, v in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    eng: ModelEngine, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]], offset: int
) -> dict:
    tokens, offsets, top_out = [], [], []
    for tok, top in zip(ids, tops, strict=True):
        s = eng.decode_token(tok)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top_out.append({eng.decode_token(i): v for i, v in top} or None)
    return {"text_offset": offsets, "token_logprobs": list(lps), "tokens": tokens, "top_logprobs": top_out}


def choice(
    eng: ModelEngine,
    c: Completion,
    *,
    chat: bool,
    want_ids: bool,
    prompt_ids: list[int],
    parse_tools: bool,
    logprobs: bool,
) -> dict[str, Any]:
    """One choice of a non-streamed answer."""
    finish = c.finish_reason
    if chat:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": c.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        if parse_tools:
            parsed = parse_hermes_tool_calls(c.text)
            if parsed.tool_calls:
                message["content"] = parsed.content
                message["tool_calls"] = parsed.tool_calls
                finish = "tool_calls"
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(eng, c.token_ids, c.logprobs, c.top_logprobs) if logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.token_ids if want_ids else None,
        }
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": completion_logprobs(eng, c.token_ids, c.logprobs, c.top_logprobs, 0)
        if logprobs
        else None,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
        "token_ids": c.token_ids if want_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if want_ids else None,
    }


class StreamChunks:
    """Turns the engine's deltas of one request into the SSE chunks vLLM sends for them."""

    def __init__(
        self,
        eng: ModelEngine,
        *,
        chat: bool,
        n: int,
        rid: str,
        created: int,
        model: str,
        prompt_ids: list[int],
        want_ids: bool,
        logprobs: bool,
        parse_tools: bool,
    ):
        self.eng, self.chat, self.rid, self.created, self.model = eng, chat, rid, created, model
        self.prompt_ids, self.want_ids, self.logprobs, self.parse_tools = (
            prompt_ids,
            want_ids,
            logprobs,
            parse_tools,
        )
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.first = {i: True for i in range(n)}
        self.tool_buf = {i: "" for i in range(n)}  # with tools, text after <tool_call> is held
        self.offsets = {i: 0 for i in range(n)}

    def chunk(self, choices: list[dict], **extra: Any) -> bytes:
        return sse_data(
            {
                "id": self.rid,
                "object": self.obj,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    def delta(self, ev: Delta) -> bytes:
        """The chunk(s) for one delta (chat sends the role first, with the prompt ids when asked)."""
        return self._chat(ev) if self.chat else self._text(ev)

    def _chat(self, ev: Delta) -> bytes:
        i, eng = ev.index, self.eng
        out: list[bytes] = []
        if self.first[i]:
            extra = {"prompt_token_ids": self.prompt_ids} if self.want_ids else {}
            out.append(
                self.chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **extra,
                )
            )
            self.first[i] = False
        text, tool_calls, finish = ev.text, None, ev.finish_reason
        if self.parse_tools:
            text, self.tool_buf[i], tool_calls = split_tool_stream(self.tool_buf[i], text, finish is not None)
            if tool_calls:
                finish = "tool_calls"
        delta: dict[str, Any] = {"content": text} if text or not tool_calls else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        ch: dict[str, Any] = {
            "index": i,
            "delta": delta,
            "logprobs": chat_logprobs(eng, ev.token_ids, ev.logprobs, ev.top_logprobs)
            if self.logprobs
            else None,
            "finish_reason": finish,
        }
        ch["stop_reason"] = ev.stop_reason if finish is not None else None
        if self.want_ids:
            ch["token_ids"] = ev.token_ids
        out.append(self.chunk([ch]))
        return b"".join(out)

    def _text(self, ev: Delta) -> bytes:
        i, eng = ev.index, self.eng
        ch = {
            "index": i,
            "text": ev.text,
            "logprobs": completion_logprobs(eng, ev.token_ids, ev.logprobs, ev.top_logprobs, self.offsets[i])
            if self.logprobs
            else None,
            "finish_reason": ev.finish_reason,
            "stop_reason": ev.stop_reason,
        }
        if self.want_ids:
            ch["token_ids"] = ev.token_ids
            if self.first[i]:
                ch["prompt_token_ids"] = self.prompt_ids
        self.first[i] = False
        self.offsets[i] += len(ev.text)
        return self.chunk([ch])
