"""bench/judge.py: the shared prefix sent once costs <= 0.5x the prompt tokens of judging each rollout alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from real_model import SMOLLM2, real_model_dir

BENCH = Path(__file__).resolve().parents[2] / "bench" / "judge.py"


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)
def test_group_prompts_cost_at_most_half_the_tokens_of_judging_each_rollout_alone() -> None:
    from transformers import AutoTokenizer

    from judge.prompts import default_rubric

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir())
    spec = importlib.util.spec_from_file_location("tracerl_bench_judge", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    groups, grades = bench.demo_groups(2)
    assert (
        set(grades) == {r.rollout_id for g in groups for r in g} and max(grades.values()) == 1.0
    )  # gold drafts
    assert [len(g) for g in groups] == [8, 8] and len({r.task_id for r in groups[0]}) == 1
    f = bench.token_figures(groups, tokenizer, default_rubric())
    assert f["rollouts"] == 16 and f["alone_per_rollout"] > 400  # the demo's few-shot prompt, per rollout
    assert f["ratio"] <= 0.5, f
