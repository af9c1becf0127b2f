"""``tracerl doctor``: for each way a store can yield no (or few) transitions, the finding names the fix.

Stores are real Parquet, built from the recorded instrumentation fixtures (pushed through the
collector's OTLP decode path) or the span factory; ``gather`` reads them as the command does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from tracerl_testing import tracerl

from schemas.tables import SPANS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.dialects.registry import classify
from span_to_transition.doctor import Finding, diagnose
from span_to_transition.records import Span
from span_to_transition.rewards import in_band_rewards
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.location import parse_store

from .factory import TraceBuilder, fixture_tables, spans_table, user
from .test_store import put, side_reward
from .test_tokens import gateway_attrs

S = 1_000_000_000
LATER = 2_000_000_000 * S


def edited(
    name: str,
    keep: Callable[[dict], bool] = lambda row: True,
    drop_keys: Callable[[str], bool] = lambda key: False,
) -> pa.Table:
    """A recorded fixture's spans with some rows or attribute keys removed (what a differently
    configured instrumentation would have sent)."""
    traces, _ = fixture_tables(name)
    rows = [r for r in traces.to_pylist() if keep(r)]
    for r in rows:
        r["attributes"] = [(k, v) for k, v in r["attributes"] if not drop_keys(k)]
    return pa.Table.from_pylist(rows, schema=SPANS_SCHEMA)


def findings(store: Path, **kw: object) -> list[Finding]:
    return diagnose(gather(parse_store(store), now_ns=kw.pop("now_ns", LATER), **kw))  # type: ignore[arg-type]


def problems(store: Path, **kw: object) -> dict[str, Finding]:
    return {f.problem: f for f in findings(store, **kw)}


def one(store: Path, starts: str, **kw: object) -> Finding:
    [hit] = [f for p, f in problems(store, **kw).items() if p.startswith(starts)]
    return hit


def healthy_rollout(trace_id: str, reward: float = 1.0) -> list[Span]:
    """One run of task "2+2?" served by policy@0 (what round 0 trains), through the gateway, rewarded."""
    t = TraceBuilder(trace_id, received_at_ns=100 * S)
    root = t.span("invoke_agent solver", agent="solver")
    call = t.chat(root, [user("2+2?")], "4", response_id=f"r-{trace_id[:4]}", model="policy@0")
    t.span("gateway chat", call, gateway_attrs(f"r-{trace_id[:4]}", [1, 2, 3], [4, 5], version=0))
    t.reward(root, reward)
    return t.spans


@pytest.mark.slow
def test_a_healthy_store_exits_0(store: Path) -> None:
    """Healthy means the next round would train: two runs of one task with different rewards."""
    put(store, "spans", spans_table(healthy_rollout("a" * 32, 1.0) + healthy_rollout("b" * 32, 0.0)), "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert findings(store) == []
    done = tracerl("doctor", "--store", str(store), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "healthy" in done.stdout


def test_an_empty_store_says_where_spans_come_from(store: Path) -> None:
    (store / "spans").mkdir(parents=True)
    f = one(store, "no spans")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in f.fix and "tracerl collect" in f.fix


def test_no_llm_spans_lists_the_scopes_it_did_see(store: Path) -> None:
    put(store, "spans", edited("openllmetry", keep=lambda r: r["name"] != "openai.chat"), "a")
    f = one(store, "no LLM spans")
    assert "weather-agent (3)" in f.saw
    assert "opentelemetry-instrumentation-openai-v2" in f.fix and "OPENAI_BASE_URL" in f.fix


def test_content_capture_off_names_the_setting_of_each_instrumentation(store: Path) -> None:
    put(
        store, "spans", fixture_tables("openai-v2-events")[0], "contrib"
    )  # its messages were log records, not sent
    put(
        store,
        "spans",
        edited("openllmetry", drop_keys=lambda k: k.endswith((".messages", "tool.definitions"))),
        "openllmetry",
    )
    put(
        store,
        "spans",
        edited(
            "openinference", drop_keys=lambda k: k.startswith(("llm.input_messages", "llm.output_messages"))
        ),
        "oi",
    )
    got = {p: f for p, f in problems(store).items() if p.startswith("content capture is off")}
    assert set(got) == {
        "content capture is off (OpenTelemetry contrib openai-v2)",
        "content capture is off (OpenLLMetry (traceloop))",
        "content capture is off (OpenInference)",
    }
    contrib = got["content capture is off (OpenTelemetry contrib openai-v2)"]
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY" in contrib.fix
    assert "2 LLM call spans from scope opentelemetry.instrumentation.openai_v2" in contrib.saw
    assert "TRACELOOP_TRACE_CONTENT=true" in got["content capture is off (OpenLLMetry (traceloop))"].fix
    assert "OPENINFERENCE_HIDE_INPUTS" in got["content capture is off (OpenInference)"].fix


def test_the_same_calls_with_their_log_records_are_fine(store: Path) -> None:
    traces, logs = fixture_tables("openai-v2-events")
    put(store, "spans", traces, "a")
    put(store, "logs", logs, "a")
    assert not [p for p in problems(store) if "content" in p or "prompt" in p]


def test_calls_whose_log_records_went_missing_are_counted_apart(store: Path) -> None:
    traces, logs = fixture_tables("openai-v2-events")
    first_call = logs.column("span_id")[0].as_py()
    put(store, "spans", traces, "a")
    put(store, "logs", logs.filter(pc.equal(logs.column("span_id"), first_call)), "a")
    f = one(store, "content capture is off")
    assert f.saw.startswith("1 LLM call span from scope opentelemetry.instrumentation.openai_v2")


def test_calls_with_a_response_but_no_prompt(store: Path) -> None:
    put(store, "spans", edited("openinference", drop_keys=lambda k: k.startswith("llm.input_messages")), "a")
    f = one(store, "LLM calls without prompt messages (OpenInference)")
    assert "2 LLM call spans" in f.saw and "OPENINFERENCE_HIDE_INPUT_MESSAGES" in f.fix


def test_a_call_spelling_no_dialect_reads_shows_a_sample_of_its_keys(store: Path) -> None:
    t = TraceBuilder("c" * 32, received_at_ns=100 * S)
    root = t.span("invoke_agent solver", agent="solver")
    t.span(
        "llm call", root, {"gen_ai.request.model": "policy", "custom.prompt_text": "hi", "custom.reply": "ho"}
    )
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "a")
    f = one(store, "LLM calls in a dialect this converter does not read")
    assert "custom.prompt_text, custom.reply, gen_ai.request.model" in f.saw and "'llm call'" in f.saw
    assert "OPENAI_BASE_URL" in f.fix


def test_vercel_ai_sdk_calls_are_read_and_not_reported(store: Path) -> None:
    """The Vercel AI SDK's spelling (ai.* attributes): the converter reads it, so the doctor reports no unread dialect."""
    t = TraceBuilder("d" * 32, received_at_ns=100 * S)
    root = t.span("ai.generateText", None, {"ai.operationId": "ai.generateText"})
    call = t.span(
        "ai.generateText.doGenerate",
        root,
        {
            "ai.operationId": "ai.generateText.doGenerate",
            "ai.model.id": "policy",
            "gen_ai.system": "openai.chat",
            "ai.prompt.messages": json.dumps([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
            "ai.response.text": "hello",
            "ai.response.finishReason": "stop",
        },
    )
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "a")
    assert classify(call.attributes) is not None  # the converter reads the Vercel AI SDK's spelling
    assert not [p for p in problems(store) if p.startswith("LLM calls in a dialect")]


def test_no_rewards_lists_every_spelling_and_the_fix(store: Path) -> None:
    put(store, "spans", edited("openai-v2", keep=lambda r: r["name"] != "reward"), "a")
    f = one(store, "no rewards")
    for spelling in (
        "tracerl.reward: 0",
        "agentlightning.reward: 0",
        "agentops.task.output: 0",
        "gen_ai.evaluation.result: 0",
        "rewards table: 0",
    ):
        assert spelling in f.saw
    assert "tracerl.reward" in f.fix and "/v1/rewards" in f.fix and "--missing-reward fill" in f.fix


def test_a_side_channel_reward_counts(store: Path) -> None:
    put(store, "spans", edited("openai-v2", keep=lambda r: r["name"] != "reward"), "a")
    put(store, "rewards", side_reward("x1", 1.0, trace_id="0" * 32), "r")
    assert "no rewards" not in problems(store)


def test_agentops_reward_payloads_are_read_and_raise_no_reward_problem(store: Path) -> None:
    """AgentOps' reward payload: the converter reads it (``rewards._agentops``), so the doctor neither
    names it as an unread spelling nor reports the store as unrewarded."""
    t = TraceBuilder("e" * 32, received_at_ns=100 * S)
    root = t.span("invoke_agent solver", agent="solver")
    t.chat(root, [user("hi")], "ho", response_id="r1")
    reward = t.span(
        "agentops.task", root, {"agentops.task.output": json.dumps({"type": "reward", "value": 1.0})}
    )
    put(store, "spans", spans_table(t.spans), "a")
    assert [(r.value, r.span_id) for r in in_band_rewards([reward])] == [(1.0, reward.span_id)]
    got = problems(store)
    assert not [p for p in got if p.startswith("rewards in a spelling")]
    assert "no rewards" not in got


def test_no_token_ids_means_the_gateway_is_not_in_the_path(store: Path) -> None:
    put(store, "spans", fixture_tables("openllmetry")[0], "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    f = one(store, "no token ids")
    assert "all 2 transitions are retokenized" in f.saw
    assert "tracerl gateway" in f.fix and "OPENAI_BASE_URL=http://127.0.0.1:8100/v1" in f.fix


def test_gateway_spans_without_a_parent_mean_traceparent_was_not_propagated(store: Path) -> None:
    t = TraceBuilder("f" * 32, received_at_ns=100 * S)
    root = t.span("invoke_agent solver", agent="solver")
    t.chat(root, [user("hi")], "ho", response_id="agent-side-id")
    t.reward(root, 1.0)
    g = TraceBuilder("9" * 32, received_at_ns=100 * S)
    g.span("gateway chat", None, gateway_attrs("gateway-side-id", [1], [2]))
    put(store, "spans", spans_table(t.spans + g.spans), "a")
    f = one(store, "gateway spans are not under the agent's call spans")
    assert "1 gateway span of 1 start a trace of their own" in f.saw
    assert "traceparent" in f.fix and "opentelemetry-instrumentation-httpx" in f.fix


def test_pending_rollouts_name_the_wait_they_are_on(store: Path) -> None:
    rooted = healthy_rollout("1" * 32)
    headless = TraceBuilder("2" * 32, received_at_ns=100 * S)
    headless._n = 10
    headless.chat(
        Span("2" * 32, "00000000000000ff", None, "gone", 0, 0, {}, {}, (), 0, "2" * 32),
        [user("hi")],
        "ho",
        response_id="r2",
    )
    put(store, "spans", spans_table(rooted + headless.spans), "a")
    f = one(store, "rollouts pending", now_ns=110 * S, quiet_s=30, max_wait_s=600)
    assert "1 rollout wait --quiet-s 30" in f.saw and "complete within 20s" in f.saw
    assert "1 rollout wait --max-wait-s 600" in f.saw and "within 590s" in f.saw
    assert "--quiet-s 0" in f.fix and "tracerl.rollout.end=true" in f.fix and "--max-wait-s" in f.fix
    convert_store(parse_store(store), ConvertConfig(quiet_s=30, max_wait_s=600), now_ns=131 * S)  # the rooted one converts
    f = one(store, "rollouts pending", now_ns=131 * S, quiet_s=30, max_wait_s=600)
    assert "--quiet-s" not in f.saw and "1 rollout wait --max-wait-s" in f.saw


@pytest.mark.slow
def test_cli_exit_codes_and_json(store: Path, tmp_path: Path) -> None:
    put(store, "spans", fixture_tables("openai-v2-events")[0], "a")
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    done = tracerl("doctor", "--store", str(store), check=False)
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == before  # read-only: nothing written
    assert done.returncode == 1
    assert (
        "content capture is off" in done.stdout
        and "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" in done.stdout
    )
    as_json = tracerl("doctor", "--store", str(store), "--json", check=False)
    assert {"problem", "saw", "means", "fix"} <= set(json.loads(as_json.stdout)[0])
    missing = tracerl("doctor", "--store", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode == 2 and "--store" in missing.stderr


def test_rollouts_excluded_for_want_of_a_reward_are_named(store: Path) -> None:
    unrewarded = TraceBuilder("3" * 32, received_at_ns=100 * S)
    unrewarded.chat(
        unrewarded.span("invoke_agent solver", agent="solver"), [user("hi")], "ho", response_id="r3"
    )
    put(store, "spans", spans_table(healthy_rollout("4" * 32) + unrewarded.spans), "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0), now_ns=LATER)
    f = one(store, "rollouts excluded for want of a reward")
    assert "1 rollout converted with no reward (e.g. " + "3" * 32 in f.saw and "tracerl.reward: 1" in f.saw
    assert "/v1/rewards" in f.fix


def test_span_events_and_wrapper_spans_raise_no_false_content_alarm(store: Path) -> None:
    """Strands keeps its messages in span events (both semconv styles); LlamaIndex's content-free LLM spans
    (``_prepare_chat_with_tools``, the outer ``achat``) are not calls; smolagents records internal roles."""
    for name in (
        "strands",
        "strands-latest",
        "llamaindex",
        "llamaindex-stream",
        "smolagents-stream",
        "crewai",
    ):
        put(store, "spans", fixture_tables(name)[0], name)
    assert not [p for p in problems(store) if "content" in p or "prompt" in p or "dialect" in p]


def test_an_empty_store_says_how_to_see_a_skipped_instrumentation(store: Path) -> None:
    (store / "spans").mkdir(parents=True)
    f = one(store, "no spans")
    assert "entry_points(group='opentelemetry_instrumentor')" in f.fix and "[instruments]" in f.fix


def test_only_gateway_spans_mean_the_agent_exported_nothing(store: Path) -> None:
    g = TraceBuilder("9" * 32, received_at_ns=100 * S)
    g.span("gateway chat", None, gateway_attrs("r1", [1], [2]))
    put(store, "spans", spans_table(g.spans), "a")
    got = problems(store)
    assert list(got) == ["no spans from the agent"]  # not a traceparent or token-id problem
    assert "get_dist_dependency_conflicts" in got["no spans from the agent"].fix


@pytest.mark.slow
def test_the_skipped_instrumentor_command_runs_and_names_each_instrumentor(tmp_path: Path) -> None:
    """The command the doctor prints, run as printed in an environment with opentelemetry-instrumentation."""
    import os
    import subprocess
    import sys

    from span_to_transition.doctor import SKIPPED_INSTRUMENTORS

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", SKIPPED_INSTRUMENTORS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "no instrumentor listed"
    assert all(len(line.split(" ", 1)) == 2 for line in done.stdout.strip().splitlines())


def test_calls_without_a_response_id_behind_an_unpropagated_gateway_are_explained(store: Path) -> None:
    put(store, "spans", fixture_tables("strands")[0], "agent")
    g = TraceBuilder("9" * 32, received_at_ns=100 * S)
    g.span("gateway chat", None, gateway_attrs("chatcmpl-strands-1", [1], [2]))
    put(store, "spans", spans_table(g.spans), "gw")
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER)
    assert any(
        "matches no LLM call span" in p for p in stats.problems
    )  # Strands' calls record no response id
    f = one(store, "gateway spans are not under the agent's call spans")
    assert "Strands records none" in f.means and "opentelemetry-instrumentation-openai" in f.fix


def test_rewards_the_reward_rule_does_not_select_are_named_with_the_rule_to_fix(store: Path) -> None:
    """A store only the judge scored, converted with ``--reward-from grade``: its rollouts are excluded, and the
    fix is the rule (naming the rewards there are), not more feedback."""
    judged = TraceBuilder("5" * 32, received_at_ns=100 * S)
    judged.chat(judged.span("invoke_agent solver", agent="solver"), [user("hi")], "ho", response_id="r5")
    put(store, "spans", spans_table(judged.spans), "a")
    put(store, "rewards", side_reward("j5", 0.5, trace_id="5" * 32), "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0, reward_from="grade"), now_ns=LATER)
    f = one(store, "rewards that --reward-from does not select")
    assert "1 rollout converted with no reward (e.g. " + "5" * 32 in f.saw
    assert "rewards named judge: 1" in f.saw and "--reward-from grade" in f.saw
    assert "--rebuild --reward-from judge" in f.fix
    assert not [p for p in problems(store) if p.startswith("rollouts excluded")]
    convert_store(parse_store(store), ConvertConfig(quiet_s=0, reward_from="judge"), now_ns=LATER, rebuild=True)
    assert not [p for p in problems(store) if "does not select" in p or p.startswith("rollouts excluded")]
