"""Strands Agents, smolagents and LlamaIndex agents, unchanged, through tracerl: the transitions equal the wire.

Each agent (``tests/examples/frameworks/*_agent.py``) runs in its framework's own virtualenv under
``opentelemetry-instrument``, through the real ``tracerl rollout`` driver, collector and gateway, against the
scripted engine (``model_script.reply``: call ``get_weather``, then answer), which logs every request it
receives. None of these instrumentations sends ``traceparent``; smolagents runs on the current openai 3.x
client. Checked per run: the transitions equal the logged requests and replies (roles, text, tool calls, tool
results, order), ``--agents NAME`` selects the agent by the name the user gave it, and every call gets the
gateway's exact token ids although its gateway span landed in a trace of its own: joined by the response id
where the span records it, else by content (the request's messages and the response equal, a unique match).

Two virtualenvs (the frameworks' openai pins disagree), each built once per requirements hash:
``.venv-examples/frameworks-openai2`` (Strands, LlamaIndex) and ``.venv-examples/frameworks-openai3`` (smolagents).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from example_rig import answer_text, example_venv, prompt_text, running_stack, token_ids
from tracerl_testing import wire_message

from store.location import parse_store

HERE = Path(__file__).resolve().parent / "frameworks"
sys.path.insert(0, str(HERE))
from model_script import reply  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.prebuilt("frameworks-openai2", "frameworks-openai3")]


@dataclass(frozen=True)
class Case:
    venv: str
    agent: str
    env: tuple[tuple[str, str], ...]
    name: str  # the agent's name as its user gave it
    response_id: bool  # its call spans record the response id (the join's first key; the rest join by content)


CASES = {
    "strands": Case("openai2", "strands_agent.py", (), "weather", False),  # Strands records no response id
    "strands-latest": Case("openai2", "strands_agent.py",
                           (("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental"),), "weather", False),
    "smolagents": Case("openai3", "smol_agent.py", (), "calculator", True),
    "smolagents-stream": Case("openai3", "smol_agent.py", (("AGENT_STREAM", "1"),), "calculator", False),
    "llamaindex": Case("openai2", "llama_agent.py", (), "weather", True),
    "llamaindex-stream": Case("openai2", "llama_agent.py", (("AGENT_STREAM", "1"),), "weather", False),
}
"""Streamed, smolagents keeps no raw response and LlamaIndex records none, so neither records the response id."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], list[dict], list[str], Path]]:
    """Every case through ``tracerl rollout`` on one stack: (rows, requests, conversion problems, store) per case."""
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from store.layout import StoreLayout
    from store.parquet import read_table

    bins = {v: example_venv(f"frameworks-{v}") for v in ("openai2", "openai3")}
    store = tmp_path_factory.mktemp("frameworks") / "store"
    sent: dict[str, list[dict]] = {}
    with running_stack(store, reply) as stack:
        for case_id, case in CASES.items():
            before = len(stack.engine.requests)
            stack.rollout(bins[case.venv], ["python", str(HERE / case.agent)],
                          # a question of its own per case: two cases that send the same request (a framework
                          # streamed and not) one after the other would tie in the content join, which never guesses
                          [{"id": case_id, "question": f"What is the weather in Paris? ({case_id})"}],
                          extra_env=dict(case.env))
            sent[case_id] = stack.engine.requests[before:]
        stack.provider.force_flush()
        stack.collector.flush()
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, missing_reward="fill"))
    table = read_table(StoreLayout.at(store).table("transitions"), "transitions").drop_columns(["started_at", "ended_at"])
    rows = sorted(table.to_pylist(), key=lambda r: (r["task_id"], r["step"]))
    return {c: ([r for r in rows if r["task_id"] == c], sent[c], stats.problems, store) for c in CASES}


@pytest.mark.parametrize("case_id", list(CASES))
def test_transitions_equal_the_wire_and_the_agent_is_named_as_its_user_named_it(runs, case_id: str) -> None:
    rows, requests, _, _ = runs[case_id]
    assert len(requests) == len(rows) == 2, (case_id, rows)
    for row, request in zip(rows, requests):
        assert [wire_message(m) for m in json.loads(row["prompt_messages"])] == \
            [wire_message(m) for m in request["messages"]]
        assert wire_message(json.loads(row["response_message"])) == wire_message({"role": "assistant", **reply(request)})
        assert row["agent_name"] == CASES[case_id].name


@pytest.mark.parametrize("case_id", list(CASES))
def test_exact_token_ids_join_without_traceparent_by_response_id_or_by_content(runs, case_id: str) -> None:
    """Issue #30's target: ``token_source=gateway`` for every framework case behind the gateway, streamed or not,
    including those whose spans record no response id (Strands, streamed smolagents and LlamaIndex)."""
    rows, requests, problems, _ = runs[case_id]
    for row, request in zip(rows, requests):
        assert row["token_source"] == "gateway", (case_id, CASES[case_id].response_id)
        assert row["prompt_token_ids"] == token_ids(prompt_text(request))
        assert row["response_token_ids"] == token_ids(answer_text({"role": "assistant", **reply(request)}))
    assert not any("matches no LLM call span" in p for p in problems), problems


def test_agents_select_by_name_and_sql_shows_the_names(runs) -> None:
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from store.views import connect_readonly

    store = runs["strands"][3]
    convert_store(parse_store(store), ConvertConfig(quiet_s=0, missing_reward="fill", agents="calculator"), rebuild=True)
    con = connect_readonly(parse_store(store))
    got = con.sql("SELECT agent_name, trainable, count(*) FROM transitions GROUP BY ALL ORDER BY ALL").fetchall()
    con.close()
    assert got == [("calculator", True, 4), ("weather", False, 8)]
