"""Embedded CPU server with vLLM's OpenAI-compatible API subset (``tracerl serve``).

It stands in for vLLM on a laptop and in CI, so the gateway, the publish client and agents
talk to it exactly as to vLLM. Endpoints, with the vLLM contract each follows:

* ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``: request and
  response shapes of vLLM 0.10.2+ (``vllm/entrypoints/openai/protocol.py``), including
  ``return_token_ids`` (top-level ``prompt_token_ids`` for chat, per choice for completions,
  ``token_ids`` per choice), ``logprobs``/``top_logprobs``, ``n``, ``seed``, ``stop``,
  streaming with ``stream_options.include_usage``, and hermes tool calls.
* ``POST /v1/load_lora_adapter`` ``{"lora_name","lora_path","load_inplace"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: plain-text ``Success: ...`` on 200 and
  the error texts of ``OpenAIServingModels`` (vLLM 0.11, ``vllm/entrypoints/openai/
  serving_models.py``; routes registered only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, here
  by ``--enable-lora-updating``, on by default).
* Dev-mode endpoints (vLLM registers them only with ``VLLM_SERVER_DEV_MODE=1``; here
  ``--dev-mode``, on by default): ``POST /collective_rpc`` ``{"method","args","kwargs",
  "timeout"}`` -> ``{"results": [...]}`` (vLLM 0.10+, ``api_server.py``) with the method
  ``reload_weights`` (kwarg ``weights_path``); ``POST /pause?mode=abort|wait|keep``,
  ``POST /resume``, ``GET /is_paused`` (vLLM 0.12+, ``vllm/entrypoints/serve/dev/rlhf``);
  ``POST /reset_prefix_cache`` (200, empty body); ``POST /update_weight_version``
  ``{"new_version": str}`` -> ``{"success": true, "new_version"}`` and ``GET /weight_info`` ->
  ``{"weight_version": str | null}`` (vLLM main after 0.12, same rlhf router file).

A disabled endpoint answers 404 ``{"detail": "Not Found"}``, as FastAPI does in vLLM.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from serving.engine import (
    Completion,
    Delta,
    EngineError,
    EngineWorker,
    GenerationJob,
    ModelEngine,
    SamplingParams,
)
from serving.httpserver import Handler, HTTPError, Server
from serving.protocol import (
    SSE_DONE,
    error_body,
    new_id,
    parse_hermes_tool_calls,
    split_tool_stream,
    sse_data,
)
from serving.sampling import check_strings, flag, template_request


@dataclass
class ServeOptions:
    """Behaviour switches of the embedded server (the vLLM flag each mirrors in brackets)."""

    api_key: str | None = None  # [--api-key]
    enable_lora: bool = True  # [--enable-lora]
    enable_lora_updating: bool = True  # [VLLM_ALLOW_RUNTIME_LORA_UPDATING=True]
    dev_mode: bool = True  # [VLLM_SERVER_DEV_MODE=1]
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    max_num_seqs: int = 8  # [--max-num-seqs] requests batched into one forward pass
    trust_request_chat_template: bool = False  # [--trust-request-chat-template]
    allowed_hosts: tuple[str, ...] = ()  # more Host values the state-changing endpoints accept


# Endpoints that change the served model or the server's state: a web page in the user's browser must
# not reach them (see ``cross_site_refusal``).
STATE_CHANGING = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/pause",
                            "/resume", "/reset_prefix_cache", "/update_weight_version"})
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def host_allow_list(host: str, port: int, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The ``Host`` header values that name this server: its bound address (any loopback name when
    bound to loopback) and the user's ``extra`` names (``NAME`` for any port, or ``NAME:PORT``)."""
    bound = f"[{host}]" if ":" in host else host
    names = _LOOPBACK if bound in _LOOPBACK else (bound,)
    out = {f"{n}:{port}" for n in names}
    for e in extra:
        e = e.strip().lower()
        if e:
            out.update({e} if e.rpartition(":")[2].isdigit() and not e.endswith("]") else {e, f"{e}:{port}"})
    return frozenset(x.lower() for x in out)


