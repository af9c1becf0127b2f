"""``tracerl judge``'s settings: one dataclass, the CLI flags and the stage read the same fields.

This is the judge package's only import of the CLI helpers (``opt``, ``UsageError``, ``add_options``,
``from_args``), so moving them to their ground-floor home is a one-line change here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from options import UsageError, add_options, from_args, opt
from store.layout import default_store

__all__ = ["MODES", "JudgeSettings", "UsageError", "add_options", "api_key", "from_args"]

MODES = ("group", "pointwise")
API_KEY_ENV = ("TRACERL_JUDGE_API_KEY", "OPENAI_API_KEY")


@dataclass
class JudgeSettings:
    """Who judges, against what, and how hard to push the endpoint."""

    store: str = opt(
        default_store(), "store directory, or s3://bucket/prefix", metavar="DIR|URI", env="TRACERL_STORE"
    )
    judge_url: str = opt(
        "http://127.0.0.1:8000/v1",
        "OpenAI-compatible base URL of the judge (vLLM, "
        "`tracerl serve`, a hosted API); the key comes from TRACERL_JUDGE_API_KEY or "
        "OPENAI_API_KEY",
        metavar="URL",
        env="TRACERL_JUDGE_URL",
    )
    judge_model: str | None = opt(
        None, "model name the judge endpoint serves (required)", metavar="NAME", env="TRACERL_JUDGE_MODEL"
    )
    mode: str = opt(
        "group",
        "group: one call per task ranks its rollouts against each other (RULER-style, "
        "shared prefix sent once); pointwise: one call per rollout scores it against the rubric "
        "(live traffic, where no task repeats)",
        choices=list(MODES),
    )
    rubric: str | None = opt(
        None,
        "file with the rubric text (what a good trajectory does); unset: the "
        "packaged default rubric (judge/default_rubric.md)",
        metavar="FILE",
    )
    name: str = opt(
        "judge", "reward name of the rows written; rollouts with a reward of this name are never judged again"
    )
    unrewarded_only: bool = opt(
        False,
        "judge only rollouts with no selected reward (their transitions' reward is null: converted with "
        "--missing-reward keep). Under the converter's --reward-from auto a graded rollout trains on its "
        "grader whatever the judge says, so this only saves the judge calls that would measure agreement",
    )
    judge_concurrency: int = opt(4, "judge requests in flight at once")
    judge_timeout_s: float = opt(
        120.0, "seconds one judge request may take; a timeout leaves its rollouts waiting for the next pass"
    )
    group_wait_s: float = opt(
        30.0,
        "group mode: judge a task's rollouts once its newest one ended this many "
        "seconds ago (its siblings have had time to arrive)",
    )
    max_group: int = opt(
        16, "group mode: at most this many rollouts per judge call (a larger task is judged in chunks)"
    )
    max_tokens: int = opt(
        200,
        "answer tokens the judge may use per trajectory (plus 64 for the JSON frame); the schema caps an "
        "explanation at 160 characters, so 200 lets guided decoding close the JSON even at a token per character",
    )
    retry_failed: bool = opt(
        False,
        "judge again the groups whose answer could not be parsed before (by "
        "default a failed group is not paid for twice with the same rubric)",
    )
    every_s: float = opt(30.0, "--watch: seconds between passes")
    json: bool = opt(False, "print the pass's stats as JSON")

    def validate(self) -> None:
        """Raise UsageError naming the bad setting and the fix."""
        if not self.judge_model:
            raise UsageError(
                "--judge-model is required: the model name the judge endpoint serves "
                "(e.g. --judge-model gpt-4.1-mini, or the name `vllm serve` was given)"
            )
        if not self.judge_url.startswith(("http://", "https://")):
            raise UsageError(
                f"--judge-url {self.judge_url!r} must start with http:// or https:// "
                "(the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1)"
            )
        if self.mode not in MODES:
            raise UsageError(f"--mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        for flag, value, least in (
            ("--judge-concurrency", self.judge_concurrency, 1),
            ("--max-group", self.max_group, 1),
            ("--max-tokens", self.max_tokens, 8),
        ):
            if value < least:
                raise UsageError(f"{flag} {value} must be >= {least}")
        if self.judge_timeout_s <= 0 or self.group_wait_s < 0 or self.every_s <= 0:
            raise UsageError("--judge-timeout-s and --every-s must be > 0 and --group-wait-s >= 0")
        if self.rubric is not None and not os.path.isfile(self.rubric):
            raise UsageError(
                f"--rubric {self.rubric}: no such file; write the rubric as plain text in a file "
                "or leave --rubric out for the packaged default"
            )


def api_key() -> str | None:
    """The judge endpoint's key from the environment (never a flag: argv is visible to every user)."""
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None
