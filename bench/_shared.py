"""What several bench scripts use: a percentile, an example script loader, and a scripted OpenAI-compatible
upstream.

Imported by the scripts with ``bench/`` on ``sys.path`` (they run as plain files, not a package);
the repository root must be on it too, for ``serving``. It puts ``tests/`` on it, last, for the scripted
upstreams' HTTP server the tests use too (``tests/scripted_server.py``).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))
from scripted_server import Handler  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile by rank (no interpolation); NaN for no values."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def load_script(path: Path, name: str) -> ModuleType:
    """Import an example's script as a module; its folder goes on the path, as when it runs as a script
    (the demo agents import their shared ``genai_chat``)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# vLLM's dev-mode answers the gateway reads around each call served by a full reload's weights
VLLM_DEV_GETS = {"/weight_info": {"weight_version": "1"}, "/is_paused": {"is_paused": False}}


class ScriptedUpstream(Handler):
    """A near-zero-latency OpenAI-compatible upstream: a fixed chat answer in vLLM 0.10.2+ shape, each
    with its own response id; token ids (one per UTF-8 byte) and per-token logprobs when asked, as the
    gateway asks; a weight version and pause state (``VLLM_DEV_GETS``). Set ``answer`` on a subclass for
    another text."""

    ids = itertools.count(1)
    answer = "A short, fixed answer."

    def do_GET(self) -> None:
        path = self.path.rstrip("/")
        if path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
        elif path in VLLM_DEV_GETS:  # a full-weight reload's version, as vLLM in dev mode reports it
            self.send_json(200, VLLM_DEV_GETS[path])
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "NotFound"}})

    def do_POST(self) -> None:
        req = self.read_json()
        want_ids = bool(req.get("return_token_ids"))
        tokens = list(self.answer.encode())
        logprobs = {"content": [{"token": chr(t), "logprob": -0.5, "bytes": [t], "top_logprobs": []}
                                for t in tokens]} if req.get("logprobs") else None
        resp = {
            "id": f"chatcmpl-scripted-{next(self.ids)}", "object": "chat.completion", "created": 0,
            "model": req.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer},
                         "logprobs": logprobs, "finish_reason": "length", "stop_reason": None,
                         "token_ids": tokens if want_ids else None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 5 + len(tokens)},
            "prompt_token_ids": [1, 2, 3, 4, 5] if want_ids else None,
        }
        self.send_json(200, resp)
