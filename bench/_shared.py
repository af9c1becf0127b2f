"""What several bench scripts use: a percentile, an example script loader, and a scripted OpenAI-compatible
upstream.

Imported by the scripts with ``bench/`` on ``sys.path`` (they run as plain files, not a package);
it puts the repository root on it (for ``serving``), then ``tests/``, last, for the scripted
upstreams' HTTP server the tests use too (``tests/scripted_server.py``) and for the S3 stand-in
(``tests/s3_server.py``) that ``--store s3`` runs against.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# The root goes on the path before tests/: tests/serving, tests/httpshell_guard... are folders without an
# __init__.py, and with only tests/ on the path Python took ``tests/serving`` for a namespace package
# ``serving`` before the installed one (a bench's ``import httpshell`` failed that way in a clean clone).
# Appended, not inserted: a bench that put another checkout first (gateway_rig's BENCH_GATEWAY_ROOT)
# keeps it first.
for _entry in (ROOT, TESTS):
    if str(_entry) not in sys.path:
        sys.path.append(str(_entry))
from scripted_server import Handler  # noqa: E402

S3_NOTE = (
    "S3 figures are against moto's S3 server on 127.0.0.1, a stand-in for S3 sharing these cores: "
    "they measure tracerl's object-storage code path (pyarrow's S3 client and its requests), "
    "not S3's latency or throughput"
)
"""Printed by every bench run with ``--store s3``, so its figures are never read as S3's."""


@contextlib.contextmanager
def s3_stand_in(bucket: str = "bench") -> Iterator[str]:
    """moto's S3 server (``tests/s3_server.py``, as the store's tests use it) with one bucket; yields
    ``s3://BUCKET``. The AWS variables are set in ``os.environ`` for the duration, so this process and
    the ``tracerl`` processes it starts reach the bucket exactly as a user's would."""
    from s3_server import make_bucket, moto_server, s3_env

    with moto_server() as endpoint:
        env = s3_env(endpoint)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            make_bucket(endpoint, bucket)
            yield f"s3://{bucket}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


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
        logprobs = (
            {
                "content": [
                    {"token": chr(t), "logprob": -0.5, "bytes": [t], "top_logprobs": []} for t in tokens
                ]
            }
            if req.get("logprobs")
            else None
        )
        resp = {
            "id": f"chatcmpl-scripted-{next(self.ids)}",
            "object": "chat.completion",
            "created": 0,
            "model": req.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.answer},
                    "logprobs": logprobs,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": tokens if want_ids else None,
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 5 + len(tokens)},
            "prompt_token_ids": [1, 2, 3, 4, 5] if want_ids else None,
        }
        self.send_json(200, resp)
