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
  ``POST /reset_prefix_cache`` (200, empty body; this engine caches no prefixes, so there is
  nothing to clear, but the publish client calls it as on vLLM); ``POST /update_weight_version``
  ``{"new_version": str}`` -> ``{"success": true, "new_version"}`` and ``GET /weight_info`` ->
  ``{"weight_version": str | null}`` (vLLM main after 0.12, same rlhf router file).

HTTP runs on ``httpshell`` (uvicorn, as vLLM's own server): the bearer token (``--api-key``) is
checked before a body is read, bodies and connections are bounded, and the engine stays on its one
thread (``EngineWorker``) while the event loop only waits on it. The endpoints that change the
served model refuse cross-site requests (``cross_site_refusal``). A request's own chat template is
refused unless ``trust_request_chat_template`` (vLLM's ``--trust-request-chat-template``), and every
sampling field is checked before the request joins a batch (``serving.embedded.sampling``).

A disabled endpoint answers 404 ``{"detail": "Not Found"}``, as FastAPI does in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from httpshell import ServerOptions
from serving.asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    ShellServer,
    error_response,
    json_response,
    read_json,
    stream_out,
)
from serving.embedded.engine import (
    Completion,
    Delta,
    EngineError,
    GenerationJob,
    ModelEngine,
    SamplingParams,
)
from serving.embedded.responses import StreamChunks, choice, usage
from serving.embedded.sampling import check_strings, flag, template_request
from serving.embedded.worker import EngineWorker
from serving.protocol import SSE_DONE, error_body, new_id, sse_data

Handler = Callable[[Request], Awaitable[Any]]


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
    batch_wait_ms: float = 50.0  # [--batch-wait-ms] how long a batch's first request waits for company
    max_connections: int = 1024  # open client connections; more are answered 503
    tls_cert: str | None = None  # [--ssl-certfile] PEM chain; with tls_key the server speaks HTTPS only
    tls_key: str | None = None  # [--ssl-keyfile]
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


class EmbeddedServer(ShellServer):
    """HTTP app + engine worker; ``EmbeddedServer.start(model_dir)`` for tests and the CLI."""

    def __init__(self, address: tuple[str, int], engine: ModelEngine, options: ServeOptions):
        super().__init__(ServerOptions(
            host=address[0], port=address[1], tls_cert=options.tls_cert, tls_key=options.tls_key,
            token=options.api_key, public_paths=frozenset({"/health"}), max_body_bytes=options.max_body_bytes,
            max_connections=options.max_connections, name="tracerl-serve",
            auth_hint="; send the server's --api-key as the client's api_key"))
        self.engine = engine
        self.worker = EngineWorker(engine, max_batch=options.max_num_seqs,
                                   batch_wait_s=options.batch_wait_ms / 1000)
        self.options = options
        self.created = int(time.time())
        self.allowed_hosts: frozenset[str] = frozenset()
        self.routes = self._routes()

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

    def start_background(self) -> EmbeddedServer:
        super().start_background()
        host, port = self.server_address
        self.allowed_hosts = host_allow_list(host, port, self.options.allowed_hosts)
        return self

    def stop(self) -> None:
        super().stop()
        self.worker.close()
        self.engine.release()

    def _routes(self) -> dict[tuple[str, str], Handler]:
        routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
        }
        if self.options.enable_lora_updating:
            routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora
        if self.options.dev_mode:
            routes.update({
                ("POST", "/collective_rpc"): self._collective_rpc,
                ("POST", "/pause"): self._pause,
                ("POST", "/resume"): self._resume,
                ("GET", "/is_paused"): self._is_paused,
                ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
                ("POST", "/update_weight_version"): self._update_weight_version,
                ("GET", "/weight_info"): self._weight_info,
            })
        return routes

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        request = Request(scope, receive)
        fn = self.routes.get((method, path))
        try:
            if fn is None:  # FastAPI's answers, which the publish client reads as "flag missing"
                known = any(p == path for _, p in self.routes)
                response = json_response(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            else:
                if method == "POST" and path in STATE_CHANGING:
                    why = cross_site_refusal(request.headers.get("content-type"), request.headers.get("host"),
                                             self.allowed_hosts)
                    if why:
                        raise HTTPError(403, why, "PermissionDenied")
                response = await fn(request)
        except HTTPError as e:
            response = error_response(e)
        except EngineError as e:
            response = json_response(e.status, error_body(str(e), e.err_type, e.status, e.param))
        except Exception as e:  # the server must answer, whatever broke
            response = json_response(500, error_body(f"{type(e).__name__}: {e}", "InternalServerError", 500))
        await response(scope, receive, send)

    async def _engine(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the engine thread, ahead of queued generations, without blocking the loop."""
        fut = self.worker.submit(fn, control=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout or self.options.request_timeout_s)

    # -- simple endpoints ------------------------------------------------------------------

    async def _health(self, _r: Request) -> Response:
        return Response(b"", 200, media_type="application/json")

    async def _models(self, _r: Request) -> Response:
        eng = self.engine
        perm = {"id": new_id("modelperm"), "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}
        data = [{"id": eng.served_model_name, "object": "model", "created": self.created,
                 "owned_by": "vllm", "root": eng.model_dir, "parent": None,
                 "max_model_len": eng.max_model_len, "permission": [perm]}]
        for a in list(eng.adapters.values()):
            data.append({"id": a.name, "object": "model", "created": self.created, "owned_by": "vllm",
                         "root": a.path, "parent": eng.served_model_name, "max_model_len": None,
                         "permission": [perm]})
        return json_response(200, {"object": "list", "data": data})

    async def _load_lora(self, request: Request) -> Response:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise EngineError("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        inplace = bool(body.get("load_inplace", False))
        await self._engine(lambda: self.engine.load_lora(name, path, inplace))
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: Request) -> Response:
        name = (await read_json(request)).get("lora_name")
        if not name:
            raise EngineError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
        await self._engine(lambda: self.engine.unload_lora(name))
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _collective_rpc(self, request: Request) -> Response:
        body = await read_json(request)
        method = body.get("method")
        if method is None:
            raise HTTPError(400, "Missing 'method' in request body", "Bad Request")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if method == "reload_weights":
            await self._engine(lambda: self.engine.reload_weights(*args, **kwargs))
            return json_response(200, {"results": [None]})
        raise EngineError(f"'Worker' object has no attribute '{method}' (the embedded server supports "
                          "collective_rpc method 'reload_weights' only)", 500, "Internal Server Error")

    async def _pause(self, request: Request) -> Response:
        await request.body()
        await run_in_threadpool(self.worker.pause, request.query_params.get("mode") or "abort")
        return json_response(200, {"status": "paused"})

    async def _resume(self, request: Request) -> Response:
        await request.body()
        await run_in_threadpool(self.worker.resume)
        return json_response(200, {"status": "resumed"})

    async def _is_paused(self, _r: Request) -> Response:
        return json_response(200, {"is_paused": self.worker.paused})

    async def _update_weight_version(self, request: Request) -> Response:
        version = (await read_json(request)).get("new_version")
        if not isinstance(version, str):
            raise HTTPError(422, "new_version (a string) is required", "Unprocessable Entity")
        await self._engine(lambda: setattr(self.engine, "weight_version", version))
        return json_response(200, {"success": True, "new_version": version})

    async def _weight_info(self, _r: Request) -> Response:
        return json_response(200, {"weight_version": self.engine.weight_version})

    async def _reset_prefix_cache(self, request: Request) -> Response:
        await request.body()

        await self._engine(self.engine.reset_prefix_cache)
        return Response(b"", 200, media_type="application/json")

    # -- generation ------------------------------------------------------------------------

    async def _request_body(self, request: Request) -> dict[str, Any]:
        """A generation request, with the fields every endpoint shares checked before it queues."""
        body = await read_json(request)
        check_strings(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise EngineError(f"model must be a string, got {model!r:.100}", param="model")
        flag(body, "stream")
        flag(body, "return_token_ids")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise EngineError("stream_options must be an object", param="stream_options")
        return body

    async def _chat(self, request: Request) -> Any:
        body = await self._request_body(request)
        eng = self.engine
        adapter = eng.resolve(body.get("model"))
        params = SamplingParams.from_request(body, chat=True)
        template = template_request(body, self.options.trust_request_chat_template)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise EngineError("tools must be a list", param="tools")
        parse_tools = bool(tools) and body.get("tool_choice", "auto") != "none"
        add_prompt = flag(body, "add_generation_prompt", True)
        cont = flag(body, "continue_final_message")
        prompt_ids = await self._engine(lambda: eng.render_chat(
            body.get("messages"), tools, add_generation_prompt=add_prompt, continue_final_message=cont,
            chat_template=template.chat_template, chat_template_kwargs=template.kwargs))
        return await self._generate(body, prompt_ids, params, adapter, chat=True, parse_tools=parse_tools)

    async def _completions(self, request: Request) -> Any:
        body = await self._request_body(request)
        eng = self.engine
        adapter = eng.resolve(body.get("model"))
        if flag(body, "echo"):
            raise EngineError("echo is not supported by the embedded server", param="echo")
        params = SamplingParams.from_request(body, chat=False)
        if params.max_tokens is None:
            params.max_tokens = 16  # OpenAI's and vLLM's default for /v1/completions
        prompt_ids = await self._engine(lambda: eng.encode_prompt(body.get("prompt")))
        return await self._generate(body, prompt_ids, params, adapter, chat=False, parse_tools=False)

    async def _generate(self, body: dict, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                        *, chat: bool, parse_tools: bool) -> Any:
        eng = self.engine
        model = body.get("model") or eng.served_model_name
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            fmt = StreamChunks(eng, chat=chat, n=params.n, rid=rid, created=created, model=model,
                               prompt_ids=prompt_ids, want_ids=want_ids, logprobs=params.logprobs is not None,
                               parse_tools=parse_tools)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _EngineStream.open(self, GenerationJob(prompt_ids, params, adapter), fmt, include_usage)
        fut = self.worker.generate(GenerationJob(prompt_ids, params, adapter))
        outs: list[Completion] = await asyncio.wait_for(asyncio.wrap_future(fut), self.options.request_timeout_s)
        lp = params.logprobs is not None
        choices = [choice(eng, c, chat=chat, want_ids=want_ids, prompt_ids=prompt_ids, parse_tools=parse_tools,
                          logprobs=lp) for c in outs]
        resp: dict[str, Any] = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": usage(prompt_ids, outs),
        }
        if chat:
            resp["prompt_logprobs"] = None
            resp["prompt_token_ids"] = prompt_ids if want_ids else None
        resp["kv_transfer_params"] = None
        return json_response(200, resp)


class _EngineStream:
    """One streamed generation: deltas cross from the engine thread to the event loop through a queue;
    the client leaving sets the job's cancel flag, so the engine stops sampling for it."""

    def __init__(self, server: EmbeddedServer, fut: Future, events: asyncio.Queue, stop: threading.Event,
                 fmt: StreamChunks, include_usage: bool):
        self.server, self.fut, self.events, self.stop = server, fut, events, stop
        self.fmt, self.include_usage = fmt, include_usage
        self.first: Delta | None = None

    @classmethod
    async def open(cls, server: EmbeddedServer, job: GenerationJob, fmt: StreamChunks,
                   include_usage: bool) -> _EngineStream:
        """Queue the job and wait for its first delta, so an early refusal is still a plain error answer."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        def put(ev: Delta | BaseException | None) -> None:  # called on the engine thread
            with contextlib.suppress(RuntimeError):  # the server's loop is gone (stopped): nobody listens
                loop.call_soon_threadsafe(events.put_nowait, ev)

        stop = threading.Event()
        job.on_delta, job.cancelled = put, stop.is_set
        fut = server.worker.generate(job)
        fut.add_done_callback(lambda f: put(f.exception()))
        stream = cls(server, fut, events, stop, fmt, include_usage)
        first = await stream._next()
        if isinstance(first, BaseException):
            raise first
        stream.first = first
        return stream

    async def _next(self) -> Delta | BaseException | None:
        try:
            return await asyncio.wait_for(self.events.get(), self.server.options.request_timeout_s)
        except asyncio.TimeoutError:
            self.stop.set()
            return EngineError("generation timed out", 504, "Timeout")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await stream_out(receive, send, self._chunks())
        finally:
            self.stop.set()  # a no-op when the job is done; stops sampling when the client left

    async def _chunks(self) -> AsyncIterator[bytes]:
        ev = self.first
        while ev is not None:
            if isinstance(ev, BaseException):
                err = ev if isinstance(ev, EngineError) else EngineError(str(ev), 500, "InternalServerError")
                yield sse_data(error_body(str(err), err.err_type, err.status))
                yield SSE_DONE
                return
            yield self.fmt.delta(ev)
            ev = await self._next()
        outs = self.fut.result() if self.fut.done() and not self.fut.exception() else None
        if self.include_usage and outs is not None:
            yield self.fmt.chunk([], usage=usage(self.fmt.prompt_ids, outs))
        yield SSE_DONE


def _text(message: str) -> Response:
    return Response(message.encode(), 200, media_type="text/plain; charset=utf-8")
