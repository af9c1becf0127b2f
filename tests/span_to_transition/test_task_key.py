"""The task key of a deployed service's requests (issue #27): the two prompt layouts that went wrong,
``--task-key ATTR``, and ``tracerl.task_id`` winning; the pure converter and the store's vectorised
shell (pruning, resource attributes) agree on every one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.records import Span

from .factory import TraceBuilder, system, user
from .test_shell_equivalence import reference, shell_rows

SCHEMA = (
    "You write SQLite. Schema: orders(id, customer, total). Example: Q: how many orders? A: SELECT count(*)"
)
FEW_SHOT = [
    user("how many orders?"),
    {"role": "assistant", "content": "SELECT count(*) FROM orders"},
    user("largest total?"),
    {"role": "assistant", "content": "SELECT max(total) FROM orders"},
]


def request(
    n: int, prompt: list[dict], *, attrs: dict | None = None, resource: dict | None = None
) -> list[Span]:
    """One service request: a FastAPI-like server span (its attributes are no dialect's, so the shell
    prunes it unless a key names them), one chat call, a user's feedback reward."""
    t = TraceBuilder(f"{n:032x}")
    root = t.span("POST /v1/sql", None, {"http.method": "POST", **(attrs or {})})
    t.chat(root, prompt, "SELECT 1", response_id=f"resp-{n}")
    t.reward(root, float(n % 2))
    return [replace(s, resource_attributes=dict(resource or {})) for s in t.spans]


def task_ids(spans: list[Span], config: ConvertConfig | None = None) -> dict[str, str | None]:
    """rollout -> task id from the pure converter, after checking the store's shell gives the same rows."""
    config = config or ConvertConfig()
    assert shell_rows(spans, config) == reference(spans, config)
    out = {}
    for rid in sorted({s.rollout_id for s in spans}):
        rows = convert_rollout(
            RolloutInput(rid, [s for s in spans if s.rollout_id == rid]), config
        ).transitions
        out[rid] = rows[0].task_id
    return out


def test_distinct_questions_behind_one_system_prompt_are_distinct_tasks():
    spans = [s for n in range(4) for s in request(n, [system(SCHEMA), user(f"question {n}?")])]
    ids = task_ids(spans)
    assert len(set(ids.values())) == 4 and all(v.startswith("h:") for v in ids.values())


def test_distinct_questions_after_few_shot_turns_are_distinct_tasks():
    """The examples sent as user/assistant turns: the first user message is the same example every time,
    which grouped all 48 requests of the issue into one task."""
    spans = [s for n in range(4) for s in request(n, [system("SQL"), *FEW_SHOT, user(f"question {n}?")])]
    assert len(set(task_ids(spans).values())) == 4


def test_the_same_request_twice_is_one_task_and_a_changed_preamble_is_not():
    same = [system(SCHEMA), user("total of customer 7?")]
    spans = (
        request(1, same)
        + request(2, same)
        + request(3, [system(SCHEMA + " v2"), user("total of customer 7?")])
    )
    ids = task_ids(spans)
    assert ids[f"{1:032x}"] == ids[f"{2:032x}"] != ids[f"{3:032x}"]


def test_task_key_names_a_span_or_resource_attribute_and_tracerl_task_id_wins():
    prompt = [system(SCHEMA), user("q")]
    spans = (
        request(1, [*prompt, user("a")], attrs={"http.route": "/v1/sql"})  # on a span the shell would prune
        + request(2, [*prompt, user("b")], attrs={"http.route": "/v1/sql"})
        + request(3, prompt, resource={"app.tenant": "acme"})
        + request(4, prompt, attrs={"http.route": "/v1/sql", "tracerl.task_id": "t-4"})
    )
    by_route = task_ids(spans, ConvertConfig(task_key="http.route"))
    assert list(by_route.values())[:2] == ["/v1/sql", "/v1/sql"] and by_route[f"{4:032x}"] == "t-4"
    assert by_route[f"{3:032x}"].startswith("h:")  # no such attribute: the prompt hash
    assert (
        task_ids(spans, ConvertConfig(task_key="app.tenant"))[f"{3:032x}"] == "acme"
    )  # a resource attribute


@pytest.mark.parametrize("bad", ["", " http.route"])
def test_a_blank_task_key_is_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match=r"--task-key .* must name an attribute"):
        ConvertConfig(task_key=bad).validate()
