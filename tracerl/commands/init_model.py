"""Build a tiny random-weight causal LM and a real BPE tokenizer with a ChatML chat template.

No model hub is reachable on CI or in air-gapped labs; this writes a model directory that
loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` and that ``tracerl serve`` and
``tracerl train`` accept. The same seed gives byte-identical files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tracerl.options import UsageError, add_options, from_args, opt


@dataclass
class InitModelConfig:
    """Settings for ``tracerl init-model``."""

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
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.force:
        raise UsageError(f"{out} exists and is not empty; pass --force to overwrite it or pick another DIR")
    if cfg.hidden % 4 != 0 or cfg.hidden <= 0 or cfg.layers <= 0:
        raise UsageError(f"--hidden must be a positive multiple of 4 (4 attention heads), got {cfg.hidden}; "
                         f"--layers must be positive, got {cfg.layers}")
    from serving.tiny_model import build_tiny_model

    path = build_tiny_model(out, seed=cfg.seed, arch=cfg.arch, hidden=cfg.hidden, layers=cfg.layers)
    print(f"wrote tiny {cfg.arch} model to {path} (seed {cfg.seed}); serve it with: tracerl serve --model {path}")
    return 0
