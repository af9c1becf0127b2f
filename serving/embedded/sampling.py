"""Per-request validation for the embedded server: sampling fields, strings, chat-template fields.

Every check here runs on the HTTP side, before a request joins a batch, so a bad field is a 400
for that request alone (a NaN temperature or a 2**64 seed used to pass and then fail the whole
batch it was in). Pure functions: no torch, no I/O.

vLLM rules followed (vllm-project/vllm, ``vllm/entrypoints/openai/protocol.py`` and
``chat_utils.py``):

* ``seed`` lies in torch's int64 range (``Field(ge=torch.iinfo(torch.long).min, le=...max)``).
* A request's ``chat_template`` (or ``chat_template_kwargs.chat_template``) is refused unless the
  server runs with ``--trust-request-chat-template`` (vLLM 0.11.1, PR #25794, advisories
  GHSA-6fvq-23cw-5628 and GHSA-4hw3-g54f-xfrj); ``chat_template_kwargs`` may not hold
  ``chat_template`` or ``tokenize``, and keys the template does not use are dropped
  (``resolve_chat_template_kwargs``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)  # vLLM's wording
# apply_chat_template arguments the server sets itself; a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
    }
)
_SURROGATE = re.compile("[\ud800-\udfff]")


class EngineError(Exception):
    """A request the engine refuses; ``status`` and ``err_type`` follow vLLM's answer for it."""

    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.param = param


def number(
    body: dict[str, Any],
    name: str,
    default: Any,
    kind: type,
    lo: float | None = None,
    hi: float | None = None,
) -> Any:
    """``body[name]`` as a finite int or float within [lo, hi]; ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    what = "an integer" if kind is int else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise EngineError(f"{name} must be {what}, got {v!r}", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise EngineError(f"{name} must be a finite number, got {v}", param=name)
    if kind is int and isinstance(v, float) and not v.is_integer():
        raise EngineError(f"{name} must be an integer, got {v!r}", param=name)
    try:
        v = kind(v)
    except OverflowError:
        raise EngineError(f"{name} is out of range, got {v!r}", param=name) from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise EngineError(f"{name} must be in [{lo}, {hi}], got {v}", param=name)
    return v


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """``body[name]`` as a JSON boolean; anything else (``"yes"``, 1) is a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise EngineError(f"{name} must be true or false, got {v!r}", param=name)
    return v


def lone_surrogate_path(obj: Any) -> str | None:
    """Where a string holds half of a UTF-16 pair (``"\\ud800"`` in the JSON), or None.

    Such a string cannot be encoded as UTF-8, so the tokenizer fails on it; JSON pairs that
    are complete were already joined into one character by the decoder.
    """
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path or "(body)"
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"{path}.{k!a}" if path else repr(k)
                stack.append((f"{path}.{k}" if path else str(k), x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def check_strings(body: dict[str, Any]) -> None:
    """400 for a request whose strings are not valid Unicode text."""
    where = lone_surrogate_path(body)
    if where is not None:
        raise EngineError(
            f"{where} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not text; send valid UTF-8",
            param=where.split(".")[0].split("[")[0],
        )


@dataclass(frozen=True)
class TemplateRequest:
    """A chat request's template fields after the trust policy: the template to use, if its own, and
    the extra variables for it (still to be filtered to those the template reads)."""

    chat_template: str | None
    kwargs: dict[str, Any]


def template_request(body: dict[str, Any], trust: bool) -> TemplateRequest:
    """Apply vLLM's policy to ``chat_template`` / ``chat_template_kwargs`` of one chat request."""
    tmpl = body.get("chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise EngineError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if tmpl is None:
        tmpl = kwargs.get("chat_template")
    if tmpl is not None and not trust:
        raise EngineError(UNTRUSTED_TEMPLATE, param="chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise EngineError("chat_template must be a string", param="chat_template")
    unexpected = sorted({"tokenize"} & kwargs.keys())
    if unexpected:
        raise EngineError(
            f"Found unexpected chat template kwargs from request: {unexpected}", param="chat_template_kwargs"
        )
    return TemplateRequest(tmpl, {k: v for k, v in kwargs.items() if k not in RESERVED_TEMPLATE_KWARGS})


@dataclass
class SamplingParams:
    """The vLLM/OpenAI sampling fields the embedded server supports (others are ignored, as vLLM
    ignores unknown fields): penalties and ``logit_bias``/``min_tokens`` act before temperature,
    top-k and top-p, in vLLM's order; raw logprobs are taken before all of them."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top-k alternatives
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def penalised(self) -> bool:
        """Whether any logits processor runs (they change the sampled, not the raw, distribution)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )

    @classmethod
    def from_request(cls, body: dict[str, Any], chat: bool) -> SamplingParams:
        """Validate request fields the way vLLM does and name the bad one in the error."""
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise EngineError("stop must be a string or a list of strings", param="stop")
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = (
            number(body, "max_tokens", None, int, 1)
            if max_tokens is None
            else number(body, "max_completion_tokens", None, int, 1)
        )
        if chat:
            lp = None
            if flag(body, "logprobs"):
                lp = number(body, "top_logprobs", 0, int, 0, 20)
            elif body.get("top_logprobs"):
                raise EngineError(
                    "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
                )
        else:
            lp = number(body, "logprobs", None, int, 0, 20)
        return cls(
            max_tokens=max_tokens,
            temperature=number(body, "temperature", 1.0, float, 0.0, 2.0),
            top_p=_top_p(number(body, "top_p", 1.0, float, 0.0, 1.0)),
            top_k=number(body, "top_k", -1, int, -1),
            n=number(body, "n", 1, int, 1, 16),
            seed=number(body, "seed", None, int, INT64_MIN, INT64_MAX),
            stop=[s for s in stop if s],
            stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
            ignore_eos=flag(body, "ignore_eos"),
            logprobs=lp,
            skip_special_tokens=flag(body, "skip_special_tokens", True),
            presence_penalty=number(body, "presence_penalty", 0.0, float, -2.0, 2.0),
            frequency_penalty=number(body, "frequency_penalty", 0.0, float, -2.0, 2.0),
            repetition_penalty=number(body, "repetition_penalty", 1.0, float, 0.01, 2.0),
            min_tokens=number(body, "min_tokens", 0, int, 0, max_tokens),
            logit_bias=_logit_bias(body.get("logit_bias")),
        )


def _token_ids(v: Any, name: str) -> list[int]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in v
    ):
        raise EngineError(
            f"{name} must be a list of non-negative integer token ids, got {v!r:.200}", param=name
        )
    return list(v)


def _logit_bias(v: Any) -> dict[int, float]:
    if not v:
        return {}
    if not isinstance(v, dict):
        raise EngineError("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    try:
        out = {int(k): float(b) for k, b in v.items()}
    except (TypeError, ValueError, OverflowError):
        raise EngineError(
            "logit_bias keys must be token ids and values numbers", param="logit_bias"
        ) from None
    if any(not -100 <= b <= 100 for b in out.values()):  # NaN fails this too
        raise EngineError("logit_bias values must be in [-100, 100]", param="logit_bias")
    return out


def _top_p(v: float) -> float:
    if v <= 0.0:
        raise EngineError(f"top_p must be in (0, 1], got {v}", param="top_p")
    return v
