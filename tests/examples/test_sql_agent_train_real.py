"""examples/sql_agent/train_real.py's command lines: what `tracerl train`, `collect`, `serve` and `gateway` make of
them (pure: parsed with each command's own parser, nothing started)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from tracerl.commands import collect, gateway, serve, train
from tracerl.stack import StackPorts, stack_argvs

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "sql_agent" / "train_real.py"


def _load():
    spec = importlib.util.spec_from_file_location("sql_train_real", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _parsed(command, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(argv)


def test_the_trainer_watches_for_one_batch_per_round_of_training_questions_only():
    run = _load()
    args, _ = run.parse_args(["--model", "/m", "--agent-bin", "/b", "--rounds", "3", "--estimator", "grpo"])
    cmd = run.train_cmd(args, Path("/s"), "/m", "http://127.0.0.1:9", batch=32)
    t = _parsed(train, cmd[2:])
    assert (t.watch, t.store, t.model, t.server, t.min_rollouts, t.max_rounds) == (
        True, "/s", "/m", "http://127.0.0.1:9", 32, 3)  # fmt: skip
    assert (t.tasks, t.estimator, t.lora_rank, t.bf16, t.steps_per_epoch, t.pack_tokens) == (
        "^train-", "grpo", 16, True, 1, 640)  # fmt: skip


def test_the_stack_converts_the_two_trainable_agents_and_serves_on_one_thread(tmp_path):
    run = _load()
    cfg = run.stack_config(Path("/s"), tmp_path, "/m", concurrency=32)
    argvs = stack_argvs(cfg, StackPorts(grpc=1, http=2, serve=3, gateway=4))
    c, s, g = (_parsed(cmd, argvs[name][2:]) for name, cmd in (("collect", collect), ("serve", serve),
                                                                ("gateway", gateway)))  # fmt: skip
    assert (c.convert, c.agents, c.workers) == (True, "writer|rewriter", 1)
    assert (s.engine, s.threads, s.max_num_seqs) == ("embedded", 1, 32)
    assert (g.upstream, g.models_ttl_s) == ("http://127.0.0.1:3", 0.5)