def cross_site_refusal(content_type: str | None, host: str | None, allowed: frozenset[str]) -> str | None:
    """Why a state-changing request may come from another site (None: it may not).

    A page can make the browser POST ``text/plain``, a form, or multipart anywhere without asking;
    ``application/json`` needs a CORS preflight, which this server never grants. DNS rebinding gets
    past that by naming an attacker's host that resolves to 127.0.0.1: the ``Host`` header then
    carries the attacker's name, not this server's.
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        return (f"this endpoint changes the server's state and requires Content-Type: application/json "
                f"(got {media or 'none'}), so that a web page cannot send it cross-site")
    if (host or "").strip().lower() not in allowed:
        return (f"Host {host!r} does not name this server ({', '.join(sorted(allowed))}); reach it by its "
                f"bound address or add the name with --allowed-hosts")
    return None


class EmbeddedServer(Server):
    """HTTP server + engine worker; ``EmbeddedServer.start(model_dir)`` for tests and the CLI."""

    def __init__(self, address: tuple[str, int], engine: ModelEngine, options: ServeOptions):
        self.engine = engine
        self.worker = EngineWorker(engine, max_batch=options.max_num_seqs)
        self.options = options
        self.created = int(time.time())
        handler = type("BoundEmbeddedHandler", (EmbeddedHandler,), {"max_body_bytes": options.max_body_bytes})
        super().__init__(address, handler)
        self.allowed_hosts = host_allow_list(self.server_address[0], self.server_address[1], options.allowed_hosts)

    @classmethod
    def start(cls, model_dir: str, *, host: str = "127.0.0.1", port: int = 0,
              served_model_name: str = "policy", logprobs_mode: str = "raw_logprobs",
              max_model_len: int | None = None, options: ServeOptions | None = None,
              seed: int = 0) -> EmbeddedServer:
        opts = options or ServeOptions()
        engine = ModelEngine(model_dir, served_model_name=served_model_name, logprobs_mode=logprobs_mode,
                             max_model_len=max_model_len, enable_lora=opts.enable_lora, seed=seed)
        server = cls((host, port), engine, opts)
        server.start_background()
        return server

    def stop(self) -> None:
        super().stop()
        self.worker.close()
        self.engine.release()


class EmbeddedHandler(Handler):
    server: EmbeddedServer

    # -- routing ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        opts = self.server.options
        routes: dict[tuple[str, str], Any] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
        }
        if opts.enable_lora_updating:
            routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora
        if opts.dev_mode:
            routes.update({
                ("POST", "/collective_rpc"): self._collective_rpc,
                ("POST", "/pause"): self._pause,
                ("POST", "/resume"): self._resume,
                ("GET", "/is_paused"): self._is_paused,
                ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
                ("POST", "/update_weight_version"): self._update_weight_version,
                ("GET", "/weight_info"): self._weight_info,
            })
        fn = routes.get((method, path))
        try:
            if path != "/health":
                self.check_bearer(opts.api_key)
            if method == "POST" and path in STATE_CHANGING:
                why = cross_site_refusal(self.headers.get("Content-Type"), self.headers.get("Host"),
                                         self.server.allowed_hosts)
                if why:
                    self.read_body()
                    raise HTTPError(403, why, "PermissionDenied")
            if fn is None:  # FastAPI's answers, which the publish client reads as "flag missing"
                self.read_body()
                known = any(p == path for _, p in routes)
                self.send_json(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
                return
            fn(parse_qs(url.query))
        except HTTPError as e:
            self.send_error_json(e)
        except EngineError as e:
            self.send_json(e.status, error_body(str(e), e.err_type, e.status, e.param))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # the server must answer, whatever broke
            self.send_json(500, error_body(f"{type(e).__name__}: {e}", "InternalServerError", 500))

    # -- simple endpoints ------------------------------------------------------------------

    def _health(self, _q: dict) -> None:
        self.send_bytes(200, b"", "application/json")

    def _models(self, _q: dict) -> None:
        eng = self.server.engine
        perm = {"id": new_id("modelperm"), "object": "model_permission", "created": self.server.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}
        data = [{"id": eng.served_model_name, "object": "model", "created": self.server.created,
                 "owned_by": "vllm", "root": eng.model_dir, "parent": None,
                 "max_model_len": eng.max_model_len, "permission": [perm]}]
        for a in list(eng.adapters.values()):
            data.append({"id": a.name, "object": "model", "created": self.server.created, "owned_by": "vllm",
                         "root": a.path, "parent": eng.served_model_name, "max_model_len": None,
                         "permission": [perm]})
        self.send_json(200, {"object": "list", "data": data})

    def _load_lora(self, _q: dict) -> None:
        body = self.read_json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise EngineError("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        inplace = bool(body.get("load_inplace", False))
        self._control(lambda: self.server.engine.load_lora(name, path, inplace))
        self.send_bytes(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain; charset=utf-8")

    def _unload_lora(self, _q: dict) -> None:
        body = self.read_json()
        name = body.get("lora_name")
        if not name:
            raise EngineError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
        self._control(lambda: self.server.engine.unload_lora(name))
        self.send_bytes(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain; charset=utf-8")

    def _collective_rpc(self, _q: dict) -> None:
        body = self.read_json()
        method = body.get("method")
        if method is None:
            raise HTTPError(400, "Missing 'method' in request body", "Bad Request")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if method == "reload_weights":
            self._control(lambda: self.server.engine.reload_weights(*args, **kwargs))
            self.send_json(200, {"results": [None]})
            return
        raise EngineError(f"'Worker' object has no attribute '{method}' (the embedded server supports "
                          "collective_rpc method 'reload_weights' only)", 500, "Internal Server Error")

    def _pause(self, q: dict) -> None:
        self.read_body()
        mode = (q.get("mode") or ["abort"])[0]
        self.server.worker.pause(mode)
        self.send_json(200, {"status": "paused"})

    def _resume(self, _q: dict) -> None:
        self.read_body()
        self.server.worker.resume()
        self.send_json(200, {"status": "resumed"})

    def _is_paused(self, _q: dict) -> None:
        self.send_json(200, {"is_paused": self.server.worker.paused})

    def _update_weight_version(self, _q: dict) -> None:
        version = self.read_json().get("new_version")
        if not isinstance(version, str):
            raise HTTPError(422, "new_version (a string) is required", "Unprocessable Entity")
        self._control(lambda: setattr(self.server.engine, "weight_version", version))
        self.send_json(200, {"success": True, "new_version": version})

    def _weight_info(self, _q: dict) -> None:
        self.send_json(200, {"weight_version": self.server.engine.weight_version})

    def _reset_prefix_cache(self, _q: dict) -> None:
        self.read_body()

        def reset() -> None:  # no prefix cache on CPU; counted so tests see the call arrive in order
            self.server.engine.prefix_cache_resets += 1

        self._control(reset)
        self.send_bytes(200, b"", "application/json")

    def _control(self, fn: Any) -> Any:
        return self.server.worker.call(fn, control=True, timeout=self.server.options.request_timeout_s)

    # -- generation ------------------------------------------------------------------------

    def _request_body(self) -> dict[str, Any]:
        """A generation request, with the fields every endpoint shares checked before it queues."""
        body = self.read_json()
        check_strings(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise EngineError(f"model must be a string, got {model!r:.100}", param="model")
        flag(body, "stream")
        flag(body, "return_token_ids")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise EngineError("stream_options must be an object", param="stream_options")
        return body

    def _chat(self, _q: dict) -> None:
        body = self._request_body()
        eng = self.server.engine
        adapter = eng.resolve(body.get("model"))
        params = SamplingParams.from_request(body, chat=True)
        template = template_request(body, self.server.options.trust_request_chat_template)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise EngineError("tools must be a list", param="tools")
        parse_tools = bool(tools) and body.get("tool_choice", "auto") != "none"
        add_prompt = flag(body, "add_generation_prompt", True)
        cont = flag(body, "continue_final_message")
        prompt_ids = self.server.worker.call(lambda: eng.render_chat(
            body.get("messages"), tools, add_generation_prompt=add_prompt, continue_final_message=cont,
            chat_template=template.chat_template, chat_template_kwargs=template.kwargs), control=True)
        self._generate(body, prompt_ids, params, adapter, chat=True, parse_tools=parse_tools)

    def _completions(self, _q: dict) -> None:
        body = self._request_body()
        eng = self.server.engine
        adapter = eng.resolve(body.get("model"))
        if flag(body, "echo"):
            raise EngineError("echo is not supported by the embedded server", param="echo")
        params = SamplingParams.from_request(body, chat=False)
        if params.max_tokens is None:
            params.max_tokens = 16  # OpenAI's and vLLM's default for /v1/completions
        prompt_ids = self.server.worker.call(lambda: eng.encode_prompt(body.get("prompt")), control=True)
        self._generate(body, prompt_ids, params, adapter, chat=False, parse_tools=False)

    def _generate(self, body: dict, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                  *, chat: bool, parse_tools: bool) -> None:
        eng = self.server.engine
        model = body.get("model") or eng.served_model_name
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            outs: list[Completion] = self.server.worker.generate(GenerationJob(prompt_ids, params, adapter)).result(
                timeout=self.server.options.request_timeout_s)
            lp = params.logprobs is not None
            choices = [self._choice(c, chat, want_ids, prompt_ids, parse_tools, lp) for c in outs]
            resp: dict[str, Any] = {
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": _usage(prompt_ids, outs),
            }
            if chat:
                resp["prompt_logprobs"] = None
                resp["prompt_token_ids"] = prompt_ids if want_ids else None
            resp["kv_transfer_params"] = None
            self.send_json(200, resp)
            return
        self._stream(body, prompt_ids, params, adapter, chat, parse_tools, rid, created, model, want_ids)

    def _choice(self, c: Completion, chat: bool, want_ids: bool, prompt_ids: list[int], parse_tools: bool,
                lp: bool) -> dict:
        eng = self.server.engine
        finish = c.finish_reason
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None,
                                       "annotations": None, "audio": None, "function_call": None,
                                       "tool_calls": [], "reasoning_content": None}
            if parse_tools:
                parsed = parse_hermes_tool_calls(c.text)
                if parsed.tool_calls:
                    message["content"] = parsed.content
                    message["tool_calls"] = parsed.tool_calls
                    finish = "tool_calls"
            return {"index": c.index, "message": message,
                    "logprobs": _chat_logprobs(eng, c.token_ids, c.logprobs, c.top_logprobs) if lp else None,
                    "finish_reason": finish, "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if want_ids else None}
        return {"index": c.index, "text": c.text,
                "logprobs": _completion_logprobs(eng, c.token_ids, c.logprobs, c.top_logprobs, 0) if lp else None,
                "finish_reason": finish, "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if want_ids else None, "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if want_ids else None}

    def _stream(self, body: dict, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                chat: bool, parse_tools: bool, rid: str, created: int, model: str, want_ids: bool) -> None:
        eng = self.server.engine
        events: queue.Queue[Delta | BaseException | None] = queue.Queue()
        stop = threading.Event()
        fut = self.server.worker.generate(GenerationJob(prompt_ids, params, adapter, events.put, stop.is_set))
        fut.add_done_callback(lambda f: events.put(f.exception() if f.exception() else None))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = {i: True for i in range(params.n)}
        tool_buf = {i: "" for i in range(params.n)}  # with tools, text after <tool_call> is held
        offsets = {i: 0 for i in range(params.n)}
        started = False

        def chunk(choices: list[dict], **extra: Any) -> bytes:
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
            return sse_data(c)

        try:
            while True:
                ev = events.get(timeout=self.server.options.request_timeout_s)
                if isinstance(ev, BaseException):
                    if not started:
                        raise ev
                    err = ev if isinstance(ev, EngineError) else EngineError(str(ev), 500, "InternalServerError")
                    self.write_chunk(sse_data(error_body(str(err), err.err_type, err.status)))
                    break
                if not started:
                    self.start_stream()
                    started = True
                if ev is None:
                    break
                i = ev.index
                out: list[bytes] = []
                if chat:
                    if first[i]:
                        extra = {"prompt_token_ids": prompt_ids} if want_ids else {}
                        out.append(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **extra))
                        first[i] = False
                    text = ev.text
                    tool_calls = None
                    finish = ev.finish_reason
                    if parse_tools:
                        text, tool_buf[i], tool_calls = split_tool_stream(tool_buf[i], text, finish is not None)
                        if tool_calls:
                            finish = "tool_calls"
                    delta: dict[str, Any] = {"content": text} if text or not tool_calls else {}
                    if tool_calls:
                        delta["tool_calls"] = tool_calls
                    ch: dict[str, Any] = {"index": i, "delta": delta,
                                          "logprobs": _chat_logprobs(eng, ev.token_ids, ev.logprobs, ev.top_logprobs)
                                          if params.logprobs is not None else None,
                                          "finish_reason": finish}
                    ch["stop_reason"] = ev.stop_reason if finish is not None else None
                    if want_ids:
                        ch["token_ids"] = ev.token_ids
                    out.append(chunk([ch]))
                else:
                    ch = {"index": i, "text": ev.text,
                          "logprobs": _completion_logprobs(eng, ev.token_ids, ev.logprobs, ev.top_logprobs, offsets[i])
                          if params.logprobs is not None else None,
                          "finish_reason": ev.finish_reason, "stop_reason": ev.stop_reason}
                    if want_ids:
                        ch["token_ids"] = ev.token_ids
                        if first[i]:
                            ch["prompt_token_ids"] = prompt_ids
                    first[i] = False
                    offsets[i] += len(ev.text)
                    out.append(chunk([ch]))
                self.write_chunk(b"".join(out))
            if started:
                outs = fut.result() if fut.done() and not fut.exception() else None
                if include_usage and outs is not None:
                    self.write_chunk(chunk([], usage=_usage(prompt_ids, outs)))
                self.write_chunk(SSE_DONE)
                self.end_stream()
        except (BrokenPipeError, ConnectionResetError):
            stop.set()
            self.close_connection = True
        except queue.Empty:
            stop.set()
            if not started:
                raise EngineError("generation timed out", 504, "Timeout") from None
            self.close_connection = True


def _usage(prompt_ids: list[int], outs: list[Completion]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in outs)
    return {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + completion,
            "completion_tokens": completion, "prompt_tokens_details": None}


def _chat_logprobs(eng: ModelEngine, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> dict:
    content = []
    for tok, lp, top in zip(ids, lps, tops, strict=True):
        s = eng.decode_token(tok)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (t := eng.decode_token(i)), "logprob": v,
                                          "bytes": list(t.encode("utf-8"))} for i, v in top]})
    return {"content": content}


def _completion_logprobs(eng: ModelEngine, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]],
                         offset: int) -> dict:
    tokens, offsets, top_out = [], [], []
    for tok, top in zip(ids, tops, strict=True):
        s = eng.decode_token(tok)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top_out.append({eng.decode_token(i): v for i, v in top} or None)
    return {"text_offset": offsets, "token_logprobs": list(lps), "tokens": tokens, "top_logprobs": top_out}
