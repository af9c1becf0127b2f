"""What ``tracerl check`` prints after one run of a new agent: what was captured, as the trainer will see it (pure
rendering over read-only queries), and framework-aware fixes for a run that captured nothing.

``captured(con)`` reads the store's views: spans by instrumentation scope, then every transition with its agent,
``token_source``, reward and, message by message, the prompt and response the trainer will tokenize.
``framework_hints(installed, facts)`` names what a known framework needs when its calls were not captured:
frameworks whose instrumentors must run after the import, instrumentors ``opentelemetry-instrument`` skips
without a word.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from span_to_transition.doctor_finding import Finding

FRAMEWORK_HINTS: dict[str, str] = {
    "haystack-ai": (
        "Haystack: openinference-instrumentation-haystack wraps only the components that exist when it starts, and "
        "opentelemetry-instrument starts it before your script imports Haystack, so it records nothing; add "
        "`from openinference.instrumentation.haystack import HaystackInstrumentor; "
        "HaystackInstrumentor().instrument()` after `import haystack` in the agent (it then records message text "
        "only: instrument the OpenAI client too, e.g. opentelemetry-instrumentation-openai, for tool calls)"
    ),
}
"""Distribution name (as installed in the agent's environment) -> what its tracing needs, shown when the run
captured no LLM call."""


def _text(content: Any, limit: int = 160) -> str:
    if isinstance(content, list):
        content = " ".join(p.get("text", f"[{p.get('type')}]") for p in content if isinstance(p, dict))
    text = ("" if content is None else str(content)).replace(
        "\n", "\\n"
    )  # one message, one line: a newline as \n
    return text if len(text) <= limit else text[: limit - 3] + "..."


def message_lines(m: dict[str, Any]) -> list[str]:
    """One chat message as the trainer sees it: role, text, tool calls, the id a tool result answers."""
    head = m.get("role", "?") + (f" (answers {m['tool_call_id']})" if m.get("tool_call_id") else "")
    lines = [f"{head}: {_text(m.get('content'))}"]
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        lines.append(f"  -> tool call {c.get('id')}: {fn.get('name')}({_text(fn.get('arguments'), 80)})")
    return lines


def captured(con: Any) -> str:
    """Spans by scope and every transition, message by message (``con``: the store's read-only views)."""
    out = ["spans by instrumentation scope:"]
    scopes = con.sql(
        "SELECT coalesce(scope_name, '(none)'), count(*) FROM spans GROUP BY 1 ORDER BY 2 DESC"
    ).fetchall()
    out += [f"  {scope}: {n}" for scope, n in scopes] or ["  (no spans)"]
    rows = con.sql(
        "SELECT rollout_id, step, agent_name, token_source, trainable, untrainable_reason, reward, reward_source, "
        "prompt_messages, response_message FROM transitions ORDER BY rollout_id, step"
    ).fetchall()
    out.append(f"calls converted: {len(rows)}")
    for rollout, step, agent, source, trainable, why, reward, reward_source, prompt, response in rows:
        out.append(
            f"- rollout {rollout} step {step}: agent {agent or '(none)'}, token_source {source}, "
            f"trainable {trainable}{f' ({why})' if why else ''}, reward {reward} ({reward_source})"
        )
        for m in json.loads(prompt or "[]"):
            out += ["    " + line for line in message_lines(m)]
        resp = json.loads(response or "null")
        out += ["    => " + line for line in (message_lines(resp) if resp else ["(token ids only)"])]
    return "\n".join(out)


def agent_hint(transitions: int, without_agent: int) -> str | None:
    """A hint (not a problem: without ``--agents`` every call trains) when calls have no agent name, with the
    ways to name one that need no code."""
    if not without_agent:
        return None
    return (
        f"{without_agent} of {transitions} calls have no agent name (no span above them names an agent), so "
        "--agents REGEX cannot select them; name the agent without code: run the agent process with "
        "OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=NAME (also before tracerl check: it keeps that variable), or "
        "convert with --agent-from span-name (the nearest chain span's name, e.g. DSPy's ReAct.forward -> ReAct)"
    )


def framework_hints(installed: set[str], calls_captured: bool) -> list[str]:
    """Fixes for the frameworks installed in the agent's environment, when the run captured no LLM call."""
    if calls_captured:
        return []
    return [hint for dist, hint in FRAMEWORK_HINTS.items() if dist in installed]


def instrumentor_findings(probe: dict[str, Any], python: str) -> list[Finding]:
    """Installed instrumentors that ``opentelemetry-instrument`` skips at startup (with only a debug log), each
    with the pip command that fixes it. ``probe``: ``tracerl/commands/check_probe.py``'s facts from the agent's
    Python (``python``); each instrumentor's ``conflict`` is the one opentelemetry-instrument computes itself.

    A conflict is a problem when the library it instruments is there: installed at a version outside the
    instrumentor's range, or installed while another requirement of its ``[instruments]`` extra is not (the
    extra was left out). When none of its libraries is installed the agent does not use them: no finding.
    """
    out = []
    for ins in probe.get("instrumentors", []):
        conflict = ins.get("conflict")
        if not conflict:
            continue
        label = f"{ins['name']} ({ins['dist']} {ins['version']})"
        pip = f"{shlex.quote(python)} -m pip install"
        present = [t for t in ins.get("targets", []) if t.get("installed")]
        means = (
            "opentelemetry-instrument skips it at startup (a debug log, nothing else), so nothing of "
            f"{', '.join(t['name'] for t in present) or 'its library'} is recorded"
        )
        if conflict.get("found") or conflict.get("found_any"):
            found = conflict.get("found") or ", ".join(conflict["found_any"])
            # the requirement as pip takes it: without its marker (``; extra == "instruments"``)
            wanted = [
                w.split(";", 1)[0].strip()
                for w in (
                    [conflict["required"]] if conflict.get("required") else conflict.get("required_any", [])
                )
            ]
            out.append(
                Finding(
                    problem=f"instrumentation {ins['name']} is skipped: the installed {found} is outside its range",
                    saw=f"{label} instruments {' or '.join(wanted)}; the agent's environment has {found}",
                    means=means,
                    fix=f"{pip} {shlex.quote(wanted[0])} (or install the release of {ins['dist']} that instruments {found})",
                )
            )
        elif present:
            missing = [t for t in ins.get("targets", []) if not t.get("installed")]
            extra = missing[0]["extra"] if missing else "instruments"
            spec = f"{ins['dist']}[{extra}]=={ins['version']}"
            out.append(
                Finding(
                    problem=f"instrumentation {ins['name']} is skipped: its [{extra}] extra is not installed",
                    saw=f"{label} needs {', '.join(t['requirement'] for t in missing) or conflict.get('message')}, "
                    f"which the agent's environment lacks; it has "
                    + ", ".join(f"{t['name']} {t['installed']}" for t in present),
                    means=means,
                    fix=f"{pip} {shlex.quote(spec)}",
                )
            )
    return out
