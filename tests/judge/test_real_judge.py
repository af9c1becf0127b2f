"""The judge against a real endpoint: vLLM (CPU) serving SmolLM2-135M-Instruct judges a group of 8 in one call.

SmolLM2-135M is a weak judge; what this checks is the contract with a real OpenAI-compatible server:
``response_format`` with the answer's JSON schema is accepted (no fallback), guided decoding makes the
small model answer parseable JSON, and the pass writes 8 rows with scores in [0, 1], or counts a failure
and writes none. The test prints which happened.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from real_model import SMOLLM2, real_model_dir

from judge.config import JudgeSettings
from judge.stage import load_state, run_once
from store.location import parse_store
from store.views import connect_readonly

from .store_rig import make_store

_spec = importlib.util.spec_from_file_location(
    "judge_vllm_rig", Path(__file__).resolve().parents[1] / "serving" / "vllm_rig.py"
)
vllm_rig = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = vllm_rig  # its dataclasses look their module up there
_spec.loader.exec_module(vllm_rig)


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)
def test_real_vllm_serving_smollm2_judges_a_group_of_8_in_one_call(tmp_path: Path) -> None:
    model = real_model_dir()
    make_store(tmp_path, tasks=1, per_task=8)
    with vllm_rig.running_vllm(model, tmp_path / "vllm.log", "--max-model-len", "4096") as vllm:
        settings = JudgeSettings(
            store=str(tmp_path),
            judge_url=f"{vllm.url}/v1",
            judge_model="policy",
            group_wait_s=0,
            judge_timeout_s=600,
        )
        stats = run_once(settings)
        again = run_once(settings)
    print(stats.summary())
    assert (stats.requests, stats.structured_fallbacks, stats.unavailable) == (1, 0, {})
    assert stats.prompt_tokens > 0 and stats.completion_tokens > 0
    con = connect_readonly(parse_store(tmp_path))
    rows = con.execute("SELECT value, explanation, judge_prompt_tokens, source FROM rewards").fetchall()
    if stats.groups_scored:
        print("real judge: 8 scores", sorted(r[0] for r in rows))
        assert stats.calls in (1, 2) and len(rows) == 8 and {r[3] for r in rows} == {"judge"}
        assert all(0.0 <= r[0] <= 1.0 and isinstance(r[1], str) for r in rows)
        assert sum(r[2] for r in rows) == stats.prompt_tokens
        assert (again.candidates, again.requests) == (0, 0)  # judged once, never again
    else:
        print("real judge: counted failure", stats.failures)
        assert rows == [] and sum(stats.failures.values()) == 1 and stats.calls == 2
        assert len(next(iter(load_state(parse_store(str(tmp_path)), "judge")["failed"].values()))) == 8
        assert (again.skipped_failed, again.requests) == (8, 0)
