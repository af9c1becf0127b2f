"""Reward functions for the driver tests, loaded by path (``--reward tests/rollout/reward_fns.py:exact``)."""


def exact(task: dict, stdout: str) -> float:
    """1.0 when the agent printed the task's expected answer, else 0.0."""
    return 1.0 if stdout.strip() == str(task.get("expect", "42")) else 0.0


def broken(task: dict, stdout: str) -> float:
    raise ValueError("reward bug")
