"""What the engine hands back for each sequence (``Completion``, and ``Delta``s while streaming) and the
incremental detokeniser that makes them: stop strings end the text, and text that may be the start of
one is held back from the stream until it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.embedded.sampling import SamplingParams


@dataclass
class Completion:
    """One sampled sequence: ids, the logprob of each id, top alternatives, and its text."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Delta:
    """A streamed increment of one sequence (sent from the worker thread to the HTTP thread)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TextStream:
    """Incremental detokenisation with stop strings, holding back text that may start a stop."""

    def __init__(
        self, tokenizer: Any, p: SamplingParams, on_delta: Callable[[Delta], None] | None, index: int
    ):
        self.tok = tokenizer
        self.p = p
        self.on_delta = on_delta
        self.index = index
        self.ids: list[int] = []
        self.sent_chars = 0
        self.sent_tokens = 0
        self.text = ""
        self.lps: list[float] = []
        self.holdback = max((len(s) for s in p.stop), default=1) - 1
        self.c: Completion | None = None

    def push(self, tok: int, *, is_stop_token: bool, final: bool) -> str | None:
        """Add one token; returns the stop string hit, if any."""
        self.ids.append(tok)
        text_ids = self.ids[:-1] if is_stop_token else self.ids
        self.text = self.tok.decode(text_ids, skip_special_tokens=self.p.skip_special_tokens)
        for s in self.p.stop:
            at = self.text.find(s, max(0, self.sent_chars - len(s)))
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def finish(self, c: Completion) -> None:
        c.text = self.text
        self._emit(c, final=True)

    def flush(self, c: Completion) -> None:
        self._emit(c, final=False)

    def _emit(self, c: Completion, final: bool) -> None:
        if self.on_delta is None:
            return
        upto = len(self.text) if final else max(self.sent_chars, len(self.text) - self.holdback)
        if not final:  # a trailing U+FFFD may be an incomplete UTF-8 sequence: wait for the rest
            upto = min(upto, len(self.text.rstrip("\ufffd")))
        delta = self.text[self.sent_chars : upto]
        new_ids = c.token_ids[self.sent_tokens :]
        if not delta and not new_ids and not final:
            return
        self.on_delta(
            Delta(
                self.index,
                delta,
                new_ids,
                c.logprobs[self.sent_tokens :],
                c.top_logprobs[self.sent_tokens :],
                c.finish_reason if final else None,
                c.stop_reason if final else None,
            )
        )
        self.sent_chars = max(self.sent_chars, upto)
        self.sent_tokens = len(c.token_ids)
