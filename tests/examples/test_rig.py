"""The example rig itself: scripted engine → real gateway → converter join, on a plain openai agent."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_rig import prompt_text, token_ids
from tracerl_testing import BIN

pytestmark = pytest.mark.slow
AGENT = Path(__file__).resolve().parents[1] / "span_to_transition" / "gateway_agent.py"


def test_scripted_engine_answers_are_joined_exactly_through_the_gateway(stack_factory) -> None:
    stack = stack_factory(lambda body: {"content": "Sunny."})
    stack.rollout(BIN, ["python", str(AGENT)], [{"id": "t1", "q": "weather"}])
    rows = stack.transitions()
    assert len(rows) == 2  # one plain call, one streamed call; gateway spans joined, not counted
    for row, request in zip(rows, stack.engine.requests):
        assert row["token_source"] == "gateway"
        assert row["response_token_ids"] == token_ids("Sunny.")
        assert row["prompt_token_ids"] == token_ids(prompt_text(request))
        assert row["response_logprobs"] == [-0.25] * len("Sunny.")
        assert row["task_id"] == "t1"
