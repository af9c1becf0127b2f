"""The JSON text the stages store: compact, UTF-8 kept as-is, the text of
``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``.

One home because it is a contract: the collector stores structured attribute values in this form and
the converter stores messages, tools and responses in it, and the content join compares such text. It
is also hot (every non-scalar attribute of every span, every converted call): ``JSONEncoder.encode``
builds a new C encoder on every call, which costs about as much as encoding a short list, so the C
encoder is built once here, with the settings ``encode`` passes it. No circular-reference check: the
values are decoded protobuf or JSON, never circular. ``c_make_encoder`` is a private CPython function,
used only where it gives exactly what the public path gives (checked on a probe at import).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def _compact_encoder() -> Callable[[Any], str]:
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the pure-Python path
        return encoder.encode
    try:
        iterencode = make(None, encoder.default, json.encoder.encode_basestring, None, ":", ",", False, False, True)
        fast: Callable[[Any], str] = lambda obj: "".join(iterencode(obj, 0))  # noqa: E731
        probe = [{"k": 'é "q"\n', "n": 1.5, "i": -3, "ok": True, "x": None, "l": [1e16, "a"]}, float("nan")]
        if fast(probe) == encoder.encode(probe):
            return fast
    except Exception:
        pass
    return encoder.encode


compact_json: Callable[[Any], str] = _compact_encoder()
"""``obj`` as compact JSON text (the module docstring)."""
