"""Shared fixtures: a real tiny model built locally and a factory for transitions rows."""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from schemas.tables import TRANSITIONS_SCHEMA
from store.layout import StoreLayout
from store.parquet import write_table_atomic
from trainer.config import TrainSettings


@pytest.fixture(scope="session", autouse=True)
def no_compiled_extensions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No trainer test may compile a C++ extension (DeepSpeed's JIT ops would take minutes here): torch's
    JIT builds go to ``TORCH_EXTENSIONS_DIR``, which every process of the session inherits (torchrun
    ranks too), so it must still be empty at the end."""
    path = tmp_path_factory.mktemp("torch_extensions")
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    yield path
    if before is None:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = before
    built = sorted(p.name for p in path.iterdir())
    assert not built, f"C++ extensions were compiled during the tests: {built}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def transition_row(
    rollout_id: str,
    *,
    task_id: str = "task-0",
    step: int = 0,
    version: int = 0,
    reward: float = 0.0,
    prompt_ids: list[int] | None = None,
    response_ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    trainable: bool = True,
    agent: str = "solver",
    is_last: bool = True,
    prompt: str = "hi",
    response: str = "hello",
    transition_id: str | None = None,
) -> dict:
    """One TRANSITIONS_SCHEMA row; without token ids it is a ``retokenized`` row."""
    has_ids = prompt_ids is not None and response_ids is not None
    return {
        "transition_id": transition_id or f"{rollout_id}-{step}-{uuid.uuid4().hex[:6]}",
        "rollout_id": rollout_id,
        "task_id": task_id,
        "trace_id": uuid.uuid4().hex,
        "span_id": uuid.uuid4().hex[:16],
        "step": step,
        "agent_name": agent,
        "trainable": trainable,
        "model": f"policy@{version}",
        "policy_version": version,
        "prompt_messages": json.dumps([{"role": "user", "content": prompt}]),
        "tools": None,
        "response_message": json.dumps({"role": "assistant", "content": response}),
        "finish_reason": "stop",
        "prompt_token_ids": prompt_ids if has_ids else [],
        "response_token_ids": response_ids if has_ids else [],
        "response_logprobs": logprobs if has_ids else None,
        "token_source": "gateway" if has_ids else "retokenized",
        "reward": reward,
        "rollout_reward": reward,
        "reward_source": "span",
        "is_last": is_last,
        "started_at": None,
        "ended_at": None,
        "input_tokens": len(prompt_ids or []),
        "output_tokens": len(response_ids or []),
    }


def write_transitions(store: Path, rows: list[dict], *, date: str = "2026-11-21", name: str | None = None) -> Path:
    """Write rows as one committed transitions file, the way the converter does."""
    table = pa.Table.from_pylist(rows, schema=TRANSITIONS_SCHEMA)
    path = StoreLayout.at(store).partition("transitions", date) / (name or f"part-{uuid.uuid4().hex}.parquet")
    return write_table_atomic(table, path, "transitions")


@pytest.fixture
def make_row() -> Callable[..., dict]:
    return transition_row


@pytest.fixture
def write_rows() -> Callable[..., Path]:
    return write_transitions


def rollouts_for_version(tokenizer, make_row, version: int, n_tasks: int = 3, per_task: int = 4,
                         two_calls_every: int = 3) -> list[dict]:
    """Rollouts with real token ids and varied rewards; some rollouts make two calls."""
    rows = []
    for t in range(n_tasks):
        prompt = [{"role": "user", "content": f"task {t}: say something nice"}]
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(per_task):
            rid = f"v{version}-t{t}-r{i}"
            reward = float((i + t) % 3) / 2.0
            n_calls = 2 if i % two_calls_every == 0 else 1
            for step in range(n_calls):
                r_ids = tokenizer(f"answer {i} part {step}", add_special_tokens=False)["input_ids"]
                r_ids = [*r_ids, tokenizer.eos_token_id]
                rows.append(make_row(rid, task_id=f"v{version}-task{t}", step=step, version=version, reward=reward,
                                     prompt_ids=p_ids, response_ids=r_ids, logprobs=[-2.0] * len(r_ids),
                                     is_last=step == n_calls - 1))
    return rows


def settings_for(store: Path, model: Path, **kw) -> TrainSettings:
    base = {"store": str(store), "model": str(model), "min_rollouts": 8, "lr": 1e-3, "progress": False,
            "pack_tokens": 256}
    return TrainSettings(**{**base, **kw})


@pytest.fixture
def make_rollouts(tokenizer) -> Callable[..., list[dict]]:
    """``make_rollouts(version, n_tasks=3, per_task=4)``: rows of rollouts with real token ids."""
    return functools.partial(rollouts_for_version, tokenizer, transition_row)


@pytest.fixture
def train_settings(tiny_model_dir: Path) -> Callable[..., TrainSettings]:
    """``train_settings(store, **overrides)``: fast TrainSettings for the tiny model."""
    return lambda store, **kw: settings_for(store, tiny_model_dir, **kw)
