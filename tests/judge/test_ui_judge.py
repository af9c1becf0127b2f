"""`tracerl ui` shows the judge's score and explanation beside a judged rollout's reward (escaped)."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from judge.config import JudgeSettings
from judge.stage import run_once
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.location import parse_store
from ui.app import UiConfig, make_app

from .store_rig import LATER, answer, make_store, scripted_judge, trajectories_in, user_prompt


def test_a_judged_rollout_page_shows_the_judges_reason(tmp_path) -> None:
    drafts = make_store(tmp_path, tasks=1, per_task=2)

    def judge(body, n):
        ids = trajectories_in(user_prompt(body))
        return 200, answer(
            json.dumps(
                {
                    "scores": {
                        i: {"explanation": f"<b>trajectory {i}</b> ok", "score": 0.25 * int(i)} for i in ids
                    }
                }
            )
        )

    with scripted_judge(judge) as (url, _):
        assert (
            run_once(
                JudgeSettings(store=str(tmp_path), judge_url=url, judge_model="jm", group_wait_s=0)
            ).rows_written
            == 2
        )
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="keep", workers=1), now_ns=LATER)
    first = sorted(drafts)[0]
    page = TestClient(make_app(UiConfig(store=parse_store(tmp_path)))).get(f"/rollouts/{first}")
    assert page.status_code == 200
    assert 'class="judge-score">0.250</span>' in page.text
    assert "&lt;b&gt;trajectory 1&lt;/b&gt; ok" in page.text and "<b>trajectory" not in page.text  # escaped
    assert "(jm)" in page.text
    group = TestClient(make_app(UiConfig(store=parse_store(tmp_path)))).get("/tasks/task-0")
    assert group.status_code == 200
    assert group.text.count('class="judge-explanation muted">judge (judge) ') == 2
    assert "0.500: &lt;b&gt;trajectory 2&lt;/b&gt; ok" in group.text
