"""A calculator agent written the ordinary AutoGen AgentChat 0.7 way: a solver with a tool, and a verifier.

The `solver` (an `AssistantAgent`) answers an arithmetic word problem with the help of a
`calculator` tool; the `verifier` (a second `AssistantAgent`) checks the solution and says APPROVE,
or what is wrong, in which case the solver tries again. Both take turns in a `RoundRobinGroupChat`
that stops when the verifier says APPROVE (or after `CALC_MAX_MESSAGES` messages).

It knows nothing of tracerl: AutoGen itself emits OpenTelemetry GenAI spans (`invoke_agent solver`,
`execute_tool calculator`) through the global tracer provider that `opentelemetry-instrument` sets
up, OpenLLMetry (`opentelemetry-instrumentation-openai`) records each model call under them, and
environment variables say where the model (OPENAI_BASE_URL) and the collector
(OTEL_EXPORTER_OTLP_ENDPOINT) are.

Task (JSON on stdin, or as the first argument, or in $TRACERL_TASK): {"id": ..., "question": "..."}.
Prints one JSON line: {"answer": <the last number in the solver's final message, or null>,
"final": <that message>, "approved": <whether the verifier approved>}.
"""

import ast
import asyncio
import json
import operator
import os
import re
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core.models import ModelFamily
from autogen_ext.models.openai import OpenAIChatCompletionClient

MODEL = os.environ.get("CALC_MODEL", "policy")
MAX_MESSAGES = int(os.environ.get("CALC_MAX_MESSAGES", "8"))
MAX_TOKENS = int(os.environ.get("CALC_MAX_TOKENS", "256"))
TEMPERATURE = float(os.environ.get("CALC_TEMPERATURE", "1.0"))

SOLVER_PROMPT = (
    "You solve arithmetic word problems. Write the arithmetic as one expression and evaluate it with "
    "the calculator tool; never do arithmetic in your head. Then reply with one short sentence that "
    "ends with the final number, e.g. 'The answer is 42.'"
)
VERIFIER_PROMPT = (
    "You check a solution to an arithmetic word problem. If the solver's final number answers the "
    "question, reply with the single word APPROVE. Otherwise say in one sentence what is wrong."
)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64  # keeps 9**9**9 from hanging the agent


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. '(12 + 7) * 3 / 4'. Supports + - * / // % ** and parentheses."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:.10g}" if isinstance(value, float) else str(value)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), as the agent's answer."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "") if found else None


def read_task() -> dict:
    """The task from the first argument, else stdin, else $TRACERL_TASK (whatever the launcher gives)."""
    if len(sys.argv) > 1:
        return json.loads(sys.argv[1])
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    return json.loads(text.strip() or os.environ["TRACERL_TASK"])


def model_client() -> OpenAIChatCompletionClient:
    """The chat-completions client for an OpenAI-compatible server. ``model_info`` is required because
    the served name (``policy``) is not an OpenAI model AutoGen knows; it says tools are supported."""
    return OpenAIChatCompletionClient(
        model=MODEL,
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        model_info={"vision": False, "function_calling": True, "json_output": False,
                    "family": ModelFamily.UNKNOWN, "structured_output": False},
    )


async def solve(question: str) -> dict:
    """Run the solver/verifier chat on ``question``; the answer is the solver's last message, whose
    number the reward reads (so a rejected-then-fixed answer counts, a rejected last one too)."""
    client = model_client()
    # max_tool_iterations lets the solver chain a few calculator calls; reflect_on_tool_use makes its last
    # word a model-written sentence (not the raw tool result), should it still be calling tools at the end.
    solver = AssistantAgent("solver", model_client=client, tools=[calculator], system_message=SOLVER_PROMPT,
                            description="Solves arithmetic word problems with a calculator.",
                            max_tool_iterations=3, reflect_on_tool_use=True)
    verifier = AssistantAgent("verifier", model_client=client, system_message=VERIFIER_PROMPT,
                              description="Checks the solver's answer.")
    done = TextMentionTermination("APPROVE", sources=["verifier"]) | MaxMessageTermination(MAX_MESSAGES)
    team = RoundRobinGroupChat([solver, verifier], termination_condition=done)
    try:
        result = await team.run(task=question)
    finally:
        await client.close()
    said = [m for m in result.messages if isinstance(m, TextMessage)]
    final = next((m.content for m in reversed(said) if m.source == "solver"), "")
    approved = any(m.source == "verifier" and "APPROVE" in m.content for m in said)
    return {"answer": last_number(final), "final": final, "approved": approved}


def main() -> None:
    task = read_task()
    print(json.dumps(asyncio.run(solve(task["question"]))))


if __name__ == "__main__":
    main()
