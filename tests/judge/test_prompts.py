"""The judge's prompts: a group of 8 in one prompt with the shared prefix once; pointwise; the rubric hash."""

from __future__ import annotations

from judge.prompts import default_rubric, group_request, pointwise_request, retry_messages, rubric_hash

from .helpers import DRAFTS, SHOTS, sql_rollout


def test_a_group_of_8_is_one_prompt_with_the_shared_prefix_once() -> None:
    group = [sql_rollout(i) for i in range(8)]
    req = group_request("madrid", group, "Right answers win.")
    assert req.rollout_ids == [r.rollout_id for r in group] and req.ids == [str(i) for i in range(1, 9)]
    system, user = req.messages[0]["content"], req.messages[1]["content"]
    assert "Right answers win." in system and "8 trajectories" in system
    assert user.count(SHOTS[0]["content"]) == 1  # the few-shot turn: in the shared block only
    # the writer's question once (shared), then each rewriter's own prompt, which quotes its draft
    assert user.count("[user] Question: How many customers live in Madrid?\n</shared>") == 1
    assert user.count("[user] Question: How many customers live in Madrid?\n") == 1 + 8
    for i in range(1, 9):
        assert user.count(f'<trajectory id="{i}">') == 1
    for d in set(DRAFTS):  # every answer is shown, in its own trajectory (writer and rewriter)
        assert f"[assistant] {d}" in user
    assert user.index("<shared>") < user.index('<trajectory id="1">')


def test_pointwise_shows_the_whole_trajectory_and_no_shared_block() -> None:
    req = pointwise_request(sql_rollout(3), "Right answers win.")
    user = req.messages[1]["content"]
    assert req.rollout_ids == ["r3-madrid"] and req.ids == ["1"]
    assert "<shared>" not in user and SHOTS[0]["content"] in user and DRAFTS[3] in user
    assert "against the rubric" in req.messages[0]["content"]


def test_a_single_rollout_group_has_no_shared_block() -> None:
    user = group_request("t", [sql_rollout(0)], "r").messages[1]["content"]
    assert "<shared>" not in user and SHOTS[0]["content"] in user


def test_the_retry_quotes_the_parse_error_and_the_bad_answer() -> None:
    req = group_request("madrid", [sql_rollout(i) for i in range(2)], "r")
    msgs = retry_messages(req, "I think 1 is best", "no JSON object in the answer")
    assert msgs[:2] == req.messages and msgs[2] == {"role": "assistant", "content": "I think 1 is best"}
    assert "no JSON object in the answer" in msgs[3]["content"] and "1, 2" in msgs[3]["content"]


def test_rubric_hash_is_stable_and_names_rubric_mode_and_model() -> None:
    h = rubric_hash("Be right.\n", "group", "m")
    assert h == rubric_hash("  Be right.\r\n\n", "group", "m")  # whitespace and line endings aside
    assert (
        len(
            {
                h,
                rubric_hash("Be right!", "group", "m"),
                rubric_hash("Be right.", "pointwise", "m"),
                rubric_hash("Be right.", "group", "other"),
            }
        )
        == 4
    )
    assert (
        h == "2bddb805756b449d"
    )  # pinned: the same on every machine and run (a change re-judges every rollout)


def test_the_default_rubric_ships_with_the_package() -> None:
    text = default_rubric()
    assert "final answer" in text and len(text) > 200
