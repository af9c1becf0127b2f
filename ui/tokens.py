"""A call's response as the trainer sees it: token by token, with logprob and advantage.

The store keeps token *ids* (exactly what the model sampled, from the gateway); their text needs
the model's tokenizer. ``load_decoder`` reads ``tokenizer.json`` with the ``tokenizers`` library
(light: no transformers import) from ``--tokenizer`` or the base model the rounds manifest names.
Without one the view shows ids only.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ui.colors import token_classes

Decoder = Callable[[int], str]


@dataclass(frozen=True)
class TokenView:
    index: int
    token_id: int
    text: str
    logprob: float | None
    classes: str

    @property
    def title(self) -> str:
        """The hover text: id, text, logprob and probability."""
        lp = "none" if self.logprob is None else f"{self.logprob:.3f} (p={math.exp(min(self.logprob, 0)):.3f})"
        return f"#{self.index} id {self.token_id} {self.text!r} logprob {lp}"


@functools.lru_cache(maxsize=4)
def load_decoder(model_dir: str | os.PathLike[str] | None) -> Decoder | None:
    """id -> text with the tokenizer in ``model_dir`` (``tokenizer.json``); None when there is none."""
    if not model_dir:
        return None
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception:
        return None

    @functools.lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        try:
            return tok.decode([token_id], skip_special_tokens=False)
        except Exception:
            return f"⟨{token_id}⟩"

    return decode


def token_views(ids: Sequence[int] | None, logprobs: Sequence[float] | None, advantage: float | None,
                decode: Decoder | None) -> list[TokenView]:
    """One view per response token; ``advantage`` is the call's (one per rollout, copied to its calls)."""
    ids = list(ids or [])
    lps = list(logprobs or [])
    out = []
    for i, t in enumerate(ids):
        lp = float(lps[i]) if i < len(lps) and lps[i] is not None else None
        text = decode(int(t)) if decode else f"⟨{t}⟩"
        out.append(TokenView(i, int(t), text, lp, token_classes(lp, advantage)))
    return out
