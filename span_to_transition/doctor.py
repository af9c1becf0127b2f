"""Why a store yields no (or few) transitions, and the fix: the logic of ``tracerl doctor``.

``survey.gather`` reads the store (read-only) into ``StoreFacts``; ``diagnose`` is pure: facts in,
``Finding`` s out, each saying what was seen, what it means and the exact fix. Samples are judged with the converter's own code (``classify``,
``parse_call``, ``in_band_rewards``), so the doctor agrees with ``tracerl convert`` about what it
reads; the spellings it only *recognises* (dialects and reward conventions the converter may not
read yet) are data below.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from schemas.attributes import PROMPT_TOKEN_IDS
from span_to_transition.dialects.attributes_only import CALL_OPERATIONS
from span_to_transition.dialects.registry import classify, parse_call
from span_to_transition.doctor_chat import (
    agent_findings,
    chat_findings,
    content_join_findings,
    responses_finding,
)
from span_to_transition.doctor_finding import Finding, plural
from span_to_transition.doctor_training import coverage_text, training_findings
from span_to_transition.records import Span
from span_to_transition.rewards import in_band_rewards, parse_reward_from
from span_to_transition.survey import REWARD_SPELLINGS, Pending, SpanGroup, StoreFacts
from span_to_transition.tokens import is_gateway

# ---------------------------------------------------------------------------------------------
# What the doctor recognises (data)

LLM_SIGNAL_KEYS = frozenset(
    {
        "gen_ai.system",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "llm.model_name",
        "llm.request.model",
        "ai.model.id",
        "ai.prompt.messages",
        "ai.response.text",
        "ai.response.toolCalls",
        "prompt_token_ids",
        "response_token_ids",
        "gen_ai.prompt",
        "gen_ai.completion",
    }
)
"""Attribute keys that mark a span as an LLM call in some instrumentation (semconv, OpenInference,
the Vercel AI SDK, Agent Lightning, AgentOps), whether or not the converter reads that dialect."""
LLM_SIGNAL_PREFIXES = (
    "llm.hosted_vllm.",
    "gen_ai.prompt.",
    "gen_ai.completion.",
    "llm.input_messages.",
    "llm.output_messages.",
    "ai.prompt.",
    "ai.response.",
)
LLM_SIGNAL_NAMES = (
    "openai.chat.completion",
    "litellm_request",
    "raw_gen_ai_request",
    "ai.generateText.doGenerate",
    "ai.streamText.doStream",
    "ai.generateObject.doGenerate",
    "ai.streamObject.doStream",
)
"""Span names of LLM calls: AgentOps, LiteLLM (Agent Lightning's proxy) and the Vercel AI SDK."""

TOKEN_ID_KEYS = (PROMPT_TOKEN_IDS, "prompt_token_ids", "llm.hosted_vllm.prompt_token_ids")
"""Token ids on a call span: tracerl's gateway/span convention, Agent Lightning, LiteLLM's hosted_vllm."""


CONTRIB_CAPTURE = (
    "export OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental "
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY in the agent's environment "
    "(older contrib versions: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true plus "
    "OTEL_LOGS_EXPORTER=otlp, which sends the messages as log records)"
)
INSTRUMENTATIONS: list[tuple[str, str, str]] = [
    ("opentelemetry.util.genai", "OpenTelemetry contrib GenAI (opentelemetry-util-genai)", CONTRIB_CAPTURE),
    ("opentelemetry.instrumentation.openai_v2", "OpenTelemetry contrib openai-v2", CONTRIB_CAPTURE),
    ("opentelemetry.instrumentation.google_genai", "OpenTelemetry contrib google-genai", CONTRIB_CAPTURE),
    ("opentelemetry.instrumentation.vertexai", "OpenTelemetry contrib vertexai", CONTRIB_CAPTURE),
    (
        "opentelemetry.instrumentation.",
        "OpenLLMetry (traceloop)",
        "export TRACELOOP_TRACE_CONTENT=true in the agent's environment (Traceloop.init(trace_content=True))",
    ),
    (
        "openinference.instrumentation",
        "OpenInference",
        "unset OPENINFERENCE_HIDE_INPUTS, OPENINFERENCE_HIDE_OUTPUTS, OPENINFERENCE_HIDE_INPUT_MESSAGES and "
        "OPENINFERENCE_HIDE_OUTPUT_MESSAGES (or set them to false), or pass TraceConfig(hide_inputs=False, "
        "hide_outputs=False) to the instrumentor",
    ),
    (
        "ai",
        "the Vercel AI SDK",
        "pass experimental_telemetry: { isEnabled: true, recordInputs: true, recordOutputs: true } to "
        "generateText / streamText",
    ),
    (
        "litellm",
        "LiteLLM",
        "set litellm.turn_off_message_logging = False (proxy: litellm_settings: "
        "turn_off_message_logging: false)",
    ),
]
"""Instrumentation scope (prefix; the first match wins) -> its name and how to turn content capture on."""
ANY_CAPTURE = (
    "turn on message content capture in the instrumentation that recorded the calls: contrib: "
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY with OTEL_SEMCONV_STABILITY_OPT_IN="
    "gen_ai_latest_experimental; OpenLLMetry: TRACELOOP_TRACE_CONTENT=true; OpenInference: "
    "OPENINFERENCE_HIDE_INPUTS / OPENINFERENCE_HIDE_OUTPUTS unset"
)

POINT_AT_GATEWAY = "point the agent at the gateway: OPENAI_BASE_URL=http://127.0.0.1:8100/v1"
GATEWAY_FIX = (
    "start the gateway in front of the model server (tracerl gateway --upstream URL --otlp "
    f"http://127.0.0.1:4317) and {POINT_AT_GATEWAY}"
)
SKIPPED_INSTRUMENTORS = (
    'python -c "from importlib.metadata import entry_points; from opentelemetry.instrumentation.dependencies '
    "import get_dist_dependency_conflicts as c; [print(e.name, c(e.dist) or 'ok') for e in "
    "entry_points(group='opentelemetry_instrumentor')]\""
)
"""Run in the agent's environment: each instrumentor ``opentelemetry-instrument`` would load, and the dependency
conflict that makes it skip one without a word (it logs the skip at debug level only). LlamaIndex's OpenInference
instrumentor, for one, is skipped unless its ``[instruments]`` extra's packages are installed."""
SKIPPED_HINT = (
    "; if the agent runs under opentelemetry-instrument and its framework's instrumentation sent nothing, "
    "opentelemetry-instrument may have skipped it silently for a dependency conflict: run "
    f"{SKIPPED_INSTRUMENTORS} in the agent's environment to see each instrumentor's conflict, and install what it "
    "names (e.g. pip install 'openinference-instrumentation-llama-index[instruments]')"
)
INSTRUMENT_FIX = (
    "instrument the agent's LLM client, e.g. pip install opentelemetry-instrumentation-openai (OpenLLMetry; it "
    "works with the openai 3.x client and propagates traceparent; the contrib opentelemetry-instrumentation-openai-v2 "
    "2.4b0 makes no spans with openai >= 3.57) and run the agent under opentelemetry-instrument with "
    "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317; or send its calls through the gateway, whose spans are "
    f"calls themselves ({POINT_AT_GATEWAY})" + SKIPPED_HINT
)


def instrumentation(scope: str | None) -> tuple[str, str]:
    """(name, content-capture fix) of the instrumentation that wrote spans with this scope."""
    for prefix, name, fix in INSTRUMENTATIONS:
        if scope and (scope == prefix or scope.startswith(prefix if prefix.endswith(".") else prefix + ".")):
            return name, fix
    return (f"scope {scope!r}" if scope else "an unnamed instrumentation scope"), ANY_CAPTURE


# ---------------------------------------------------------------------------------------------
# The diagnosis (pure)


def _is_signal(span: Span) -> bool:
    a = span.attributes
    op = a.get("gen_ai.operation.name")
    if op is not None and op not in CALL_OPERATIONS:  # an agent, tool or embeddings span, not a call
        return False
    return (
        span.name.startswith(LLM_SIGNAL_NAMES)
        or any(k in LLM_SIGNAL_KEYS for k in a)
        or any(k.startswith(LLM_SIGNAL_PREFIXES) for k in a)
    )


def _scopes_text(scopes: Mapping[str, int], limit: int = 8) -> str:
    top = sorted(scopes.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{s or '(no scope)'} ({n})" for s, n in top) or "none"


_plural = plural


def diagnose(f: StoreFacts) -> list[Finding]:
    """The problems in a store, most fundamental first; empty when it is healthy."""
    nothing = _nothing_from_the_agent(f)
    if nothing is not None:
        return [nothing]
    calls: list[SpanGroup] = []
    unread: list[SpanGroup] = []
    for g in f.groups:
        if is_gateway(g.sample):
            continue
        if classify(g.sample.attributes) is not None:
            calls.append(g)
        elif _is_signal(g.sample):
            unread.append(g)
    n_calls = sum(g.count for g in calls)
    out: list[Finding] = []
    if not calls and not unread and not f.gateway_spans:
        out.append(
            Finding(
                "no LLM spans",
                f"{_plural(f.spans, 'span')} from these instrumentation scopes: {_scopes_text(f.scopes)}; none "
                "records an LLM call in any dialect",
                "the agent's LLM client is not instrumented (only its framework or tools are), so there is nothing "
                "to train on",
                INSTRUMENT_FIX,
            )
        )
    out += [_unread_finding(g) for g in unread]
    out += _call_shape_findings(calls)
    out += chat_findings(f.untrainable)
    out += content_join_findings(f.content_join)
    out += agent_findings(f.transitions, f.transitions_without_agent, f.agents_setting)
    if n_calls or f.gateway_spans:
        out += _reward_findings(f)
        out += _token_findings(f, n_calls)
    if f.pending:
        out.append(_pending_finding(f))
    if f.training is not None:
        out += training_findings(f.training)
    return out


def _nothing_from_the_agent(f: StoreFacts) -> Finding | None:
    """The store holds no span at all, or only the gateway's: nothing else can be diagnosed."""
    if f.spans == 0:
        backlog = (
            (
                f" ({f.wal_backlog_bytes:,} bytes wait in the write-ahead log: the collector compacts them "
                "into spans/ when it runs)"
            )
            if f.wal_backlog_bytes
            else ""
        )
        return Finding(
            "no spans",
            f"spans/ is empty{backlog}",
            "no agent has exported traces to this store's collector yet",
            "run `tracerl collect --store DIR` and start the agent with OTEL_EXPORTER_OTLP_ENDPOINT="
            "http://127.0.0.1:4317 (OTLP/gRPC; http://127.0.0.1:4318 for OTLP/HTTP); "
            "check --store points at the collector's directory" + SKIPPED_HINT,
        )
    if f.gateway_spans and f.gateway_spans == f.spans:
        return Finding(
            "no spans from the agent",
            f"{_plural(f.spans, 'span')}, all from the tracerl gateway; none from the agent's process",
            "the gateway saw the calls, but the agent exported no span (its instrumentation did not load, or its "
            "exporter points elsewhere), so there are no prompts, agents or rewards to train on",
            "start the agent under opentelemetry-instrument with OTEL_EXPORTER_OTLP_ENDPOINT="
            "http://127.0.0.1:4317 (the collector)" + SKIPPED_HINT,
        )
    return None


def _unread_finding(g: SpanGroup) -> Finding:
    """Spans that look like LLM calls in no dialect the converter reads."""
    keys = ", ".join(sorted(g.sample.attributes)[:40])
    return Finding(
        f"LLM calls in a dialect this converter does not read ({instrumentation(g.scope)[0]})",
        f"{_plural(g.count, 'span')} like {g.sample.name!r} (scope {g.scope or '(none)'}) look like LLM calls; "
        f"a sample's attribute keys: {keys}",
        "the converter recognises none of its message spellings, so these calls yield no transitions",
        "route the agent's calls through the gateway, whose spans are read whatever the agent uses ("
        f"{POINT_AT_GATEWAY}); or report these attribute keys so the dialect can be added",
    )


def _call_shape_findings(calls: list[SpanGroup]) -> list[Finding]:
    """Call spans in a shape the converter cannot read (the Responses API's, unreadable), or with no prompt."""
    out: list[Finding] = []
    missing: dict[tuple[bool, str | None], int] = {}  # (has a response, scope) -> call spans with no prompt
    for g in calls:
        if g.wraps_call:  # a framework's outer record of a call recorded with its messages below it
            continue
        call = parse_call(g.sample, g.sample_logs)
        shape = responses_finding(g.sample, call, g.scope, g.count)
        if shape is not None:
            out.append(shape)
        elif call is not None and not call.messages:
            key = (call.response is not None, g.scope)
            missing[key] = missing.get(key, 0) + g.count
    return out + [_content_finding(scope, n, has_response) for (has_response, scope), n in missing.items()]


def _content_finding(scope: str | None, n: int, has_response: bool) -> Finding:
    """Call spans without prompt messages: content capture off, or (with a response) inputs hidden."""
    name, fix = instrumentation(scope)
    spans = f"{_plural(n, 'LLM call span')} from scope {scope or '(none)'}"
    if has_response:
        return Finding(
            f"LLM calls without prompt messages ({name})",
            f"{spans} record a response (or token ids) but no input messages",
            "the prompt of each call is unknown, so it cannot become a transition",
            f"record the inputs too: {fix}",
        )
    return Finding(
        f"content capture is off ({name})",
        f"{spans} carry model and usage but no prompt or response messages, on the span or in gen_ai.* log records",
        "without messages there is nothing to train on; these calls are not converted",
        fix,
    )


def _reward_findings(f: StoreFacts) -> list[Finding]:
    out: list[Finding] = []
    unread = [k for k, s in f.reward_samples.items() if not in_band_rewards([s])]
    for k in unread:
        out.append(
            Finding(
                f"rewards in a spelling this converter does not read ({k})",
                f"{_plural(f.rewards.get(k, 0), 'span')} carry {REWARD_SPELLINGS[k]}",
                "the rollouts they reward count as unrewarded",
                "also emit the reward as a span attribute tracerl.reward=VALUE (plain OpenTelemetry API), or POST "
                '{"rollout_id": ..., "value": ...} to the collector\'s /v1/rewards',
            )
        )
    seen = ", ".join(f"{k}: {f.rewards.get(k, 0)}" for k in REWARD_SPELLINGS)
    if not any(f.rewards.values()):
        blocking = f.missing_reward == "exclude"
        out.append(
            Finding(
                "no rewards",
                f"no reward on any channel ({seen})",
                "every rollout is excluded as unrewarded (convert --missing-reward exclude, the default)"
                if blocking
                else "every rollout is kept with a null reward and trains only once a reward (e.g. tracerl judge) "
                "arrives" if f.missing_reward == "keep"
                else "every rollout gets the fill reward, so there is no signal to learn from",
                "emit the reward from the agent (a span with attribute tracerl.reward=VALUE, e.g. "
                'span.set_attribute(\'tracerl.reward\', 1.0)), or POST {"rollout_id": ..., "value": ...} to the '
                "collector's /v1/rewards after judging the run; to train anyway: tracerl convert --missing-reward fill "
                "--fill-reward 0",
            )
        )
    elif f.excluded and (unselected := _unselected_rewards(f)):
        out.append(unselected)
    elif f.excluded:
        out.append(
            Finding(
                "rollouts excluded for want of a reward",
                f"{_plural(len(f.excluded), 'rollout')} converted with no reward (e.g. {', '.join(f.excluded[:3])}); "
                f"rewards seen elsewhere: {seen}"
                + (f"; feedback coverage: {coverage_text(f.training)}" if f.training is not None else ""),
                "these rollouts' calls are not in transitions/ until a reward arrives for them",
                'POST {"rollout_id": ..., "value": ...} to /v1/rewards (they are converted on the next pass), or '
                "emit tracerl.reward in every run; or convert --missing-reward fill --fill-reward 0",
            )
        )
    return out


def _unselected_rewards(f: StoreFacts) -> Finding | None:
    """Rollouts excluded as unrewarded while the rewards table holds rewards, none of a name the converter's
    ``--reward-from`` list selects (e.g. ``--reward-from grade`` on a store that only the judge scored):
    the fix is the rule, not more feedback."""
    rule = parse_reward_from(f.reward_from)
    if rule.names is None or not f.reward_names or set(f.reward_names) & rule.names:
        return None
    names = ", ".join(f"{n}: {c}" for n, c in f.reward_names.items())
    keep = ",".join(sorted(f.reward_names))
    return Finding(
        "rewards that --reward-from does not select",
        f"{_plural(len(f.excluded), 'rollout')} converted with no reward (e.g. {', '.join(f.excluded[:3])}), while "
        f"rewards/ holds rewards named {names}; these rows were converted with --reward-from {f.reward_from}, "
        "which selects none of those names",
        "no rollout of this store trains until its rewards are selected",
        f"convert again with the names to train on: tracerl convert --rebuild --reward-from {keep} (or auto: "
        "every reward but the judge's, the judge's where a rollout has no other)",
    )


def _token_findings(f: StoreFacts, n_calls: int) -> list[Finding]:
    retokenized = f.token_sources.get("retokenized", 0)
    exact = f.token_sources.get("gateway", 0) + f.token_sources.get("span", 0)
    if f.gateway_content_off and f.gateway_roots and (retokenized or not f.transitions):
        return [_content_off_finding(f, retokenized)]
    if f.gateway_spans and f.gateway_roots and (retokenized or not f.transitions):
        return [
            Finding(
                "gateway spans are not under the agent's call spans (traceparent not propagated)",
                f"{_plural(f.gateway_roots, 'gateway span')} of {f.gateway_spans} start a trace of their own"
                + (
                    f"; {retokenized} of {f.transitions} transitions have no exact token ids"
                    if retokenized
                    else ""
                ),
                "the gateway saw the calls but its spans join an agent call only by gen_ai.response.id; calls whose "
                "span records no response id (Strands records none) or another one fall back to retokenization "
                "(token ids may not match what the model sampled); `tracerl convert` names each such call",
                "let the agent's client send the W3C traceparent header to the gateway: instrument the OpenAI client "
                "with OpenLLMetry (pip install opentelemetry-instrumentation-openai: it injects traceparent and "
                "records gen_ai.response.id, also with openai 3.x), under the same tracer provider that exports to the "
                "collector (opentelemetry-instrumentation-httpx cannot: openai 3.x does not use httpx)",
            )
        ]
    if not f.gateway_spans and n_calls and not exact and not _has_span_ids(f):
        return [
            Finding(
                "no token ids",
                f"{_plural(n_calls, 'LLM call span')}, no gateway span (tracerl.gateway=true) and no token ids on "
                "the call spans"
                + (f"; all {f.transitions} transitions are retokenized" if f.transitions else ""),
                "the gateway is not in the path, so training re-renders messages with the chat template instead of "
                "the exact tokens the model sampled (and has no sampling logprobs)",
                GATEWAY_FIX,
            )
        ]
    return []


def _content_off_finding(f: StoreFacts, retokenized: int) -> Finding:
    """Gateway spans in traces of their own that record no content: no join (traceparent, response id, content)
    is left to give their calls the exact token ids."""
    return Finding(
        "the gateway records no content (--no-record-content), so the content join cannot apply",
        f"{_plural(f.gateway_content_off, 'gateway span')} of {f.gateway_spans} record no request messages or "
        f"response (tracerl.gateway.content_recorded=false); {f.gateway_roots} start a trace of their own"
        + (f"; {retokenized} of {f.transitions} transitions have no exact token ids" if retokenized else ""),
        "a gateway span joins its call by traceparent, by gen_ai.response.id, or by the request and response it "
        "recorded; this agent's client sends no traceparent and its calls' response ids match no gateway span, so "
        "with the content off its calls are retokenized (token ids may not match what the model sampled)",
        "run tracerl gateway without --no-record-content (each call's messages are then stored once more, on the "
        "gateway's span), or let the agent's client send traceparent and record the response id: instrument the "
        "OpenAI client with OpenLLMetry (pip install opentelemetry-instrumentation-openai)",
    )


def _has_span_ids(f: StoreFacts) -> bool:
    return any(k in g.sample.attributes for g in f.groups for k in TOKEN_ID_KEYS)


def _pending_finding(f: StoreFacts) -> Finding:
    by: dict[str, list[Pending]] = {}
    for p in f.pending:
        by.setdefault(p.wait, []).append(p)
    saw, fix = [], []
    quiet, root = by.get("waiting_quiet", []), by.get("waiting_root", [])
    if quiet:
        saw.append(
            f"{_plural(len(quiet), 'rollout')} wait --quiet-s {f.quiet_s:g} (root span ended; "
            f"complete within {max(p.seconds_left for p in quiet):.0f}s; e.g. {quiet[0].rollout_id})"
        )
        fix.append("if the agent has finished, convert now with tracerl convert --quiet-s 0")
    if root:
        saw.append(
            f"{_plural(len(root), 'rollout')} wait --max-wait-s {f.max_wait_s:g} (no root span yet; "
            f"converted with a repaired tree within {max(p.seconds_left for p in root):.0f}s; "
            f"e.g. {root[0].rollout_id})"
        )
        fix.append(
            "make the agent end its top-level span and flush before it exits (tracer_provider.shutdown()), "
            "or set tracerl.rollout.end=true on its last span; to convert sooner, lower --max-wait-s"
        )
    return Finding(
        "rollouts pending",
        "; ".join(saw),
        "they are not complete yet, so they have no transitions",
        "; ".join(fix),
    )


def report(findings: list[Finding], store: str) -> str:
    """What ``tracerl doctor`` prints."""
    if not findings:
        return (
            f"{store}: healthy (spans with LLM calls, content, rewards and exact token ids; nothing pending; "
            "the next round has rollouts with a learning signal)"
        )
    head = f"{store}: {_plural(len(findings), 'problem')}"
    return "\n\n".join([head, *(x.text() for x in findings)])


def as_json(findings: list[Finding]) -> str:
    return json.dumps([dataclasses.asdict(x) for x in findings], indent=2)
